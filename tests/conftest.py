"""Shared fixtures. Each part of the project keeps its fixtures in its own section below."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # for every test: nothing may download from a model hub
# short OpenMP spin-waits: the suite shares its cores (see kvledger/engine/__init__.py)
os.environ.setdefault("GOMP_SPINCOUNT", "30000")


# ---- engine (tests/test_engine_*.py) ------------------------------------------------------------
@pytest.fixture(scope="session")
def engine_reference():
    """transformers' greedy outputs (and some per-step logits) for 20 prompts, computed once."""
    from tests.engine_reference import build_reference

    return build_reference()


@pytest.fixture(scope="session")
def engine_llm():
    """One default-model LLM (float32, prefix caching on) shared by the engine tests that can share it."""
    from kvledger import LLM

    return LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="256MiB", max_num_batched_tokens=64, block_size=16)
