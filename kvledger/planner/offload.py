"""``plan --kv-offloading-size``: the second KV tier's capacity, the memory or disk it takes, and
what a prefix costs to load from it against what it costs to compute again.

The capacity is :func:`kvledger.spec.offload.tier_capacity` (vLLM's arithmetic, the engine's and
the simulator's too). Loading ``T`` tokens moves their full blocks over the tier's link (the
card's host link from ``gpus.json`` unless ``--kv-offloading-bandwidth`` names one), one rank's
bytes per rank, all ranks at once; recomputing them is priced by the caller (``kvledger plan``
gives the simulator's step model, :meth:`kvledger.sim.step_model.StepModel.prefill_seconds`, in
chunks of ``max_num_batched_tokens``).
"""

from __future__ import annotations

from typing import Any, Callable

from kvledger.spec.offload import tier_capacity


def plan_offload(spec, gpu, wall, size_gib: float, *, prefix_tokens: int, recompute_seconds: Callable[[int], float],
                 path: str | None = None, bandwidth: float | None = None) -> dict[str, Any]:
    """The tier's numbers for ``kvledger plan --json`` (``offload_*`` keys) and its notes;
    ``recompute_seconds(T)``: the seconds a prefill of ``T`` tokens takes on ``gpu``."""
    tp = wall.tensor_parallel_size
    cap = tier_capacity(spec, wall.kv_cache_dtype, wall.block_size, size_gib, tp)
    link = bandwidth or gpu.host_link_bytes_per_s
    blocks = prefix_tokens // wall.block_size  # a prefix's full blocks: the rest is computed anyway
    load_s = blocks * cap.rank_block_bytes / link
    recompute_s = recompute_seconds(blocks * wall.block_size)
    notes = []
    if path and not bandwidth:
        notes.append(f"--kv-offloading-path: loads are priced at the host link ({gpu.host_link}); a disk reads "
                     "slower, so give its read rate with --kv-offloading-bandwidth")
    return {
        "offload_capacity_blocks": cap.num_blocks, "offload_capacity_tokens": cap.num_tokens,
        "offload_bytes": cap.bytes, "offload_size_gib": size_gib, "offload_block_bytes": cap.block_bytes,
        "offload_slot_bytes": cap.slot_bytes, "offload_copies": cap.copies,
        "offload_medium": "disk" if path else "host memory", "offload_path": path,
        "offload_link": "--kv-offloading-bandwidth" if bandwidth else gpu.host_link,
        "offload_bandwidth_bytes_per_s": link, "offload_prefix_tokens": blocks * wall.block_size,
        "offload_load_s": load_s, "offload_recompute_s": recompute_s,
        "offload_load_speedup": recompute_s / load_s if load_s else None, "offload_notes": notes,
    }
