"""One rank's model and KV cache, and the engine step on them.

:class:`ModelRunner` ``(config, rank)`` is the same on every rank: it resolves the checkpoint,
builds and loads its model (its shard, at tensor parallelism), sizes its KV cache and allocates
it. Rank 0 lives in the engine's process, sizes the pool (the checks with the numbers a user
needs) and starts ranks 1..N-1 (:class:`~kvledger.distributed.ranks.RankGroup`), which run
:func:`run_rank`: the same constructor, then :meth:`ModelRunner.loop` on the step inputs rank 0
broadcasts.

A step (:meth:`ModelRunner.execute`): flat inputs, slot mapping, block tables, then logits. The
flat batch puts one token per decoding request first, then each prefill chunk. Logits are
computed only for the last token of each request that samples this step. A model with several
KV-cache groups (Gemma-3's full and sliding layers) gets one :class:`AttentionMetadata` per
group, built from that group's block tables; a sliding group's tables start at the first block
its window reaches and its masks apply the window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Sequence

import torch

from kvledger.config import CPU_KV_CACHE_MAX, CPU_KV_CACHE_SHARE, GPU_MEMORY_UTILIZATION, EngineConfig, default_block_size
from kvledger.distributed import parallel_state as ps
from kvledger.distributed.ranks import RankFailure, RankGroup, map_tensors, rank_device, receive
from kvledger.engine.compile import ModelStep, compile_enabled
from kvledger.engine.limits import check_pool_memory, context_limit, kv_layout
from kvledger.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvledger.errors import KVLedgerError
from kvledger.kernels import paged_decode, paged_prefill
from kvledger.kvcache.block_pool import BlockPool, blocks_for
from kvledger.kvcache.groups import first_live_block, longest_fitting, request_blocks
from kvledger.kvcache.quantized_storage import make_kv_cache
from kvledger.kvcache.storage import torch_dtype
from kvledger.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from kvledger.loader.resolve import converted_dir, resolve_model
from kvledger.loader.safetensors import load_safetensors_state_dict, read_config
from kvledger.models.registry import family_for
from kvledger.spec.dtypes import PER_LAYER_SCALE_DTYPES
from kvledger.units import available_ram_bytes, format_bytes


def pick_device(name: str, rank: int = 0) -> torch.device:
    """The device of ``--device`` (``auto``: CUDA where torch sees one) for ``rank``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise KVLedgerError("--device cuda asked for but no CUDA device is available; use --device cpu")
    return rank_device("cuda", rank) if name.startswith("cuda") and rank else torch.device(name)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device the pool goes on: CUDA's own figures, or the host's
    available and total RAM on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return available_ram_bytes(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_rank(rank: int, config: EngineConfig) -> None:
    """A rank above 0: build the same runner as rank 0, then run the steps it is sent."""
    ModelRunner(config, rank).loop()


class ModelRunner:
    """One rank's model, KV cache and step. Rank 0 also owns the other ranks (:attr:`ranks`)."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.rank = rank
        self.device = pick_device(config.device, rank)
        if config.block_size is None:
            config = dataclasses.replace(config, block_size=default_block_size(self.device.type))
        checkpoint = resolve_model(config.model)
        self.model_name, self.model_dir = checkpoint.name, converted_dir(checkpoint)
        self.config = config
        self.hf_config = read_config(self.model_dir)
        self.context_limit = context_limit(config, self.hf_config, self.model_name).tokens
        """The longest request the config and flags allow, in tokens (the pool may lower it)."""
        tp = config.tensor_parallel_size
        family = family_for(self.hf_config, self.model_name)
        self.dtype = torch_dtype("float32" if config.dtype == "auto" else config.dtype)
        # Eq 2.2 for one token on each rank, from the model spec (pure Python), in the cache's dtype.
        self.spec, self.kv_cache_dtype, self.kv_bytes_by_rank = kv_layout(config, self.hf_config, self.model_name)
        """Every rank's own Eq 2.2, with its own KV heads (fewer on the last ranks of an uneven split)."""
        self.kv_bytes = self.kv_bytes_by_rank[0]
        """One rank's Eq 2.2: the largest rank's (rank 0's), which every rank's pool is sized by."""
        self.kv_groups = family.kv_groups(self.hf_config)
        if len(self.kv_groups) > 1 and self.kv_cache_dtype in PER_LAYER_SCALE_DTYPES:
            raise KVLedgerError(f"--kv-cache-dtype {self.kv_cache_dtype} keeps one scale per layer, but "
                                f"{self.model_name}'s KV groups share cache layers; use int8 (per-token scales) "
                                "or a 16/32-bit cache")
        if rank == 0 and (config.num_gpu_blocks_override is not None or config.kv_cache_memory is not None):
            self._plan_pool()  # a pool the user sized is checked before the weights load (and again after)
        self.ranks: RankGroup | None = None
        """Ranks 1..N-1, held by rank 0 at tensor parallelism (None otherwise)."""
        self.closed = False
        """True once :meth:`shutdown` let go of the weights and the cache."""
        if rank == 0 and tp > 1:  # the other ranks load their shards while this one loads its own
            self.ranks = RankGroup(tp, self.device.type, run_rank, (dataclasses.replace(config, model=str(self.model_dir)),))
        try:
            self.model = self._load_model(family.model_class)
            self.num_blocks, self.max_model_len = self._size_pool()
            self.cache = make_kv_cache(self.kv_cache_dtype, max(len(g.layers) for g in self.kv_groups),
                                       self.num_blocks, config.block_size, self.kv_bytes_by_rank[rank].kv_heads,
                                       self.spec.head_dim, self.dtype, self.device)
            self.model.set_rope(self.max_model_len)
            self.rank_measured_bytes = self._gather_measured_bytes()
        except BaseException:
            if self.ranks is not None:
                self.ranks.stop()
            raise
        self.step = ModelStep(self.model, compile_enabled(config.enforce_eager) and family.compiles and tp == 1)
        """The forward, compiled or eager (:mod:`kvledger.engine.compile`)."""
        self.block_size = config.block_size
        self.windows = [g.sliding_window for g in self.kv_groups]
        # The in-place CPU kernels at one rank (the ranks of a group gather their K/V).
        attn = self.model.layers[0].self_attn
        kernels = [self.device, self.dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim] if tp == 1 else []
        self.decode_in_place = bool(kernels) and paged_decode.supports(*kernels,
                                                                      kv_dtype=self.cache.layer_pools(0).k.dtype)
        """Decodes read K/V in place with the CPU kernel (:mod:`kvledger.kernels.paged_decode`) rather
        than gathering them (8-bit caches too)."""
        self.prefill_in_place = bool(kernels) and not self.cache.quantized and paged_prefill.supports(*kernels)
        """Prefill chunks read K/V in place with the CPU kernel (:mod:`kvledger.kernels.paged_prefill`)
        where it serves the cache; otherwise flash SDPA runs them."""
        self.last_logits: torch.Tensor | None = None  # [samplers, vocab] of the latest step (tests read it)

    # ---- construction -------------------------------------------------------------------------
    def _load_model(self, model_class: Any) -> torch.nn.Module:
        """This rank's model (its slice at tensor parallelism), weights loaded from the checkpoint."""
        with ps.building(self.rank, self.config.tensor_parallel_size), torch.device("meta"):
            model = model_class(self.hf_config)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load_hf_state_dict(load_safetensors_state_dict(self.model_dir, self.dtype))
        return model.eval()

    def _size_pool(self) -> tuple[int, int]:
        """(blocks, max_model_len): rank 0 sizes the pool from the config and the device's memory
        (the weights in it) and checks it, then every rank takes the smallest count any rank can hold."""
        if self.rank == 0:
            num_blocks, max_model_len = self._plan_pool()
        if self.config.tensor_parallel_size == 1:
            return num_blocks, max_model_len
        with self._guard("allocating the KV caches"):
            if self.rank == 0:
                self.ranks.broadcast((num_blocks, max_model_len))
            else:
                num_blocks, max_model_len = receive()
            if self.device.type == "cuda":  # a CUDA rank with less free memory lowers it
                free = int(torch.cuda.mem_get_info(self.device)[0] * GPU_MEMORY_UTILIZATION)
                num_blocks = min(num_blocks, free // max(1, self.kv_bytes.page_bytes(self.config.block_size)))
            return ps.all_reduce_min(num_blocks), max_model_len

    def _plan_pool(self) -> tuple[int, int]:
        """Rank 0's pool: ``num_gpu_blocks_override``, else what ``kv_cache_memory`` (or its default)
        holds; refused before anything is allocated if the device cannot hold it or one request
        of ``max_model_len`` tokens could not fit it."""
        config, bs = self.config, self.config.block_size
        num_blocks = config.num_gpu_blocks_override or self.kv_bytes.num_pages(self._kv_cache_memory(), bs)
        # checked before allocating: a pool that cannot fit would exhaust the machine
        check_pool_memory(config, self.kv_bytes_by_rank, num_blocks, bs, self.device.type,
                          device_memory(self.device)[0])
        chunk = config.max_num_batched_tokens
        if config.max_model_len is None:
            max_model_len = longest_fitting(self.kv_groups, self.context_limit, num_blocks, bs, chunk)
        else:
            max_model_len = self.context_limit
        BlockPool.check_size(num_blocks)
        needed = request_blocks(self.kv_groups, max_model_len, bs, chunk)
        if needed > num_blocks:
            raise KVLedgerError(
                f"the KV pool holds {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens "
                f"({self.kv_bytes.bytes_per_token} bytes/token) but one request of --max-model-len {max_model_len} "
                f"tokens may need {needed} blocks; give more --kv-cache-memory or a smaller --max-model-len")
        return num_blocks, max_model_len

    def _kv_cache_memory(self) -> int:
        """Bytes for this rank's pool: ``kv_cache_memory``, else vLLM's share of the device."""
        config = self.config
        if config.kv_cache_memory is not None:
            return int(config.kv_cache_memory)
        if config.gpu_memory_utilization is not None:  # vLLM's: a share of the device (of RAM on CPU), less what is in use
            free, total = device_memory(self.device)
            budget = int(total * config.gpu_memory_utilization) - (total - free)
            if budget <= 0:
                raise KVLedgerError(f"--gpu-memory-utilization {config.gpu_memory_utilization} leaves no room for "
                                    f"the KV pool: {format_bytes(total - free)} of {format_bytes(total)} is in use")
            return budget
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * GPU_MEMORY_UTILIZATION)
        # per rank: on CPU the ranks share the host's RAM
        return int(min(available_ram_bytes() * CPU_KV_CACHE_SHARE, CPU_KV_CACHE_MAX)) // config.tensor_parallel_size

    def _gather_measured_bytes(self) -> list[int]:
        """Every rank's allocated cache bytes, by rank (this rank's alone at one rank)."""
        if self.config.tensor_parallel_size == 1:
            return [self.cache.measured_bytes]
        with self._guard("allocating the KV caches"):
            return ps.all_gather_ints(self.cache.measured_bytes)

    def _guard(self, stage: str) -> Any:
        """Rank 0: failures of the group as one RankFailure (:meth:`RankGroup.guard`); other ranks:
        errors as they are (the process ends and rank 0's watchdog reports it)."""
        return self.ranks.guard(stage) if self.ranks is not None else contextlib.nullcontext()

    # ---- the group ----------------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """Why the tensor-parallel group stopped, or None (always None at one rank)."""
        return None if self.ranks is None else self.ranks.failure

    def loop(self) -> None:
        """A rank above 0: run each step rank 0 broadcasts until it sends None."""
        with torch.inference_mode():
            while (message := receive()) is not None:
                input_ids, positions, meta, logits_indices = map_tensors(message, lambda t: t.to(self.device))
                self.model(input_ids, positions, meta, self.cache, logits_indices)

    def shutdown(self) -> None:
        """Stop the other ranks and let go of this rank's weights and KV cache, so that their memory
        goes back to the system even while something still holds the engine (a stopped server's
        routes stay in FastAPI's caches, and with them its engine). No steps run after: :meth:`execute`
        refuses them. The bytes measured at start-up stay, for the ledger."""
        if self.ranks is not None:
            self.ranks.shutdown()
        self.closed = True
        for name in ("model", "cache", "step", "last_logits"):
            self.__dict__.pop(name, None)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]] | Sequence[dict[str, list[int]]]
                ) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run the step; returns the requests that sample (in logits row order) and their logits.
        ``block_tables`` are the tables of the one KV group, or a list with each group's."""
        if self.closed:
            raise KVLedgerError("the engine was shut down (LLMEngine.shutdown()); build a new one to run steps")
        if self.ranks is not None and (self.ranks.failure is not None or self.ranks.closed):
            raise RankFailure(self.ranks.failure or "the tensor-parallel engine was shut down")
        group_tables = [block_tables] if isinstance(block_tables, dict) else list(block_tables)
        bs = self.block_size
        decodes = sorted((s for s in out.scheduled if s.num_new_tokens == 1), key=lambda s: s.request.num_computed_tokens)
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        starts: list[int] = []  # position of each request's first new token
        counts: list[int] = []  # new tokens per request
        logits_indices: list[int] = []
        samplers: list[ScheduledRequest] = []
        for s in decodes + prefills:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            input_ids.extend(r.token_ids_slice(start, end))
            starts.append(start)
            counts.append(s.num_new_tokens)
            if s.samples:
                logits_indices.append(len(input_ids) - 1)
                samplers.append(s)
        metas = []
        for tables, window in zip(group_tables, self.windows):
            blocks: list[int] = []  # the blocks the new tokens go to, request after request
            block_offsets: list[int] = []  # per request: where its blocks begin in ``blocks``, less its first block index
            for s, start, n in zip(decodes + prefills, starts, counts):
                block_offsets.append(len(blocks) - start // bs)
                blocks.extend(tables[s.request.request_id][start // bs:blocks_for(start + n, bs)])
            positions, slots = self._positions_and_slots(starts, counts, blocks, block_offsets)
            meta = AttentionMetadata(slot_mapping=slots, decode_in_place=self.decode_in_place,
                                     prefill_in_place=self.prefill_in_place)
            start = 0
            lengths = [s.request.num_computed_tokens + 1 for s in decodes]
            for end in _group_bounds([min(n, window + bs) for n in lengths] if window else lengths):
                meta.decodes.append(self._decode_group(decodes[start:end], start, tables, window))
                start = end
            offset = len(decodes)
            for s in prefills:
                r = s.request
                n, computed = s.num_new_tokens, r.num_computed_tokens
                if window is None:
                    table = tables[r.request_id][:blocks_for(computed + n, bs)]
                    meta.prefills.append(PrefillChunk.causal(offset, n, computed, self._tensor(table).view(1, -1)))
                else:  # from the block the first query's window reaches
                    first = first_live_block(computed + 1, window, bs)
                    table = tables[r.request_id][first:blocks_for(computed + n, bs)]
                    meta.prefills.append(PrefillChunk.windowed(offset, n, computed, self._tensor(table).view(1, -1),
                                                               window, first * bs))
                offset += n
            metas.append(meta)
        inputs = (self._tensor(input_ids), positions, metas[0] if len(metas) == 1 else metas,
                  self._tensor(logits_indices))
        with self._guard("running a step"):
            if self.ranks is not None:  # every rank runs its shard on the same inputs
                self.ranks.broadcast(map_tensors(inputs, lambda t: t.cpu()) if self.device.type != "cpu" else inputs)
            logits = self.step(inputs[0], inputs[1], inputs[2], self.cache, inputs[3])
        self.last_logits = logits
        return samplers, logits

    def _positions_and_slots(self, starts: list[int], counts: list[int], blocks: list[int],
                             block_offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Position and physical slot of every token of the flat batch, ``[N]`` each, with tensor ops.

        Request ``i`` has ``counts[i]`` new tokens from position ``starts[i]``; position ``p``
        lies in ``blocks[block_offsets[i] + p // block_size]``, at offset ``p % block_size``."""
        bs = self.block_size
        num_tokens = sum(counts)
        if num_tokens == len(counts):  # decodes only: one token each, two lists in Python beat ten tensor ops
            slots = [blocks[o + p // bs] * bs + p % bs for o, p in zip(block_offsets, starts)]
            return self._tensor(starts), self._tensor(slots)
        counts_t = torch.tensor(counts)
        request = torch.repeat_interleave(torch.arange(len(counts)), counts_t, output_size=num_tokens)  # per token
        first_index = torch.cumsum(counts_t, 0) - counts_t  # flat index of each request's first token
        positions = torch.arange(num_tokens) + (torch.tensor(starts) - first_index)[request]
        block_ids = torch.tensor(blocks)[torch.tensor(block_offsets)[request] + positions // bs]
        slots = block_ids * bs + positions % bs
        return positions.to(self.device), slots.to(self.device)

    def _decode_group(self, group: list[ScheduledRequest], start: int, block_tables: dict[str, list[int]],
                      window: int | None = None) -> DecodeGroup:
        bs = self.block_size
        lens = [s.request.num_computed_tokens + 1 for s in group]
        if window is not None:
            return self._window_decode_group(group, start, block_tables, lens, window)
        max_len = max(lens)
        nb = blocks_for(max_len, bs)
        tables = [block_tables[s.request.request_id][:nb] for s in group]
        padded = self._tensor([t + [0] * (nb - len(t)) for t in tables]).view(len(group), nb)
        if self.decode_in_place:  # the kernel reads each row's own length: no mask
            return DecodeGroup(start, start + len(group), padded, max_len, None, self._tensor(lens))
        mask = None
        if min(lens) != max_len:
            mask = DecodeGroup.padding_mask(self._tensor(lens), max_len, self.cache.compute_dtype)
        return DecodeGroup(start, start + len(group), padded, max_len, mask)

    def _window_decode_group(self, group: list[ScheduledRequest], start: int, block_tables: dict[str, list[int]],
                             lens: list[int], window: int) -> DecodeGroup:
        """Decodes of a sliding-window group: each row gathers from the block holding the first
        key of its window (``firsts`` slots of that block are masked) to its end."""
        bs = self.block_size
        first_blocks = [first_live_block(n, window, bs) for n in lens]
        local = [n - b * bs for n, b in zip(lens, first_blocks)]
        firsts = [max(0, n - window) - b * bs for n, b in zip(lens, first_blocks)]
        max_len = max(local)
        nb = blocks_for(max_len, bs)
        tables = [block_tables[s.request.request_id][b:b + nb] for s, b in zip(group, first_blocks)]
        padded = self._tensor([t + [0] * (nb - len(t)) for t in tables]).view(len(group), nb)
        mask = None
        if min(local) != max_len or any(firsts):
            mask = DecodeGroup.window_mask(self._tensor(firsts), self._tensor(local), max_len, self.cache.compute_dtype)
        return DecodeGroup(start, start + len(group), padded, max_len, mask)


def _group_bounds(lengths: list[int], min_len: int = 64) -> list[int]:
    """End indices splitting sorted context ``lengths`` so each group's longest is <= 2x its shortest.

    Contexts up to ``min_len`` tokens share one group (gathering them is cheap whatever the padding).
    """
    bounds: list[int] = []
    first = None
    for i, n in enumerate(lengths):
        if first is None:
            first = n
        elif n > 2 * max(first, min_len):
            bounds.append(i)
            first = n
    if lengths:
        bounds.append(len(lengths))
    return bounds
