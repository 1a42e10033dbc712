"""What the engine hands back: per-request outputs (vLLM's shape) and the KV ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class CompletionOutput:
    """One completion: all its text and token ids so far, and why it ended (None while running)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    """A request's state after a step. ``new_token_ids`` and ``text_delta`` are what this step added
    (``text_delta`` holds back the end of the text that could still become a stop string).
    ``error`` is set, with ``finish_reason`` "error", when this request's own work in the step
    failed (sampling, stop checks, detokenization): it ended, the step's other requests did not."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: str | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class KVGroupLedger:
    """One KV-cache group's share of the ledger: its ``attention`` type (``full_attention`` or
    ``sliding_attention``), its model ``layers``, the ``sliding_window`` in tokens (None for full),
    blocks its tables hold now and at most (``blocks_allocated``, ``blocks_allocated_peak``) and
    the token slots with K/V in them (``tokens_used``, a shared block counted once)."""

    attention: str
    layers: list[int]
    sliding_window: int | None
    blocks_allocated: int
    blocks_allocated_peak: int
    tokens_used: int


@dataclass
class OffloadLedger:
    """The second KV tier's share of the ledger. ``backend``: ``host`` (memory) or ``disk`` (files
    under ``path``). Blocks: ``capacity_blocks`` slots, ``stored_blocks`` holding one now. Bytes:
    ``block_bytes`` per block (Eq 2.2's page, scales included), ``bytes`` = ``stored_blocks x
    block_bytes``, ``slot_bytes`` a slot (a block rounded up to the host page) and
    ``capacity_bytes`` = ``capacity_blocks x slot_bytes``. Prefix cache, in tokens (vLLM's
    ``external_prefix_cache_*``): ``queries`` asked of the tier (past the pool's hit), ``hits``
    loaded from it. Copies since start, in blocks: ``blocks_stored``, ``blocks_loaded``,
    ``blocks_evicted`` (to make room), ``stores_skipped`` (every slot pinned by a load)."""

    backend: str
    path: str | None
    capacity_blocks: int
    stored_blocks: int
    block_bytes: int
    bytes: int
    slot_bytes: int
    capacity_bytes: int
    queries: int
    hits: int
    blocks_stored: int
    blocks_loaded: int
    blocks_evicted: int
    stores_skipped: int


@dataclass
class KVLedger:
    """Live numbers of the KV cache.

    Blocks: ``num_blocks`` in the pool, ``blocks_allocated`` referenced by requests (free blocks
    that only hold a cached prefix are counted in ``blocks_cached_free`` instead),
    ``blocks_allocated_peak`` the most ever allocated at once. Tokens: ``tokens_used`` with K/V
    in allocated blocks (a shared block counted once), ``waste_tokens`` the empty slots of
    allocated blocks. Prefix cache: ``prefix_cache_queries`` and ``prefix_cache_hits`` in
    tokens (vLLM's counting). Bytes: ``bytes_per_token`` from Eq 2.2 (elements only),
    ``predicted_bytes`` = ``bytes_per_token * num_blocks * block_size`` plus ``scale_bytes``
    (8-bit caches: ``scale_bytes_per_token`` per slot for int8, per-layer scales for fp8),
    ``measured_bytes`` of the real cache tensors, scales included. Under tensor parallelism
    (``ranks`` > 1) the byte fields are summed over the ranks, each with its own KV heads
    (fewer on the last ranks when the heads split unevenly), ``bytes_per_rank`` is rank 0's
    measured cache bytes, the largest rank's (``measured_bytes_by_rank`` lists every rank's);
    ``bytes_per_block`` is rank 0's.

    A model with several KV-cache groups (sliding and full layers) pages its pool in blocks of
    one group's layers: ``bytes_per_block`` is such a block (``bytes_per_token * block_size`` for
    a single group), ``predicted_bytes`` = ``bytes_per_block * num_blocks`` plus fixed scales,
    and ``groups`` lists each group's blocks and tokens. ``request_bytes`` (request id -> bytes)
    is what each running request's token slots hold, every group's layers counted: the measured
    side of ``kv-bytes --tokens T``.
    """

    num_blocks: int
    block_size: int
    blocks_allocated: int
    blocks_allocated_peak: int
    blocks_cached_free: int
    tokens_used: int
    waste_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    bytes_per_token: int
    predicted_bytes: int
    measured_bytes: int
    kv_cache_dtype: str = "float32"
    scale_bytes_per_token: int = 0
    scale_bytes: int = 0
    ranks: int = 1
    bytes_per_rank: int = 0
    measured_bytes_by_rank: list[int] = field(default_factory=list)
    bytes_per_block: int = 0
    groups: list[KVGroupLedger] = field(default_factory=list)
    request_bytes: dict[str, int] = field(default_factory=dict)
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)
    offload: OffloadLedger | None = None


class Arrival(NamedTuple):
    """A request as the engine took it: its id, prompt tokens, ``max_tokens``, the
    ``time.perf_counter()`` seconds of :meth:`LLMEngine.add_request` (``time_s``) and of its
    ``arrival_time`` (``received_s``: when the server received the request; ``time_s`` when the
    caller gave none). The difference is the server's hand-over: reading and tokenizing the
    request, then waiting for the step boundary."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    time_s: float
    received_s: float | None = None


@dataclass
class StepRecord:
    """One engine step as it ran: the batch, its tokens and its times (seconds).

    ``batch`` holds ``(request_id, num_computed_tokens, num_new_tokens)`` per scheduled request,
    ``num_computed_tokens`` as it was before the step (the context the new tokens attend to
    besides themselves). ``preempted`` are the requests the scheduler preempted to make room.
    ``wall_s`` is the whole ``step()`` (scheduling, model, sampling, detokenizing), ``model_s``
    the model run alone; the rest is the CPU overhead of the step. ``start_s`` is
    ``time.perf_counter()`` when the step began. ``arrivals`` are the requests the engine took
    since the step before, as :class:`Arrival` (its ``time_s`` on the same clock as ``start_s``).
    The simulator emits the same records, with virtual times, so a recorded run and its replay
    compare step by step.
    """

    index: int
    batch: list[tuple[str, int, int]]
    num_samples: int
    start_s: float
    wall_s: float
    model_s: float = 0.0
    preempted: list[str] = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.batch)
