"""Bundled model configs under short preset names and the Hugging Face ids they came from
(:mod:`kvledger.spec.names` resolves any model name with these tables).

Each preset is a verbatim Hugging Face ``config.json`` shipped in ``kvledger/spec/configs/``
(see ``SOURCES.md`` there). The preset name is the model name lower-cased
(``meta-llama--Llama-3.1-8B`` -> ``llama-3.1-8b``), plus short aliases.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kvledger.errors import ConfigError, shorten

CONFIG_DIR = Path(__file__).parent / "configs"

ALIASES: dict[str, str] = {
    "smollm2-135m": "smollm2-135m-instruct",
    "mistral-7b": "mistral-7b-v0.1",
    "mixtral-8x7b": "mixtral-8x7b-v0.1",
    "llama-2-7b": "llama-2-7b-hf",
    "llama-2-70b": "llama-2-70b-hf",
    "phi-3-mini": "phi-3-mini-128k-instruct",
    "gemma-3-270m": "gemma-3-270m-it",
    "smollm2": "smollm2-135m-instruct",
    "gemma3-270m": "gemma-3-270m-it",
}


@lru_cache(maxsize=1)
def hub_ids() -> dict[str, Path]:
    """Hugging Face id (``org/name``, lower-cased) -> bundled directory: each directory is
    named ``org--name`` after the model it was copied from."""
    return {d.name.replace("--", "/", 1).lower(): d for d in sorted(CONFIG_DIR.iterdir())
            if "--" in d.name and (d / "config.json").exists()}


@lru_cache(maxsize=1)
def presets() -> dict[str, Path]:
    """Preset name -> directory holding its ``config.json``."""
    table = {d.name.split("--", 1)[-1].lower(): d for d in sorted(CONFIG_DIR.iterdir()) if (d / "config.json").exists()}
    for alias, target in ALIASES.items():
        table.setdefault(alias, table[target])
    return table


MAX_MODEL_NAME = 4096
"""The longest model name taken, in characters: Linux's PATH_MAX, the longest path it opens."""
MAX_FILE_NAME_BYTES = 255
"""The longest file name (one component of a path) a file system takes, in bytes (NAME_MAX)."""


def check_model_name(text: str) -> None:
    """Refuse, before any file system call (which would fail with "File name too long"), a model
    name that no preset, Hugging Face id or path can be: over ``MAX_MODEL_NAME`` characters, a
    component over ``MAX_FILE_NAME_BYTES`` bytes, or a NUL character."""
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in text.split("/"))
    if len(text) > MAX_MODEL_NAME or longest > MAX_FILE_NAME_BYTES or "\0" in text:
        what = "holds a NUL character" if "\0" in text else (
            f"is {len(text):,} characters long, more than a file name or path can be")
        raise ConfigError(f"model name {shorten(text)!r} {what}; give a preset name, a Hugging Face id, a file or a "
                          "model directory")


def path_name(path: Path) -> str:
    """The model's name for a path: the directory holding ``config.json`` (resolved, so that
    ``.`` and a bare ``config.json`` name the directory they are in)."""
    resolved = path.resolve()
    directory = resolved if resolved.is_dir() else resolved.parent
    return directory.name or str(directory)
