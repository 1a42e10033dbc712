"""Simulated requests: lengths and block keys, first-class requests of the engine's scheduler.

The scheduler and the KV cache manager only ask a request for :attr:`Request.num_tokens` and
:meth:`Request.block_content`; a :class:`SimRequest` answers both without token ids:

* a prompt given as token ids (a recorded real run) answers with them, as the engine does;
* a Mooncake prompt answers with its ``hash_ids``: block ``i`` of the pool covers tokens
  ``[i b, (i+1) b)``, which lie in hash blocks ``start // L .. (end-1) // L`` of ``L`` tokens
  each (512 scaled by ``--length-scale``, as ``kvledger bench serve`` builds its prompts), so
  its key is those ids and the offset into the first. Equal ids, equal keys, prefix hits;
* a shared prefix (``--shared-prefix-tokens``, a system prompt every request starts with)
  answers with the same key in every request for the blocks it fills;
* everything else (prompts without hashes, output tokens, a prompt's tail past its hash ids)
  is unique to the request: key ``(-2 - uid, i)`` (not -1: Python hashes -1 as -2). A preempted request finds its own blocks
  again, as in the engine; no two requests share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvledger.kvcache.block_pool import hash_block
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.sequence import Request
from kvledger.workload.traces import MOONCAKE_BLOCK_TOKENS


SHARED_PREFIX_KEY = -(2**62)
"""Key of the shared prefix's blocks (request keys are ``-2 - uid``, hash ids are non-negative)."""


def hash_block_tokens(length_scale: float = 1.0) -> int:
    """Tokens per Mooncake ``hash_ids`` block once lengths are scaled (at least 1)."""
    return max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))


@dataclass(eq=False)
class SimRequest(Request):
    """A request of ``prompt_len`` prompt tokens that ends after ``output_len`` output tokens.

    Times are virtual seconds; ``first_token_step``/``finish_step`` index the replica's steps."""

    uid: int = 0
    prompt_len: int = 0
    output_len: int = 1
    hash_ids: Sequence[int] | None = None
    hash_tokens: int = MOONCAKE_BLOCK_TOKENS
    num_output: int = 0
    finish_time: float | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    token_times: list[float] = field(default_factory=list)
    replica: int = 0
    shared_prefix: int = 0
    """Leading prompt tokens every request shares (whole blocks of them are shared)."""

    num_tokens: int = 0  # type: ignore[assignment]
    """Prompt plus output tokens so far: a field here, not the engine's property (the scheduler
    reads it for every running request in every step); the driver counts each token into
    ``num_output``, ``num_tokens`` and ``token_times`` together."""

    def __post_init__(self) -> None:
        self.num_tokens = self.prompt_len + self.num_output

    @property
    def num_prompt_tokens(self) -> int:  # type: ignore[override]
        return self.prompt_len

    def block_content(self, index: int, block_size: int) -> Sequence[int]:
        start, end = index * block_size, (index + 1) * block_size
        if end <= self.prompt_len:
            if end <= self.shared_prefix:
                return (SHARED_PREFIX_KEY, index)
            if self.prompt_token_ids:
                return self.prompt_token_ids[start:end]
            if self.hash_ids:
                size = self.hash_tokens
                first, last = start // size, (end - 1) // size
                if last < len(self.hash_ids):
                    return (*self.hash_ids[first:last + 1], start - first * size)
        return (-2 - self.uid, index)

    def block_hash(self, parent: Any, index: int, block_size: int) -> Any:
        """The prefix-cache key of full block ``index``. Token ids are hashed as the engine hashes
        them; the simulator's own keys (tuples of ints) are chained with Python's integer hash,
        which is deterministic and about 50x cheaper than SHA-256 (millions of blocks per trace):
        a 64-bit chain, so a collision among ``n`` blocks has odds of about ``n^2 / 2^65``."""
        parent = 0 if parent is None else parent
        content = self.block_content(index, block_size)
        if type(content) is tuple:
            return hash((parent, *content))
        if type(parent) is int:  # token ids: the first block, or after simulator keys (a shared prefix)
            parent = parent.to_bytes(8, "little", signed=True) if parent else None
        return hash_block(parent, content)

    def leading_keys(self, block_size: int, limit: int) -> list[Sequence[int]]:
        """Keys of the first ``limit`` full prompt blocks (what prefix-affinity routing compares)."""
        n = min(limit, self.prompt_len // block_size)
        return [self.block_content(i, block_size) for i in range(n)]


def make_request(uid: int, prompt_len: int, output_len: int, arrival_s: float, *,
                 hash_ids: Sequence[int] | None = None, length_scale: float = 1.0,
                 prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                 shared_prefix: int = 0) -> SimRequest:
    """A :class:`SimRequest` arriving at ``arrival_s`` virtual seconds."""
    if prompt_len < 1 or output_len < 1 or not math.isfinite(arrival_s):
        raise ValueError(f"request {uid}: prompt {prompt_len}, output {output_len}, arrival {arrival_s}")
    return SimRequest(request_id=request_id or str(uid), prompt_token_ids=list(prompt_token_ids or []),
                      sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True), arrival=uid,
                      arrival_time=arrival_s, uid=uid, prompt_len=prompt_len, output_len=output_len,
                      hash_ids=hash_ids, hash_tokens=hash_block_tokens(length_scale), shared_prefix=shared_prefix)
