"""Pick the next token from logits: greedy, or temperature with top-k / top-p and optional seeds."""

from __future__ import annotations

import torch

from kvledger.engine.sequence import Request


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int]) -> list[int]:
    """One token id per row of ``logits`` ``[B, vocab]`` (float32), row ``i`` belonging to ``requests[i]``.

    Greedy rows come from one batched argmax, sampled rows replace theirs, and the tokens reach
    the host in one transfer."""
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if sp.min_tokens and len(r.output_token_ids) < sp.min_tokens:
            banned = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos else list(eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")
    tokens = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if rows:
        sampled = [_sample_row(logits[i], requests[i]) for i in rows]
        tokens[torch.tensor(rows, device=tokens.device)] = torch.cat(sampled)
    return tokens.tolist()


def _sample_row(row: torch.Tensor, request: Request) -> torch.Tensor:
    """A token id ``[1]`` drawn from one row of logits with the request's temperature, top-k, top-p and generator."""
    sp = request.sampling_params
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
    return torch.multinomial(probs, 1, generator=request.generator)
