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

from kvledger.config import (CPU_KV_CACHE_MAX, CPU_KV_CACHE_SHARE, GPU_MEMORY_UTILIZATION, EngineConfig,
                             default_block_size)
from kvledger.engine.block_pool import BlockPool
from kvledger.engine.compile import compile_enabled
from kvledger.engine.kv_cache_manager import FULL_ATTENTION, KVCacheGroup, KVCacheManager
from kvledger.engine.model_runner import ModelRunner
from kvledger.engine.outputs import CompletionOutput, KVGroupLedger, KVLedger, RequestOutput, StepRecord
from kvledger.engine.sampler import sample
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.scheduler import Scheduler, SchedulerOutput
from kvledger.engine.sequence import Request
from kvledger.errors import KVLedgerError, ParameterError
from kvledger.layers.paged_kv import TORCH_DTYPES
from kvledger.layers.quantized_kv import make_kv_cache
from kvledger.spec.dtypes import PER_LAYER_SCALE_DTYPES
from kvledger.units import available_ram_bytes, format_bytes


log = logging.getLogger("kvledger.engine")


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise KVLedgerError("--device cuda asked for but no CUDA device is available; use --device cpu")
    return torch.device(name)


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device the pool goes on: CUDA's own figures, or the host's
    available and total RAM on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    import os

    return available_ram_bytes(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class LLMEngine:
    """Paged-KV inference engine: scheduler + block pool + model runner + detokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        from kvledger.loader.resolve import converted_dir, resolve_model
        from kvledger.loader.safetensors import load_safetensors_state_dict, read_config
        from kvledger.models.llama import LlamaForCausalLM
        from kvledger.spec import ModelSpec, kv_bytes, resolve_kv_cache_dtype

        self.device = _pick_device(config.device)
        if config.block_size is None:
            config = dataclasses.replace(config, block_size=default_block_size(self.device.type))
        self.config = config
        dtype_name = "float32" if config.dtype == "auto" else config.dtype
        self.dtype = TORCH_DTYPES[dtype_name]
        checkpoint = resolve_model(config.model)
        self.model_name = checkpoint.name
        model_dir = converted_dir(checkpoint)
        self.hf_config = read_config(model_dir)
        from kvledger.models import gemma3
        from kvledger.models.llama import SUPPORTED_MODEL_TYPES

        model_class: Any = LlamaForCausalLM
        if self.hf_config.get("model_type") in gemma3.SUPPORTED_MODEL_TYPES:
            model_class = gemma3.Gemma3ForCausalLM
        elif self.hf_config.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise KVLedgerError(f"{self.model_name}: model_type {self.hf_config.get('model_type')!r} is not supported by "
                                f"the engine; supported: {', '.join(SUPPORTED_MODEL_TYPES + gemma3.SUPPORTED_MODEL_TYPES)}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer or model_dir))
        except (OSError, ValueError) as err:
            raise KVLedgerError(f"no tokenizer loads from {config.tokenizer or model_dir}: "
                                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        self.eos_token_ids = self._eos_ids(model_dir)

        # Eq 2.2 for one token (on one rank), from the model spec (pure Python), in the cache's dtype.
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype_name)
        self.spec = ModelSpec.from_config_dict({**self.hf_config, "torch_dtype": dtype_name}, name=self.model_name)
        self.tensor_parallel_size = tp = config.tensor_parallel_size
        self.kv_bytes = kv_bytes(self.spec, self.kv_cache_dtype, tensor_parallel_size=tp)  # raises for a bad TP
        self.executor = None
        if tp > 1:  # ranks 1..tp-1 start loading their shards while rank 0 loads its own here
            if model_class is not LlamaForCausalLM:
                raise KVLedgerError(f"--tensor-parallel-size {tp}: the engine shards the Llama family only, "
                                    f"not {self.model_name} ({self.hf_config.get('model_type')}); use --tensor-parallel-size 1")
            from kvledger.distributed.executor import TPExecutor

            self.executor = TPExecutor(tp, model_dir, self.hf_config, self.dtype, self.device)
            model = self.executor.model
        else:
            with torch.device("meta"):
                model = model_class(self.hf_config)
            model = model.to_empty(device=self.device).to(self.dtype)
            model.load_hf_state_dict(load_safetensors_state_dict(model_dir, self.dtype))
        self.model = model.eval()
        self.bytes_per_token = self.kv_bytes.bytes_per_token
        bs = config.block_size
        # KV-cache groups: one of every layer, or (sliding + full layers) groups of equal size whose
        # blocks page one group's layers each; the cache tensor holds that many layers.
        self.kv_groups = getattr(model, "kv_groups", None) or [KVCacheGroup(FULL_ATTENTION, tuple(range(self.spec.num_layers)))]
        cache_layers = max(len(g.layers) for g in self.kv_groups)
        if len(self.kv_groups) > 1 and self.kv_cache_dtype in PER_LAYER_SCALE_DTYPES:
            raise KVLedgerError(f"--kv-cache-dtype {self.kv_cache_dtype} keeps one scale per layer, but {self.model_name}'s "
                                "KV groups share cache layers; use int8 (per-token scales) or a 16/32-bit cache")
        num_blocks = config.num_gpu_blocks_override or self.kv_bytes.num_pages(self._kv_cache_memory(), bs)
        pool_bytes = self.kv_bytes.pages_bytes(num_blocks, bs) * (tp if self.device.type == "cpu" else 1)  # CPU ranks share RAM
        free, _ = _device_memory(self.device)
        if pool_bytes > free:  # checked before allocating: a pool that cannot fit would exhaust the machine
            flag = "--num-gpu-blocks-override" if config.num_gpu_blocks_override else "--kv-cache-memory"
            raise KVLedgerError(f"the KV pool of {num_blocks:,} blocks needs {format_bytes(pool_bytes)} but the "
                                f"{self.device.type} has {format_bytes(free)} free; lower {flag}")
        max_pos = int(self.hf_config.get("max_position_embeddings") or 2048)
        if config.max_model_len is None:
            self.max_model_len = self._longest_fitting(max_pos, num_blocks)
        else:
            self.max_model_len = config.max_model_len
            if self.max_model_len > max_pos:
                raise KVLedgerError(f"--max-model-len {self.max_model_len} exceeds the model's "
                                    f"max_position_embeddings {max_pos}")
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)  # raises for no blocks
        if self._request_blocks(self.max_model_len) > num_blocks:
            raise KVLedgerError(
                f"the KV pool holds {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens "
                f"({self.bytes_per_token} bytes/token) but one request of --max-model-len {self.max_model_len} tokens "
                f"may need {self._request_blocks(self.max_model_len)} blocks; "
                "give more --kv-cache-memory or a smaller --max-model-len")
        if self.executor is None:
            self.cache = make_kv_cache(self.kv_cache_dtype, cache_layers, num_blocks, bs, self.spec.num_kv_heads,
                                       self.spec.head_dim, self.dtype, self.device)
            self.model.set_rope(self.max_model_len)
            # the compiled step serves the Llama family (its attention operator counts layers in order)
            compiled = compile_enabled(config.enforce_eager) and model_class is LlamaForCausalLM
            self.runner: ModelRunner | Any = ModelRunner(self.model, self.cache, self.device, self.kv_groups, compiled)
        else:  # every rank allocates its own heads' cache; the pool's blocks are the minimum over ranks
            from kvledger.distributed.executor import CacheSpec

            self.cache = self.executor.start_cache(CacheSpec(
                self.kv_cache_dtype, self.spec.num_layers, num_blocks, bs, self.kv_bytes.kv_heads,
                self.spec.head_dim, self.max_model_len))
            if self.executor.cache_spec.num_blocks < num_blocks:
                num_blocks = self.executor.cache_spec.num_blocks
                self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
            self.runner = self.executor
        self.kv_manager = KVCacheManager(self.pool, bs, self.kv_groups)
        self.scheduler = Scheduler(config, self.kv_manager)
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.blocks_allocated_peak = 0
        self.num_steps = 0
        self.step_records: list[StepRecord] | None = None
        """Set to a list to have every step that ran appended to it (batch, tokens, wall time)."""
        self.vocab_size = int(self.hf_config["vocab_size"])
        # draws of requests without their own seed (vLLM's --seed); None leaves them to torch's global generator
        self.generator = None if config.seed is None else torch.Generator(self.device).manual_seed(config.seed)

    # ---- set-up helpers -------------------------------------------------------------------
    def _request_blocks(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens can hold at once: every block in a
        full group; in a sliding group its window plus the largest prefill chunk, and one more
        for a window that does not start at a block's edge."""
        bs, chunk = self.config.block_size, self.config.max_num_batched_tokens
        blocks = -(-num_tokens // bs)
        return sum(blocks if g.sliding_window is None else min(blocks, -(-(g.sliding_window + chunk) // bs) + 1)
                   for g in self.kv_groups)

    def _longest_fitting(self, max_pos: int, num_blocks: int) -> int:
        """The longest request (at most ``max_pos`` tokens) whose blocks always fit the pool."""
        lo, hi = 0, max_pos
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._request_blocks(mid) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _kv_cache_memory(self) -> int:
        if self.config.kv_cache_memory is not None:
            return int(self.config.kv_cache_memory)
        if self.config.gpu_memory_utilization is not None:  # vLLM's: a share of the device (of RAM on CPU), less what is in use
            free, total = _device_memory(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
            if budget <= 0:
                raise KVLedgerError(f"--gpu-memory-utilization {self.config.gpu_memory_utilization} leaves no room for "
                                    f"the KV pool: {format_bytes(total - free)} of {format_bytes(total)} is in use")
            return budget
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * GPU_MEMORY_UTILIZATION)
        # per rank: on CPU the ranks share the host's RAM
        return int(min(available_ram_bytes() * CPU_KV_CACHE_SHARE, CPU_KV_CACHE_MAX)) // self.tensor_parallel_size

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do at TP 1); the engine runs no steps after."""
        if self.executor is not None:
            self.executor.shutdown()

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

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    prompt: str | None = None) -> None:
        """Queue a request; raise KVLedgerError now if it is malformed or could never fit (a token id
        outside the vocabulary, in the prompt or in ``stop_token_ids``, is a :class:`ParameterError`)."""
        sp = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise KVLedgerError(f"request id {request_id!r} is already in the engine")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise KVLedgerError("the prompt is empty: give at least one token")
        self._check_vocabulary(ids, "prompt", "token id")
        self._check_vocabulary(sp.stop_token_ids, "stop_token_ids", "stop token id")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len - len(ids)
        total = len(ids) + max_tokens
        if max_tokens < 1 or total > self.max_model_len:
            raise KVLedgerError(
                f"prompt {len(ids)} tokens + max_tokens {max_tokens} = {total} exceeds --max-model-len "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens")
        if sp.max_tokens is None:
            sp = dataclasses.replace(sp, max_tokens=max_tokens)
        request = Request(request_id, ids, sp, arrival=self._arrivals, prompt=prompt, arrival_time=time.perf_counter())
        self._arrivals += 1
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
        if not out.scheduled:
            return []
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
        if self.step_records is not None:
            self.step_records.append(StepRecord(self.num_steps, batch, len(requests), start,
                                                time.perf_counter() - start, model_s,
                                                [r.request_id for r in out.preempted]))
        self.num_steps += 1
        return outputs

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
        rank_bytes = self.executor.rank_measured_bytes if self.executor is not None else [self.cache.measured_bytes]
        stats = self.kv_manager.stats
        kvb = self.kv_bytes
        predicted = kvb.pages_bytes(self.num_blocks, bs)  # per rank
        group_layers = max(len(g.layers) for g in self.kv_groups)
        element_bytes = self.num_blocks * bs * (self.bytes_per_token // kvb.num_layers) * group_layers
        return KVLedger(
            num_blocks=self.num_blocks, block_size=bs, blocks_allocated=allocated,
            blocks_allocated_peak=self.blocks_allocated_peak, blocks_cached_free=self.pool.num_cached_free_blocks,
            tokens_used=tokens_used, waste_tokens=allocated * bs - tokens_used,
            prefix_cache_queries=stats.queries, prefix_cache_hits=stats.hits,
            num_preemptions=self.scheduler.num_preemptions, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), bytes_per_token=self.bytes_per_token * ranks,
            predicted_bytes=predicted * ranks, measured_bytes=sum(rank_bytes),
            kv_cache_dtype=self.kv_cache_dtype, scale_bytes_per_token=kvb.scale_bytes_per_token * ranks,
            scale_bytes=(predicted - element_bytes) * ranks, bytes_per_block=kvb.page_bytes(bs),
            ranks=ranks, bytes_per_rank=rank_bytes[0], measured_bytes_by_rank=list(rank_bytes),
            groups=self._group_ledgers(),
            request_bytes={r.request_id: self.request_bytes(r.request_id) for r in self.scheduler.running},
        )

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
        from kvledger.engine.kv_cache_manager import NULL_BLOCK, first_live_block

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
