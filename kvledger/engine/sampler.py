"""Pick the next token from logits: greedy, or temperature with top-k / top-p and optional seeds."""

from __future__ import annotations

import torch

from kvledger.engine.sequence import Request


@torch.inference_mode()
def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int]
           ) -> tuple[list[int], dict[int, Exception]]:
    """One token id per row of ``logits`` ``[B, vocab]`` (float32), row ``i`` belonging to ``requests[i]``,
    and the error of every row whose own work failed (its token is then meaningless).

    A request still short of its ``min_tokens`` cannot draw its stop tokens (EOS unless
    ``ignore_eos``, and ``stop_token_ids``). Greedy rows come from one batched argmax, sampled
    rows replace theirs, and the tokens reach the host in one transfer. A failure in one row's
    masking or drawing is that row's alone: the other rows are sampled as if it were not there."""
    errors: dict[int, Exception] = {}
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if sp.min_tokens and len(r.output_token_ids) < sp.min_tokens:
            banned = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos else list(eos_token_ids))
            if banned:
                try:
                    logits[i, banned] = float("-inf")
                except Exception as err:  # noqa: BLE001 - reported as this request's error
                    errors[i] = err
    tokens = logits.argmax(dim=-1)
    rows, sampled = [], []
    for i, r in enumerate(requests):
        if r.sampling_params.greedy or i in errors:
            continue
        try:
            sampled.append(_sample_row(logits[i], r))
            rows.append(i)
        except Exception as err:  # noqa: BLE001 - reported as this request's error
            errors[i] = err
    if rows:
        tokens[torch.tensor(rows, device=tokens.device)] = torch.cat(sampled)
    return tokens.tolist(), errors


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
        # drop tokens once the mass before them already reaches top_p; the first always stays
        # (a top_p below float32's smallest number would otherwise drop every token)
        drop = (probs.cumsum(-1) - probs) >= sp.top_p
        drop[0] = False
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(row, dim=-1)
    return torch.multinomial(probs, 1, generator=request.generator)
