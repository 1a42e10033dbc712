"""One engine step on the model: flat inputs, slot mapping, block tables, then logits.

The flat batch puts one token per decoding request first, then each prefill chunk. Logits
are computed only for the last token of each request that samples this step.
"""

from __future__ import annotations

import torch

from kvledger.engine.scheduler import SchedulerOutput, ScheduledRequest
from kvledger.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from kvledger.layers.paged_kv import KVCache
from kvledger.models.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = device
        self.last_logits: torch.Tensor | None = None  # [samplers, vocab] of the latest step (tests read it)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]]
                ) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run the step; returns the requests that sample (in logits row order) and their logits."""
        bs = self.block_size
        decodes = sorted((s for s in out.scheduled if s.num_new_tokens == 1), key=lambda s: s.request.num_computed_tokens)
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        samplers: list[ScheduledRequest] = []
        for s in decodes + prefills:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            table = block_tables[r.request_id]
            input_ids.extend(r.token_ids_slice(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.samples:
                logits_indices.append(len(input_ids) - 1)
                samplers.append(s)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots))
        start = 0
        for end in _group_bounds([s.request.num_computed_tokens + 1 for s in decodes]):
            meta.decodes.append(self._decode_group(decodes[start:end], start, block_tables))
            start = end
        offset = len(decodes)
        for s in prefills:
            r = s.request
            n, computed = s.num_new_tokens, r.num_computed_tokens
            table = block_tables[r.request_id][: -(-(computed + n) // bs)]
            meta.prefills.append(PrefillChunk.causal(offset, n, computed, self._tensor(table).view(1, -1)))
            offset += n
        logits = self.model(self._tensor(input_ids), self._tensor(positions), meta, self.cache,
                            self._tensor(logits_indices))
        self.last_logits = logits
        return samplers, logits

    def _decode_group(self, group: list[ScheduledRequest], start: int, block_tables: dict[str, list[int]]) -> DecodeGroup:
        bs = self.block_size
        lens = [s.request.num_computed_tokens + 1 for s in group]
        max_len = max(lens)
        nb = -(-max_len // bs)
        tables = [block_tables[s.request.request_id][:nb] for s in group]
        padded = self._tensor([t + [0] * (nb - len(t)) for t in tables]).view(len(group), nb)
        mask = None
        if min(lens) != max_len:
            lens_t = self._tensor(lens)
            mask = (torch.arange(max_len, device=self.device)[None, :] < lens_t[:, None]).view(len(group), 1, 1, max_len)
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
