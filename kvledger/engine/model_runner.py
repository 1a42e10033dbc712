"""One engine step on the model: flat inputs, slot mapping, block tables, then logits.

The flat batch puts one token per decoding request first, then each prefill chunk. Logits
are computed only for the last token of each request that samples this step.

A model with several KV-cache groups (Gemma-3's full and sliding layers) gets one
:class:`AttentionMetadata` per group, built from that group's block tables; a sliding group's
tables start at the first block its window reaches and its masks apply the window.
"""

from __future__ import annotations

import torch

from typing import Sequence

from kvledger.engine.block_pool import blocks_for
from kvledger.engine.kv_cache_manager import KVCacheGroup, first_live_block
from kvledger.engine.compile import ModelStep
from kvledger.engine.scheduler import SchedulerOutput, ScheduledRequest
from kvledger.layers import paged_decode, paged_prefill
from kvledger.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from kvledger.layers.paged_kv import KVCache
from kvledger.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device,
                 groups: Sequence[KVCacheGroup] | None = None, compiled: bool = False) -> None:
        self.model = model
        self.step = ModelStep(model, compiled)  # the forward, compiled or eager (kvledger.engine.compile)
        self.cache = cache
        self.block_size = cache.block_size
        self.device = device
        self.windows = [g.sliding_window for g in groups] if groups else [None]
        attn = model.layers[0].self_attn if hasattr(model, "layers") else None  # this rank's heads
        kernels = [] if attn is None else [cache.storage.device, cache.compute_dtype, attn.num_heads,
                                           attn.num_kv_heads, attn.head_dim]  # what they ask
        self.decode_in_place = bool(kernels) and paged_decode.supports(*kernels, kv_dtype=cache.layer_pools(0).k.dtype)
        """Decodes read K/V in place with the CPU kernel (:mod:`kvledger.layers.paged_decode`) rather
        than gathering them (8-bit caches too)."""
        self.prefill_in_place = bool(kernels) and not cache.quantized and paged_prefill.supports(*kernels)
        """Prefill chunks read K/V in place with the CPU kernel (:mod:`kvledger.layers.paged_prefill`)
        where it serves the cache; otherwise flash SDPA runs them."""
        self.last_logits: torch.Tensor | None = None  # [samplers, vocab] of the latest step (tests read it)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]] | Sequence[dict[str, list[int]]]
                ) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run the step; returns the requests that sample (in logits row order) and their logits.
        ``block_tables`` are the tables of the one KV group, or a list with each group's."""
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
        logits = self.step(self._tensor(input_ids), positions, metas[0] if len(metas) == 1 else metas, self.cache,
                            self._tensor(logits_indices))
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
