"""Every setting of the engine, the planner and the simulator, and each default, defined once.

Torch-free: the planner and the simulator read it without loading the engine. Names are
vLLM's engine arguments, and so are the defaults; the CLI's flags (``kvledger.cli``) are
declared from the fields and constants here.

* :class:`EngineConfig` -- what shapes an engine (``kvledger generate``, ``kvledger serve``).
* :class:`PlannerConfig` -- what shapes the memory wall of a card (``kvledger plan``, ``advise``).
* :class:`SimulatorConfig` -- a replicated engine on a virtual clock (``kvledger simulate``).

Sizes: the engine's ``kv_cache_memory`` is bytes for the KV block pool (an int, or a string such
as ``"2GiB"``). When it is not given, CUDA takes ``GPU_MEMORY_UTILIZATION`` (90%) of the free
device memory after the weights (vLLM's ``--gpu-memory-utilization`` default) and the CPU takes
``CPU_KV_CACHE_SHARE`` (10%) of the RAM available at start-up, at most ``CPU_KV_CACHE_MAX``
(4 GiB, vLLM's CPU default). Token counts (``max_model_len``, ``max_num_batched_tokens``,
``block_size``) are in tokens. ``block_size`` left at None takes vLLM's default for the device
(:func:`default_block_size`: 128 tokens on CPU, 16 on CUDA). ``seed`` seeds the draws of sampled
requests that carry no seed of their own (None: torch's global generator decides).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from kvledger.errors import KVLedgerError
from kvledger.spec.dtypes import ENGINE_KV_CACHE_DTYPES

CUDA_BLOCK_SIZE = 16
"""Tokens per KV block on CUDA when none is given (vLLM's default there): the planner's and the
simulator's block, as they size CUDA cards."""
CPU_BLOCK_SIZE = 128
"""Tokens per KV block on CPU when none is given: vLLM's CPU platform sets 128 where the user set
none. Decode attention reads each sequence's blocks where they lie in the pool, and on CPU a
16-token block (12 KiB of K per layer for SmolLM2 in float32) is too short a run for the memory
system: 22 sequences of 340 tokens, 30 layers, 2 threads, AMD EPYC, 22.5 ms of attention a decode
step in blocks of 16 against 15.7 in blocks of 128 (BENCHMARKS.md)."""

VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
"""The ``--block-size`` values vLLM accepts on CUDA: the CLI's choices (the Python API takes any
positive size, as the scheduler's tests do)."""

GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``: the share of the card the engine may claim."""
CPU_KV_CACHE_SHARE = 0.10
CPU_KV_CACHE_MAX = 4 * 1024**3

MAX_NUM_SEQS = 256
"""vLLM's ``--max-num-seqs``: the engine's, and vLLM's serving default on cards under 70 GiB and
on the A100."""
MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's ``--max-num-batched-tokens`` (tokens per step): the engine's, and vLLM's serving default
on cards under 70 GiB and on the A100."""
LARGE_CARD_MAX_NUM_SEQS = 1024
"""vLLM's ``--max-num-seqs`` for serving on a large card ("Defaulting max_num_seqs to 1024"):
the sampler's profiling batch."""
LARGE_CARD_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens in vLLM's profiling forward pass for ``vllm serve`` on a large card (its log:
"Defaulting max_num_batched_tokens to 8192 for OPENAI_API_SERVER usage context")."""

KV_OFFLOADING_BACKEND = "native"
"""vLLM's default ``--kv-offloading-backend``: the engine's own tier (host memory, or disk)."""
KV_OFFLOADING_BACKENDS = ("native", "lmcache")
"""vLLM's ``--kv-offloading-backend`` choices; the engine runs ``native`` only."""
MAX_KV_OFFLOADING_GIB = 2.0**40
"""The largest ``--kv-offloading-size`` (GiB): beyond any host memory or disk."""

ENGINE_DTYPES = ("float32", "bfloat16", "float16")
"""The weights and activations dtypes the engine runs (``--dtype``)."""
ENGINE_DTYPE = "float32"
"""The engine's ``--dtype`` when none is given."""


def default_block_size(device: str) -> int:
    """vLLM's tokens per KV block where none is given, for a device type: ``cpu``, ``cuda`` or
    ``cuda:N``. ``auto`` is not a device here: the engine resolves it first (CUDA where torch
    sees a device)."""
    if device == "auto":
        raise ValueError("default_block_size takes a resolved device (cpu, cuda, cuda:N), not 'auto'")
    return CUDA_BLOCK_SIZE if device.startswith("cuda") else CPU_BLOCK_SIZE


@dataclass
class EngineConfig:
    """Everything that shapes an engine; field names are vLLM's engine arguments."""

    model: str | None = None
    dtype: str = ENGINE_DTYPE
    device: str = "auto"
    block_size: int | None = None
    """Tokens per KV block; None: vLLM's default for the device (:func:`default_block_size`)."""
    max_model_len: int | None = None
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float | None = None
    """vLLM's: the share of the device's memory (of the host's RAM on CPU) the engine may use; the
    KV pool gets that share less what is already in use. None: the defaults above."""
    seed: int | None = 0
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    """Ranks the model is split over (processes, one torch.distributed group; see
    :mod:`kvledger.distributed`). Each rank holds the heads :mod:`kvledger.spec.head_split` gives it
    (whole GQA groups, or a KV head copied when N exceeds ``H_kv``) and its own cache."""
    kv_offloading_size: float | None = None
    """vLLM's ``--kv-offloading-size``: GiB (2^30 bytes) of a second KV tier under the pool, in host
    memory, or on disk with ``kv_offloading_path``; None: no tier. Its blocks are
    :func:`kvledger.spec.offload.tier_capacity`'s."""
    kv_offloading_backend: str = KV_OFFLOADING_BACKEND
    """vLLM's ``--kv-offloading-backend``: ``native`` (the engine's own tier); ``lmcache`` is refused."""
    kv_offloading_path: str | None = None
    """A directory for the tier's blocks, one file each, kept across restarts; None: host memory."""
    enforce_eager: bool = False
    """vLLM's switch that keeps the model step out of ``torch.compile``: True always runs it eagerly.
    False compiles it only where the environment asks for it with ``KVLEDGER_COMPILE=1``
    (:mod:`kvledger.engine.compile`; not the default until a benchmark shows it pays)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is None and name == "block_size":
                continue
            if not isinstance(value, int) or value < 1:
                raise KVLedgerError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise KVLedgerError(f"--max-model-len must be a positive integer, got {self.max_model_len!r}")
        if self.dtype not in (*ENGINE_DTYPES, "auto"):
            raise KVLedgerError(f"--dtype {self.dtype!r} is not supported; use float32, bfloat16 or float16")
        if self.kv_cache_memory is not None:
            from kvledger.units import parse_size

            self.kv_cache_memory = parse_size(self.kv_cache_memory, "--kv-cache-memory")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise KVLedgerError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise KVLedgerError(f"--device {self.device!r} is not supported; use cpu, cuda, cuda:N or auto")
        if self.kv_offloading_backend != KV_OFFLOADING_BACKEND:
            raise KVLedgerError(f"--kv-offloading-backend {self.kv_offloading_backend} is not run by this engine "
                                f"(lmcache is vLLM's LMCache connector); use {KV_OFFLOADING_BACKEND}")
        if self.kv_offloading_size is not None and not 0 < self.kv_offloading_size <= MAX_KV_OFFLOADING_GIB:
            raise KVLedgerError(f"--kv-offloading-size must be a positive number of GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_path is not None and self.kv_offloading_size is None:
            raise KVLedgerError("--kv-offloading-path needs --kv-offloading-size: the GiB of disk the tier may take")
        if self.kv_offloading_size is not None and self.tensor_parallel_size > 1:
            raise KVLedgerError("--kv-offloading-size: the engine's KV offloading tier runs at --tensor-parallel-size 1 "
                                "only; drop one of the two flags")
        if self.kv_cache_dtype not in ENGINE_KV_CACHE_DTYPES:
            raise KVLedgerError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one the engine runs; choose one of "
                                f"{', '.join(ENGINE_KV_CACHE_DTYPES)}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise KVLedgerError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


@dataclass(frozen=True)
class PlannerConfig:
    """What shapes the memory wall of one card, as vLLM would start on it (``kvledger plan``,
    ``advise``, the simulator's pool): vLLM's engine arguments where it has them, beside the
    planner's own overrides of its estimates (bytes per rank). ``None`` takes vLLM's default:
    for ``block_size`` :data:`CUDA_BLOCK_SIZE` (a hybrid model's is raised to hold its state),
    for ``max_num_seqs`` and ``max_num_batched_tokens`` vLLM's serving defaults for the card
    (:data:`LARGE_CARD_MAX_NUM_SEQS` on cards of 70 GiB and more but the A100, else
    :data:`MAX_NUM_SEQS`), for ``max_model_len`` the model's context. ``mamba_ssm_cache_dtype``,
    ``enable_prefix_caching`` (``None``: the release's default) and ``vllm_version`` (``None``: the
    newest modeled) matter only for hybrid models."""

    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_size: int | None = None
    weights_dtype: str | None = None
    """What-if: every weight at this size (``spec.weights.WEIGHT_DTYPE_BYTES``)."""
    dtype: str | None = "auto"
    """vLLM's ``--dtype`` for weights and activations; ``auto`` (or ``None``): the checkpoint's."""
    quantization: str | None = None
    overhead: int | None = None
    """Replaces the sum of the activation peak and non-torch memory (the chapter's single term)."""
    kv_cache_memory: int | None = None
    """The KV pool per card, replacing the whole wall (vLLM's ``kv_cache_memory_bytes``)."""
    activation: int | None = None
    """Overrides the activation-peak estimate."""
    non_torch: int | None = None
    """Overrides the non-torch memory estimate."""
    cuda_graph: int | None = None
    """Overrides the CUDA-graph estimate (outside the pool)."""
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    mamba_ssm_cache_dtype: str = "auto"
    enable_prefix_caching: bool | None = None
    vllm_version: str | None = None
    max_model_len: int | None = None


@dataclass(frozen=True)
class SimulatorConfig:
    """What ``kvledger simulate`` replays a trace on: ``replicas`` engines of ``model`` behind a
    ``router``, each step timed by a card of the catalog (``gpu``) or a profile fitted on a real
    engine (``profile``, written by ``kvledger calibrate``). The engine's settings are vLLM's, with
    its defaults for a large card (the planner's, on an H100 or H200); the pool is the card's memory
    wall (:class:`PlannerConfig`) unless ``kv_cache_memory`` or ``num_gpu_blocks_override`` sizes it.
    ``kv_cache_dtype`` None: the profile's, else ``auto``."""

    model: str
    gpu: str | None = None
    profile: str | None = None
    block_size: int = CUDA_BLOCK_SIZE
    max_num_seqs: int = LARGE_CARD_MAX_NUM_SEQS
    max_num_batched_tokens: int = LARGE_CARD_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    vllm_version: str | None = None
    """Hybrid models: the vLLM release whose pool rules to follow (None: the newest modeled)."""
    replicas: int = 1
    router: str = "least-loaded"
    kv_offloading_size: tuple[float, ...] = ()
    """vLLM's ``--kv-offloading-size`` in GiB (2^30 bytes), per replica, all ranks together; several
    values sweep it, one run each; 0 or none: no second tier."""
    kv_offloading_bandwidth: float | None = None
    """Bytes per second, one direction, of the link the tier's loads and stores cross; None: the
    card's host link (``gpus.json``)."""
    kv_offloading_eviction_policy: str = "lru"
    """vLLM's ``eviction_policy`` of the offloading tier: ``lru`` or ``arc``."""
    kv_offloading_store: str = "evict"
    """What the tier stores when: ``evict`` (a block when the pool evicts it: the tiers hold different
    blocks) or ``compute`` (vLLM's: a prompt's full blocks as they are computed, so the tier repeats
    what the pool holds). ``evict`` found more hits at every size on Mooncake (README)."""
    ingress_ms: float = 0.0
    """Milliseconds from a client's send to the server's receipt of each request across a network
    (proxies included); added to every TTFT and E2EL. A client on the server's own host costs the
    steps instead (a served profile's ``arrivals`` term)."""

    @classmethod
    def of(cls, settings: Any) -> "SimulatorConfig":
        """The config of an object with one attribute per field (``kvledger simulate``'s parsed flags)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})
