"""Read Hugging Face model directories: ``config.json`` plus one or many ``*.safetensors``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvledger.errors import KVLedgerError
from kvledger.spec.model_spec import read_config as read_config_file


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a model directory as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise KVLedgerError(f"{model_dir} has no config.json; give a Hugging Face model directory or a .gguf file")
    return read_config_file(path)


def load_safetensors_state_dict(model_dir: str | Path, dtype: "Any") -> dict[str, "Any"]:
    """All tensors of every ``*.safetensors`` file in ``model_dir``, cast to ``dtype`` (a torch dtype).

    Files are memory-mapped by safetensors, so a cached float32 copy loads in well under a second.
    """
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise KVLedgerError(f"{model_dir} has no *.safetensors files; give a Hugging Face model directory or a .gguf file")
    state: dict[str, Any] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            state[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    return state
