"""The model families the engine runs: ``model_type`` -> class, KV-cache groups, what each supports.

A new family is one file beside :mod:`.llama` and one :class:`ModelFamily` entry here; nothing in
the engine names a family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from kvledger.errors import KVLedgerError
from kvledger.kvcache.groups import FULL_ATTENTION, KVCacheGroup
from kvledger.models import gemma3, llama


def _one_full_group(hf_config: dict[str, Any]) -> list[KVCacheGroup]:
    """Every layer attends to its whole context: one group of all layers."""
    return [KVCacheGroup(FULL_ATTENTION, tuple(range(int(hf_config["num_hidden_layers"]))))]


@dataclass(frozen=True)
class ModelFamily:
    """One family of checkpoints and what the engine can do with it."""

    name: str
    model_types: tuple[str, ...]
    """The ``model_type`` values of ``config.json`` the family reads."""
    model_class: Callable[[dict[str, Any]], nn.Module]
    kv_groups: Callable[[dict[str, Any]], list[KVCacheGroup]]
    """The KV-cache groups of a config (sliding and full layers apart)."""
    compiles: bool
    """The compiled step (:mod:`kvledger.engine.compile`) serves it: its attention operator counts
    layers in order."""


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("Llama", llama.SUPPORTED_MODEL_TYPES, llama.LlamaForCausalLM, _one_full_group, compiles=True),
    ModelFamily("Gemma-3", gemma3.SUPPORTED_MODEL_TYPES, gemma3.Gemma3ForCausalLM, gemma3.model_kv_groups,
                compiles=False),
)


def family_for(hf_config: dict[str, Any], name: str) -> ModelFamily:
    """The family of a checkpoint's config, or a one-line error naming the supported ``model_type``\\s.
    Every family shards over tensor-parallel ranks (:mod:`kvledger.layers.parallel`)."""
    model_type = hf_config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            break
    else:
        supported = ", ".join(t for f in FAMILIES for t in f.model_types)
        raise KVLedgerError(f"{name}: model_type {model_type!r} is not supported by the engine; supported: {supported}")
    return family
