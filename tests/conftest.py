"""Shared fixtures. Each part of the project keeps its fixtures in its own section below."""

from __future__ import annotations

import os
import sys

import pytest

from tests.memory import release_freed_memory

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # for every test: nothing may download from a model hub
# short OpenMP spin-waits: the suite shares its cores (see kvledger/engine/__init__.py)
os.environ.setdefault("GOMP_SPINCOUNT", "30000")


# ---- engine (tests/test_engine_*.py) ------------------------------------------------------------
@pytest.fixture(scope="session")
def engine_reference():
    """transformers' greedy outputs (and some per-step logits) for 20 prompts, computed once."""
    from tests.engine_reference import build_reference

    return build_reference()


@pytest.fixture(scope="module")
def engine_llm():
    """One default-model LLM (float32, prefix caching on) shared by the tests of a file that can share it."""
    from kvledger import LLM

    return LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="256MiB", max_num_batched_tokens=64, block_size=16)


# ---- CPU kernels (tests of kvledger/kernels/csrc) ------------------------------------------------
CPU_CAPABILITY_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512dq", "avx512vl", "avx512bw"},
}
"""What each capability of kvledger's CPU kernels needs, as /proc/cpuinfo names the CPU's features
(read here, not through torch, so that a capability the CPU has but the build step missed fails)."""


def cpu_flags() -> set[str]:
    """The feature flags of this machine's CPU (/proc/cpuinfo's first ``flags`` line)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture(scope="module", params=sorted(CPU_CAPABILITY_FLAGS))
def capability(request):
    """Runs a kernel test module once per vector capability of kvledger's CPU kernels (the test ids
    end in ``[avx2]``, ``[avx512]``): skipped where the CPU lacks it, a failure where the CPU has it
    and its kernels do not load. Modules take it with ``pytestmark = pytest.mark.usefixtures("capability")``."""
    from kvledger.kernels import cpu_kernels

    name = request.param
    if not CPU_CAPABILITY_FLAGS[name] <= cpu_flags():
        pytest.skip(f"this CPU has no {name.upper()}")
    with cpu_kernels.use(name) as build:
        assert build.loaded, f"this CPU has {name.upper()} but its kernels did not load: {build.reason}"
        yield name


# ---- memory: what a test file built is returned after it -----------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_file():
    """After each test file: stop the shared server, drop its references and return the freed
    memory. Two workers that kept every file's models reached 10 GB each and met the kernel's
    OOM killer on a 23 GiB machine; with this each worker holds at most one file's models."""
    yield
    harness = sys.modules.get("tests.server_harness")
    if harness is not None:
        harness.release()
    release_freed_memory()


# ---- the suite's order ----------------------------------------------------------------------------
LONGEST_FILES = ("test_gemma3.py", "test_kv_quality.py", "test_engine_identity.py", "test_kv_quant_engine.py")
"""The files that take longest, longest first (313, 160, 157 and 92 s of the suite's 1,290 s on an
AMX Xeon). `make test` hands whole files to two workers (``--dist loadfile``) in collection order;
one of these started last would run on alone while the other worker idles, so they start first.
A worker holds one file's models at a time (``_release_memory_after_each_file``): its peak was
about 5 GB on a 23 GiB AVX2 EPYC (test_gemma3.py; 9.5 to 11.5 GB when files kept theirs). The
Ray cluster's replicas (test_cluster.py and test_cluster_cli.py, about 4 GB more) run last; ``make
test`` runs those files in a second pytest, alone, as a worker that holds a model may still be running beside it (Ray's
memory monitor ended the replicas at 95% of 24 GB)."""
LAST_FILES = ("test_cluster.py", "test_cluster_cli.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)} | {name: 1000 for name in LAST_FILES}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: each file keeps its order
