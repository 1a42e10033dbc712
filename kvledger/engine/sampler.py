"""Pick the next token from logits: greedy, or temperature with top-k / top-p and optional seeds."""

from __future__ import annotations

import torch

from kvledger.engine.sequence import Request


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int]) -> list[int]:
    """One token id per row of ``logits`` ``[B, vocab]`` (float32), row ``i`` belonging to ``requests[i]``."""
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if sp.min_tokens and len(r.output_token_ids) < sp.min_tokens:
            banned = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos else list(eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")
    if all(r.sampling_params.greedy for r in requests):
        return logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, r in enumerate(requests):
        sp = r.sampling_params
        row = logits[i]
        if sp.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / sp.temperature
        if sp.top_k and sp.top_k > 0 and sp.top_k < row.numel():
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop tokens once the mass before them already reaches top_p (always keep the first)
            drop = (probs.cumsum(-1) - probs) >= sp.top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(row, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=r.generator)))
    return out
