"""How to pick each new token and when to stop: vLLM's ``SamplingParams`` names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvledger.errors import ParameterError
from kvledger.units import INT64_MAX, INT64_MIN

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy, as in vLLM (dividing logits by them overflows float32)."""


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules.

    ``temperature`` 0 (or anything below ``GREEDY_TEMPERATURE``, 1e-5) is greedy. ``top_k`` of 0
    or -1 and ``top_p=1`` disable those filters; ``top_p`` always keeps the most likely token.
    ``seed`` (a 64-bit signed integer) makes one request's sampling reproducible regardless of its
    batch. ``max_tokens`` counts generated tokens; until ``min_tokens`` of them exist the
    end-of-sequence token (unless ``ignore_eos``) and ``stop_token_ids`` cannot be sampled and stop
    strings are not looked for. ``stop`` strings end generation with ``finish_reason="stop"`` and
    are cut from the text (kept with ``include_stop_str_in_output``); ``stop_token_ids`` end it
    too and stay in ``token_ids``. ``ignore_eos`` keeps going past the end-of-sequence token.

    Every value is checked here (the engine checks token ids against its vocabulary); a bad one
    raises :class:`ParameterError` naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stop_list: list[str] = field(init=False, repr=False)
    max_stop_len: int = field(init=False, repr=False)  # characters of the longest stop string (0: none)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.max_stop_len = max((len(s) for s in self.stop_list), default=0)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n != 1:
            raise ParameterError("n", f"n={self.n} is not supported; the engine returns one completion per prompt (n=1)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ParameterError("temperature", f"temperature must be a finite number >= 0 (below {GREEDY_TEMPERATURE} "
                                                f"is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= INT64_MAX:
            raise ParameterError("top_k", f"top_k must be -1, 0 (off) or a positive 64-bit integer, got {self.top_k}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ParameterError("seed", f"seed must be a 64-bit signed integer, in [{INT64_MIN}, {INT64_MAX}], "
                                         f"got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ParameterError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                               f"({self.max_tokens}); lower min_tokens or raise max_tokens")
        if any(not s for s in self.stop_list):
            raise ParameterError("stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
