"""How to pick each new token and when to stop: vLLM's ``SamplingParams`` names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.errors import KVLedgerError


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules.

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 and ``top_p=1`` disable those filters.
    ``seed`` makes one request's sampling reproducible regardless of its batch. ``max_tokens``
    counts generated tokens. ``stop`` strings end generation with ``finish_reason="stop"`` and
    are cut from the text (kept with ``include_stop_str_in_output``); ``stop_token_ids`` end it
    too and stay in ``token_ids``. ``ignore_eos`` keeps going past the end-of-sequence token.
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
            raise KVLedgerError(f"n={self.n} is not supported; the engine returns one completion per prompt (n=1)")
        if self.temperature < 0:
            raise KVLedgerError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KVLedgerError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise KVLedgerError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise KVLedgerError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise KVLedgerError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not s for s in self.stop_list):
            raise KVLedgerError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
