"""A simulated fleet built from :class:`kvledger.config.SimulatorConfig`: the model, the step model
(a card of the catalog or a profile fitted by ``kvledger calibrate``), each replica's pool and
engine settings, the router. ``kvledger simulate`` and ``bench/bench_simulator.py`` start here."""

from __future__ import annotations

from kvledger.config import EngineConfig, PlannerConfig, SimulatorConfig
from kvledger.errors import KVLedgerError
from kvledger.metrics.serving import SLO, parse_slo
from kvledger.sim.routers import ROUTERS
from kvledger.sim.simulate import Fleet
from kvledger.spec import ModelSpec, kv_bytes, load_model_spec

DEFAULT_FIND_SLO = "ttft_p99=2s,tpot_p99=100ms"
"""The targets the search for the smallest replica count meets when none are given."""


def setup_fleet(config: SimulatorConfig, *, slo: str | None = None, find_replicas: bool = False,
                kv_offloading_size: float = 0) -> tuple[ModelSpec, Fleet, SLO | None]:
    """(ModelSpec, Fleet, SLO or None) for ``config``; ``slo`` names the targets (``DEFAULT_FIND_SLO``
    when ``find_replicas`` and none is given); ``kv_offloading_size`` GiB of a second tier per
    replica (one value of ``config.kv_offloading_size``; 0: none). Every bad value is a KVLedgerError."""
    from kvledger.sim.step_model import Profile, StepModel

    if config.router not in ROUTERS:
        raise KVLedgerError(f"unknown router {config.router!r}; use one of {', '.join(ROUTERS)}")
    targets = parse_slo(slo) if slo else (parse_slo(DEFAULT_FIND_SLO) if find_replicas else None)
    spec = load_model_spec(config.model)
    tp = config.tensor_parallel_size
    block_size = config.block_size
    hybrid = None
    gpu = None
    if config.profile and spec.is_hybrid:
        raise KVLedgerError(f"{spec.name} is a hybrid model: step profiles of hybrids are not modeled; use --gpu")
    if config.profile:
        profile = Profile.load(config.profile)
        kv_dtype = config.kv_cache_dtype or profile.kv_cache_dtype
        profile.check_model(spec, tp)
        model = profile.step_model(spec, kv_dtype, config.profile)
        if config.num_gpu_blocks_override:
            num_blocks = config.num_gpu_blocks_override
        elif config.kv_cache_memory is not None:
            num_blocks = kv_bytes(spec, kv_dtype, tensor_parallel_size=tp).num_blocks(config.kv_cache_memory, block_size)
        elif profile.num_blocks and profile.block_size == block_size:
            num_blocks = profile.num_blocks
        else:
            raise KVLedgerError(f"the profile's pool is in blocks of {profile.block_size} tokens; give "
                                "--num-gpu-blocks-override or --kv-cache-memory for --block-size "
                                f"{block_size}")
    else:
        from kvledger.planner.gpus import get_gpu
        from kvledger.planner.memory_wall import plan_memory

        gpu = get_gpu(config.gpu)
        kv_dtype = config.kv_cache_dtype or "auto"
        wall = plan_memory(spec, gpu, PlannerConfig(
            gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_dtype=kv_dtype, tensor_parallel_size=tp,
            block_size=block_size, kv_cache_memory=config.kv_cache_memory,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.enable_prefix_caching, max_model_len=config.max_model_len,
            vllm_version=config.vllm_version))
        num_blocks = config.num_gpu_blocks_override or wall.num_blocks
        model = StepModel.from_gpu(spec, gpu, kv_dtype, tp)
        if wall.hybrid:  # vLLM's block size for the model, its state blocks, its start-up refusal
            from kvledger.sim.hybrid import HybridPool, check_max_num_seqs

            block_size = wall.block_size
            hybrid = HybridPool.from_wall(wall)
            check_max_num_seqs(config.max_num_seqs, num_blocks, wall.refuses_max_num_seqs)
    engine = EngineConfig(model=config.model, block_size=block_size, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=config.max_num_batched_tokens,
                          enable_prefix_caching=config.enable_prefix_caching, num_gpu_blocks_override=num_blocks,
                          max_model_len=config.max_model_len)
    offload = offload_tier(spec, config, kv_dtype, block_size, gpu, kv_offloading_size) if kv_offloading_size else None
    fleet = Fleet(engine, num_blocks, lambda: model, config.replicas, config.router, tp, hybrid=hybrid,
                  offload=offload, ingress_s=config.ingress_ms / 1e3)
    return spec, fleet, targets


def offload_tier(spec: ModelSpec, config: SimulatorConfig, kv_dtype: str, block_size: int, gpu, size_gib: float):
    """A replica's second tier of ``size_gib`` GiB: vLLM's block count for this model's blocks, the
    host link of ``gpu`` unless ``config.kv_offloading_bandwidth`` names one."""
    from kvledger.kvcache.offload import EVICTION_POLICIES, STORE_RULES
    from kvledger.sim.offload import OffloadTier
    from kvledger.spec.offload import tier_capacity

    if config.kv_offloading_eviction_policy not in EVICTION_POLICIES:
        raise KVLedgerError(f"--kv-offloading-eviction-policy must be one of {', '.join(EVICTION_POLICIES)}")
    if config.kv_offloading_store not in STORE_RULES:
        raise KVLedgerError(f"--kv-offloading-store must be one of {', '.join(STORE_RULES)}")
    if not config.enable_prefix_caching:
        raise KVLedgerError("a KV offloading tier needs prefix caching (--enable-prefix-caching)")
    bandwidth = config.kv_offloading_bandwidth or (gpu.host_link_bytes_per_s if gpu is not None else None)
    if bandwidth is None:
        raise KVLedgerError("a step profile names no host link: give --kv-offloading-bandwidth with "
                            "--kv-offloading-size")
    capacity = tier_capacity(spec, kv_dtype, block_size, size_gib, config.tensor_parallel_size)
    return OffloadTier(capacity, bandwidth, config.kv_offloading_eviction_policy, config.kv_offloading_store)


def max_request_len(spec: ModelSpec, fleet: Fleet, max_model_len: int | None = None) -> int:
    """The longest request (prompt + output tokens) the fleet serves: ``max_model_len``, else the
    model's context, at most what one replica's pool holds; a KVLedgerError when that is too short."""
    bs = fleet.config.block_size
    pool = fleet.num_blocks * bs
    max_len = max_model_len or min(spec.max_position_embeddings or pool, pool)
    if max_len > pool:
        raise KVLedgerError(f"--max-model-len {max_len} exceeds the pool's {fleet.num_blocks} blocks x {bs} tokens")
    if max_len < 2:
        raise KVLedgerError(f"a request needs at least 2 tokens of context; the pool holds {pool}")
    return max_len
