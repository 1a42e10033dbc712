"""kvledger: the KV cache of LLM serving, computed, verified, planned and run.

The planner side (``kvledger.spec``, ``kvledger.planner``) is pure Python and never
imports torch. The engine (``kvledger.engine``) is imported lazily, so
``from kvledger import LLM, SamplingParams`` loads torch only when asked for.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvledger.engine.llm",
    "SamplingParams": "kvledger.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvledger' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "SamplingParams", "__version__"]
