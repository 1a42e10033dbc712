"""``LLMEngine``: requests in, one step at a time, outputs and the KV ledger out.

This is the seam a server drives from its event loop (one ``step()`` at a time, between
awaits):

* ``add_request(request_id, prompt_token_ids, sampling_params)`` queues a request, or raises
  :class:`KVLedgerError` at once, with the numbers, if it could never fit (prompt + max_tokens
  over ``max_model_len``; the pool always holds ``max_model_len`` tokens);
* ``abort_request(request_id)`` ends it and returns its blocks to the pool immediately;
* ``step()`` schedules and runs one batch and returns a :class:`RequestOutput` for every
  request that produced a token (``new_token_ids``, ``text_delta``, ``finished``,
  ``finish_reason``); stop strings are applied here, the text cut before them as in vLLM. If
  one request's own work (sampling, stop checks, detokenization) raises, that request alone
  ends, with ``finish_reason`` "error" and the cause in its output's ``error``; the step's other
  requests carry on unchanged. If the model itself raises, the requests of that step are
  aborted, the prefix-cache entries of the blocks it was to write are dropped, and the error
  propagates; requests outside the step carry on;
* ``has_unfinished_requests()`` and ``ledger()`` (live :class:`KVLedger` numbers).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from kvledger.config import EngineConfig
from kvledger.engine.limits import check_request_length
from kvledger.engine.model_runner import ModelRunner
from kvledger.engine.outputs import (Arrival, CompletionOutput, KVGroupLedger, KVLedger, OffloadLedger,
                                     RequestOutput, StepRecord)
from kvledger.engine.sampler import sample
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.scheduler import Scheduler, SchedulerOutput
from kvledger.engine.sequence import Request
from kvledger.errors import KVLedgerError, ParameterError
from kvledger.kvcache.block_pool import BlockPool
from kvledger.kvcache.groups import NULL_BLOCK, KVCacheGroup, first_live_block
from kvledger.kvcache.manager import KVCacheManager
from kvledger.kvcache.offload import STORE_ON_COMPUTE, STORE_ON_EVICT, OffloadStore
from kvledger.kvcache.offload_storage import DiskKVTier, HostKVTier, make_offload_tier
from kvledger.kvcache.storage import KVCache
from kvledger.spec import ModelSpec
from kvledger.spec.dtypes import PER_LAYER_SCALE_DTYPES
from kvledger.spec.kv_bytes import KVBytes
from kvledger.spec.offload import OffloadCapacity, tier_capacity


log = logging.getLogger("kvledger.engine")


class LLMEngine:
    """Paged-KV inference engine: scheduler + block pool + model runner + detokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)  # every rank: the model (or its shard) and its KV cache
        self.config = config = self.runner.config  # the block size resolved for the device
        self.tokenizer = self._load_tokenizer()
        self.eos_token_ids = self._eos_ids(self.runner.model_dir)
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=config.enable_prefix_caching)
        self.offload_capacity: OffloadCapacity | None = None
        """The second KV tier's size (vLLM's arithmetic), or None without one."""
        self.offload_tier: HostKVTier | DiskKVTier | None = None
        """The second KV tier's bytes: host memory, or files on disk."""
        store, store_rule = None, STORE_ON_EVICT
        if config.kv_offloading_size is not None:
            self.offload_capacity = self._offload_capacity(config)
            store = OffloadStore(self.offload_capacity.num_blocks)
            # on disk, blocks are written as they are computed, so that a restart finds them
            store_rule = STORE_ON_COMPUTE if config.kv_offloading_path else STORE_ON_EVICT
        self.kv_manager = KVCacheManager(self.pool, config.block_size, self.kv_groups, offload=store,
                                         store_rule=store_rule)
        if store is not None:
            self.offload_tier = make_offload_tier(self.cache, self.offload_capacity, store, config.kv_offloading_path,
                                                  self._cache_identity())
        self.scheduler = Scheduler(config, self.kv_manager)
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.blocks_allocated_peak = 0
        self.num_steps = 0
        self.step_records: list[StepRecord] | None = None
        """Set to a list to have every step that ran appended to it (batch, tokens, wall time)."""
        self._arrived: list[Arrival] = []  # taken since the last recorded step (only while recording)
        # draws of requests without their own seed (vLLM's --seed); None leaves them to torch's global generator
        self.generator = None if config.seed is None else torch.Generator(self.device).manual_seed(config.seed)

    # ---- set-up helpers -------------------------------------------------------------------
    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        source = self.config.tokenizer or self.runner.model_dir
        try:
            return AutoTokenizer.from_pretrained(str(source))
        except (OSError, ValueError) as err:
            raise KVLedgerError(f"no tokenizer loads from {source}: "
                                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do at TP 1) and let go of the weights, the KV
        cache and the offloading tier's memory; the engine runs no steps after. A disk tier first
        writes the blocks still waiting to be stored (the last step's, when a request was aborted)."""
        if self.offload_tier is not None and not self.runner.closed:
            self._flush_stores()
        self.runner.shutdown()
        if self.offload_tier is not None:
            self.offload_tier.close()

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids: set[int] = set()
        sources: list[Any] = [self.hf_config.get("eos_token_id"), self.tokenizer.eos_token_id]
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def _offload_capacity(self, config: EngineConfig) -> OffloadCapacity:
        """The tier's blocks for ``kv_offloading_size`` GiB; refused in one line where the engine
        cannot keep one (a disk tier of an fp8 cache whose per-layer scales are set anew by each
        process; sliding windows: :func:`tier_capacity`; tensor parallelism: the configuration,
        before anything loads)."""
        if config.kv_offloading_path and self.kv_cache_dtype in PER_LAYER_SCALE_DTYPES:
            raise KVLedgerError(f"--kv-offloading-path: a --kv-cache-dtype {self.kv_cache_dtype} cache keeps one scale "
                                "per layer, set anew by each process, so its blocks cannot outlive it on disk; use "
                                "int8 or a 16/32-bit cache, or host memory")
        return tier_capacity(self.spec, self.kv_cache_dtype, config.block_size, config.kv_offloading_size,
                             config.tensor_parallel_size)

    def _cache_identity(self) -> dict[str, Any]:
        """What a block's bytes depend on besides its tokens: a disk tier's manifest."""
        spec = self.spec
        return {"model": self.model_name, "dtype": str(self.dtype).removeprefix("torch."),
                "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size, "num_layers": spec.num_layers,
                "num_kv_heads": self.kv_bytes.kv_heads, "head_dim": spec.head_dim}

    # ---- what the runner built, by name -----------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.runner.hf_config

    @property
    def spec(self) -> ModelSpec:
        return self.runner.spec

    @property
    def kv_bytes(self) -> KVBytes:
        """Eq 2.2 for one token on one rank, in the cache's dtype."""
        return self.runner.kv_bytes

    @property
    def kv_cache_dtype(self) -> str:
        return self.runner.kv_cache_dtype

    @property
    def kv_groups(self) -> list[KVCacheGroup]:
        return self.runner.kv_groups

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes.bytes_per_token

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request; raise KVLedgerError now if it is malformed or could never fit (a token id
        outside the vocabulary, in the prompt or in ``stop_token_ids``, is a :class:`ParameterError`).
        ``arrival_time``: when the request reached the caller (``time.perf_counter()`` seconds, as in
        vLLM: a server passes the moment it received it); now, if not given."""
        sp = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise KVLedgerError(f"request id {request_id!r} is already in the engine")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise KVLedgerError("the prompt is empty: give at least one token")
        self._check_vocabulary(ids, "prompt", "token id")
        self._check_vocabulary(sp.stop_token_ids, "stop_token_ids", "stop token id")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len - len(ids)
        check_request_length(len(ids), max_tokens, self.max_model_len)
        if sp.max_tokens is None:
            sp = dataclasses.replace(sp, max_tokens=max_tokens)
        taken = time.perf_counter()
        received = taken if arrival_time is None else float(arrival_time)
        request = Request(request_id, ids, sp, arrival=self._arrivals, prompt=prompt, arrival_time=received)
        self._arrivals += 1
        if self.step_records is not None:
            self._arrived.append(Arrival(request_id, len(ids), sp.max_tokens, taken, received))
        request.generator = self.generator if sp.seed is None else torch.Generator(self.device).manual_seed(sp.seed)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _check_vocabulary(self, ids: list[int], param: str, what: str) -> None:
        """Every id in ``[0, vocab_size)``, else a :class:`ParameterError` naming ``param``."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParameterError(param, f"{what} {bad[0]} in '{param}' is outside the vocabulary "
                                        f"[0, {self.vocab_size})")

    def abort_request(self, request_id: str) -> None:
        """End a request now (finish_reason "abort"); its blocks return to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; outputs for every request that got a new token."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        ended = self._run_transfers(out) if out.kv_transfers else []
        if not out.scheduled:
            return ended
        batch = ([(s.request.request_id, s.request.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
                 if self.step_records is not None else [])
        try:
            model_start = time.perf_counter()
            samplers, logits = self.runner.execute(out, self.kv_manager.group_tables)
            model_s = time.perf_counter() - model_start
        except BaseException:
            self._abort_failed_step(out)
            raise
        self.scheduler.update(out)
        self.blocks_allocated_peak = max(self.blocks_allocated_peak, self.pool.num_blocks - self.pool.num_free_blocks)
        if self.kv_manager.hybrid:
            self.kv_manager.note_peaks()
        requests = [s.request for s in samplers]
        tokens, failed = sample(logits, requests, self.eos_token_ids) if requests else ([], {})
        now = time.perf_counter()
        outputs = []
        for i, (request, token) in enumerate(zip(requests, tokens)):
            error, stage = failed.get(i), "sampling"
            if error is None:
                try:
                    request.output_token_ids.append(token)
                    if request.first_token_time is None:
                        request.first_token_time = now
                    self._check_stop(request, token)
                    outputs.append(self._make_output(request, token))
                except Exception as err:  # noqa: BLE001 - this request's failure, not the step's
                    error, stage = err, "detokenizing or checking stops"
            if error is not None:
                outputs.append(self._fail_request(request, error, stage))
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        if self.offload_tier is not None and not self.scheduler.has_unfinished():
            self._flush_stores()
        if self.step_records is not None:
            arrived, self._arrived = self._arrived, []
            self.step_records.append(StepRecord(self.num_steps, batch, len(requests), start,
                                                time.perf_counter() - start, model_s,
                                                [r.request_id for r in out.preempted], arrived))
        self.num_steps += 1
        return ended + outputs

    # ---- the second KV tier ---------------------------------------------------------------------
    def _run_transfers(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Copy the step's blocks between the tiers before its model run. If a copy fails, the
        step's copies are forgotten (:meth:`KVCacheManager.abort_transfers`) and the requests
        whose blocks were to be loaded end with finish_reason "error", out of the step; the others
        run; the slots it was to load from are dropped from tier 2 (their bytes are not trusted).
        Returns the outputs of the requests it ended."""
        transfers = out.kv_transfers
        try:
            self.offload_tier.run(transfers)
            return []
        except Exception as err:  # noqa: BLE001 - a failed copy ends the requests that needed it
            self.kv_manager.abort_transfers(transfers)
            for load in transfers.loads:  # a slot that failed to load is not trusted again
                self.kv_manager.offload.drop(load.block_hash)
            self.offload_tier.forget([(st.slot, st.block_hash) for st in transfers.stores]
                                     + [(ld.slot, ld.block_hash) for ld in transfers.loads])
            targets = {load.block_id for load in transfers.loads}
            hit = [s for s in out.scheduled
                   if targets.intersection(self.kv_manager.block_tables.get(s.request.request_id, ()))]
            out.scheduled = [s for s in out.scheduled if s not in hit]
            outputs = []
            for s in hit:
                outputs.append(self._fail_request(s.request, err, "loading its KV blocks from the offloading tier"))
                self.requests.pop(s.request.request_id, None)
            if not hit:
                log.error("KV offloading: a store failed (%s: %s); the blocks stay out of tier 2",
                          type(err).__name__, err)
            return outputs

    def _flush_stores(self) -> None:
        """The engine went idle: store now what the last step computed (store on compute), rather
        than at the next step, so a disk tier holds it even if no request comes again."""
        self.kv_manager.begin_step()
        transfers = self.kv_manager.take_transfers()
        if transfers:
            self._run_transfers(SchedulerOutput(kv_transfers=transfers))

    def _fail_request(self, request: Request, error: Exception, stage: str) -> RequestOutput:
        """End one request whose own work in a step raised (finish_reason "error"); its blocks go
        back to the pool, the step's other requests are untouched. The output names the request's
        sampling parameters and the error."""
        sp = request.sampling_params
        message = (f"request {request.request_id} failed while {stage} (temperature={sp.temperature}, "
                   f"top_p={sp.top_p}, top_k={sp.top_k}, seed={sp.seed}, min_tokens={sp.min_tokens}): "
                   f"{type(error).__name__}: {error}")
        log.error("%s", message, exc_info=error)
        self.scheduler.finish(request, "error")
        completion = CompletionOutput(0, request.text[:request.emitted_text_len], list(request.output_token_ids),
                                      "error")
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion], True,
                             arrival_time=request.arrival_time, first_token_time=request.first_token_time,
                             error=message)

    def _abort_failed_step(self, out: SchedulerOutput) -> None:
        """Abort the requests of a step whose model run raised, after dropping the prefix-cache
        entries of the blocks it was to write (their K/V may never have been written)."""
        for s in out.scheduled:
            self.kv_manager.uncache_unwritten(s.request, s.num_new_tokens)
        for s in out.scheduled:
            self.abort_request(s.request.request_id)

    def _check_stop(self, request: Request, token: int) -> None:
        sp = request.sampling_params
        n_out = len(request.output_token_ids)
        delta = self._detokenize(request)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                return self.scheduler.finish(request, "stop", None)
            if token in sp.stop_token_ids:
                return self.scheduler.finish(request, "stop", token)
            if sp.stop_list and delta:
                start = max(0, len(request.text) - len(delta) - sp.max_stop_len + 1)
                hits = [(request.text.find(s, start), s) for s in sp.stop_list]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    index, stop = min(hits)
                    cut = index + len(stop) if sp.include_stop_str_in_output else index
                    request.text = request.text[:cut]
                    return self.scheduler.finish(request, "stop", stop)
        if n_out >= sp.max_tokens:  # add_request keeps prompt + max_tokens within max_model_len
            self.scheduler.finish(request, "length")

    def _detokenize(self, request: Request) -> str:
        """Append the text of the newest token (incremental, holding back incomplete UTF-8); returns it."""
        ids = request.output_token_ids
        skip = request.sampling_params.skip_special_tokens
        prefix = self.tokenizer.decode(ids[request.prefix_offset:request.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[request.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            request.prefix_offset, request.read_offset = request.read_offset, len(ids)
            request.text += delta
            return delta
        return ""

    def _make_output(self, request: Request, token: int) -> RequestOutput:
        """The request after the step that sampled ``token``: what this step added, and (as vLLM's
        cumulative outputs) the visible text and token ids so far, copied (C-speed copies, small
        beside a step)."""
        text = request.text
        if request.is_finished:
            visible = len(text)
        else:  # hold back what could still become a stop string
            visible = max(request.emitted_text_len, len(text) - max(request.sampling_params.max_stop_len - 1, 0))
        delta = text[request.emitted_text_len:visible]
        request.emitted_text_len = visible
        completion = CompletionOutput(0, text[:visible], list(request.output_token_ids), request.finish_reason,
                                      request.stop_reason)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             request.is_finished, [token], delta, max(request.num_cached_tokens, 0),
                             request.arrival_time, request.first_token_time)

    # ---- the ledger -------------------------------------------------------------------------
    def ledger(self) -> KVLedger:
        """Live KV numbers: blocks vs tokens (waste), prefix-cache hits, preemptions, bytes (Eq 2.2 vs
        measured), per KV-cache group and per running request."""
        bs = self.block_size
        allocated = self.pool.num_blocks - self.pool.num_free_blocks
        tokens_used = self._tokens_used()
        ranks = self.tensor_parallel_size
        rank_bytes = self.runner.rank_measured_bytes
        stats = self.kv_manager.stats
        kvb, by_rank = self.kv_bytes, self.runner.kv_bytes_by_rank  # each rank with its own KV heads
        predicted = sum(k.pages_bytes(self.num_blocks, bs) for k in by_rank)
        group_layers = max(len(g.layers) for g in self.kv_groups)
        element_bytes = self.num_blocks * bs * group_layers * sum(k.bytes_per_token // k.num_layers for k in by_rank)
        return KVLedger(
            num_blocks=self.num_blocks, block_size=bs, blocks_allocated=allocated,
            blocks_allocated_peak=self.blocks_allocated_peak, blocks_cached_free=self.pool.num_cached_free_blocks,
            tokens_used=tokens_used, waste_tokens=allocated * bs - tokens_used,
            prefix_cache_queries=stats.queries, prefix_cache_hits=stats.hits,
            num_preemptions=self.scheduler.num_preemptions, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), bytes_per_token=kvb.bytes_per_token_all_ranks,
            predicted_bytes=predicted, measured_bytes=sum(rank_bytes),
            kv_cache_dtype=self.kv_cache_dtype, scale_bytes_per_token=sum(k.scale_bytes_per_token for k in by_rank),
            scale_bytes=predicted - element_bytes, bytes_per_block=kvb.page_bytes(bs),
            ranks=ranks, bytes_per_rank=rank_bytes[0], measured_bytes_by_rank=list(rank_bytes),
            groups=self._group_ledgers(),
            request_bytes={r.request_id: self.request_bytes(r.request_id) for r in self.scheduler.running},
            prompt_tokens_by_source=stats.by_source(), offload=self._offload_ledger(),
        )

    def _offload_ledger(self) -> OffloadLedger | None:
        cap, store, tier = self.offload_capacity, self.kv_manager.offload, self.offload_tier
        if cap is None or store is None or tier is None:
            return None
        stats, counts = self.kv_manager.stats, store.stats
        return OffloadLedger(
            backend=tier.backend, path=tier.path, capacity_blocks=cap.num_blocks, stored_blocks=store.num_stored,
            block_bytes=cap.block_bytes, bytes=store.num_stored * cap.block_bytes, slot_bytes=cap.slot_bytes,
            capacity_bytes=cap.bytes, queries=stats.offload_queries, hits=stats.offload_hits,
            blocks_stored=counts.stored, blocks_loaded=counts.loaded, blocks_evicted=counts.evicted,
            stores_skipped=counts.skipped)

    def _group_ledgers(self) -> list[KVGroupLedger]:
        manager = self.kv_manager
        if manager.hybrid:
            held, used, peaks = manager.blocks_held(), manager.group_tokens_used(self.scheduler.running), \
                manager.blocks_allocated_peak
        else:
            held = [self.pool.num_blocks - self.pool.num_free_blocks]
            used, peaks = [self._tokens_used()], [self.blocks_allocated_peak]
        return [KVGroupLedger(g.attention, list(g.layers), g.sliding_window, held[i], peaks[i], used[i])
                for i, g in enumerate(self.kv_groups)]

    def request_bytes(self, request_id: str) -> int:
        """Bytes request ``request_id``'s token slots hold in the pool now: per group, the slots from
        its first kept block to its computed tokens, times the group's paged layers (a block
        pages ``group_layers`` layers), times one layer's bytes per token, scales included. For
        a request of T computed tokens this equals ``kv_bytes(..., tokens=T, block_size=...).held_bytes``
        less fixed scales."""
        request = self.requests.get(request_id)
        if request is None:
            return 0
        per_slot = self.kv_bytes.page_bytes(self.block_size) // self.block_size
        return per_slot * sum(self.kv_manager.request_token_slots(request))

    def _tokens_used(self) -> int:
        """Tokens with K/V in allocated blocks, a shared block counted once (see
        :meth:`KVCacheManager.tokens_used`)."""
        return self.kv_manager.tokens_used(self.scheduler.running)

    def check_integrity(self) -> None:
        """Assert the block pool is consistent with every request's block tables (every group), the
        running requests are the ones holding blocks, a sliding group holds exactly its window's
        blocks, and :meth:`_tokens_used` equals a walk over every block of every table (each
        block filled as far as the most advanced of its holders)."""
        self.kv_manager.check_integrity()
        tables = self.kv_manager.block_tables
        assert set(tables) == {r.request_id for r in self.scheduler.running}, "block tables are not the running requests"
        bs = self.block_size
        walked = 0
        for group, group_tables in zip(self.kv_groups, self.kv_manager.group_tables):
            fill: dict[int, int] = {}
            for rid, table in group_tables.items():
                computed = self.requests[rid].num_computed_tokens
                if group.sliding_window is not None:
                    first = first_live_block(computed, group.sliding_window, bs)
                    assert all(b == NULL_BLOCK for b in table[:first]) and NULL_BLOCK not in table[first:], \
                        f"{rid}: the sliding group holds blocks outside its window: {table}"
                for i, block in enumerate(table):
                    if block != NULL_BLOCK:
                        fill[block] = max(fill.get(block, 0), min(bs, max(0, computed - i * bs)))
            walked += sum(fill.values())
        used = self._tokens_used()
        assert used == walked, f"the ledger counts {used} tokens in use, the blocks hold {walked}"
