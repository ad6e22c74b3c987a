"""The EAGLE heads that ship with specd, by the target model they were trained for (README: how each was made)."""
from __future__ import annotations

from pathlib import Path

from specd.model_store import DEFAULT_MODEL

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
SHIPPED = {DEFAULT_MODEL: HEADS_DIR / DEFAULT_MODEL}


def shipped_head(model: str) -> Path:
    """The head shipped for `model`; FileNotFoundError (saying how to train one) where there is none."""
    head = SHIPPED.get(model)
    if head is None or not (head / "eagle_config.json").exists():
        raise FileNotFoundError(f"no EAGLE head ships for {model!r}: train one with `specd train eagle --model "
                                f"{model} --output DIR` and serve it with --eagle-head DIR")
    return head
