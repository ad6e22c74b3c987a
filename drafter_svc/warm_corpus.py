"""Where the drafters that learn from outputs (`suffix`, `trie`) start: the target's own answers to the
prompts of a public chat set, as if the deployment had served those requests before. Their global caches
then hold the model's habitual phrasing from the first request on, and new outputs take the oldest's place
as usual. A corpus ships for the default model (README: how it was made); `specd train corpus` makes one
for any model. A corpus is token ids, so it belongs to the tokenizer of the model it was made with."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specd.model_store import DEFAULT_MODEL

CORPORA_DIR = Path(__file__).resolve().parent / "corpora"
SHIPPED = {DEFAULT_MODEL: CORPORA_DIR / f"{DEFAULT_MODEL}.npz"}
NO_CORPUS = "none"


def save(path: Path, outputs: list[list[int]], model: str) -> None:
    """`outputs` (token id lists) into one compressed file, with the model they came from."""
    lengths = np.array([len(output) for output in outputs], dtype=np.int64)
    tokens = np.array([token for output in outputs for token in output], dtype=np.uint32)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:  # a file object: savez would append .npz to a path without it
        np.savez_compressed(file, tokens=tokens, lengths=lengths, model=np.array(model))


def load(path: Path) -> list[list[int]]:
    """The outputs `save` stored, in order."""
    with np.load(path) as corpus:
        tokens, lengths = corpus["tokens"].tolist(), corpus["lengths"].tolist()
    ends = np.cumsum(lengths).tolist()
    return [tokens[end - length:end] for end, length in zip(ends, lengths)]


def model_of(path: Path) -> str:
    """The model whose answers the corpus holds, as `specd train corpus` was given it."""
    with np.load(path) as corpus:
        return str(corpus["model"])


def resolve(spec: str | None, model: str) -> Path | None:
    """The corpus a drafter starts from: the file `spec` names, none for "none", or with no `spec` the corpus
    shipped for `model` (none where no corpus ships for it)."""
    if spec == NO_CORPUS:
        return None
    if spec is not None:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"warm corpus {spec!r} is not a file (make one with `specd train corpus`, "
                                    f"or pass {NO_CORPUS!r})")
        return path
    shipped = SHIPPED.get(model)
    return shipped if shipped is not None and shipped.is_file() else None
