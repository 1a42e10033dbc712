"""A request's life in the engine: its tokens, progress through the cache and stop state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvledger.kvcache.block_pool import BlockHash, hash_block
from kvledger.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Prompt and output token ids, plus ``num_computed_tokens``: how many of them have K/V in the cache.

    The next step computes tokens ``[num_computed_tokens, num_tokens)`` (or a chunk of them);
    a token is sampled when that reaches ``num_tokens``. Preemption by recompute resets
    ``num_computed_tokens`` to 0 and keeps the tokens, so the request resumes where it was.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = -1  # prefix-cache hit of the first admission, in tokens (both tiers)
    num_offloaded_tokens: int = -1  # of num_cached_tokens, those loaded from the KV offloading tier
    num_preemptions: int = 0
    generator: Any = None  # torch.Generator for sampling: the request's seed, else the engine's (None: torch's)
    # incremental detokenization state
    text: str = ""
    emitted_text_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    first_token_time: float | None = None
    arrival_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    def block_content(self, index: int, block_size: int) -> Sequence[int]:
        """What identifies the content of full block ``index`` for the prefix cache: its token ids.

        The scheduler never needs more than this and :attr:`num_tokens`, so a request known only
        by lengths and block hashes (the simulator's) answers with keys of its own instead."""
        return self.token_ids_slice(index * block_size, (index + 1) * block_size)

    def block_hash(self, parent: BlockHash | None, index: int, block_size: int) -> BlockHash:
        """The prefix-cache key of full block ``index``: its content chained to ``parent``, the key
        of block ``index - 1`` (None for the first)."""
        return hash_block(parent, self.block_content(index, block_size))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
