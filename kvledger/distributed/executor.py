"""The tensor-parallel executor: ranks 1..N-1 as spawned processes, rank 0 in the engine's process.

Rank 0 holds the one scheduler and block pool. Each step its :class:`ModelRunner` turns the
scheduled batch into tensors as at TP 1; :class:`_BroadcastingModel` then broadcasts those
inputs (token ids, positions, slot mapping, block tables, logits rows) on the gloo dispatch
group and runs rank 0's shard, while every other rank runs its own shard on the same inputs.
The ranks meet in each row-parallel all-reduce; every rank computes the (replicated) LM head
and rank 0 samples from its logits.

Failure: a watchdog thread on rank 0 polls the ranks' processes every ``WATCHDOG_PERIOD_S``; a
collective with a dead peer fails at once (gloo sees the socket close) and one that waits on a
hung rank fails after ``COLLECTIVE_TIMEOUT_S``. Either way the step raises one
:class:`RankFailure` naming the rank, the other ranks are stopped, and every later step raises
the same error. Each worker exits when rank 0's process is gone.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvledger.distributed import parallel_state as ps
from kvledger.errors import KVLedgerError

WATCHDOG_PERIOD_S = 0.5


class RankFailure(KVLedgerError):
    """A tensor-parallel rank died or stopped answering; the engine cannot run further steps."""


@dataclass(frozen=True)
class ShardSpec:
    """What every rank needs to build its shard of the model."""

    model_dir: str
    hf_config: dict[str, Any]
    dtype: torch.dtype
    device_type: str  # "cpu" or "cuda"; rank r of a CUDA group uses cuda:r
    group: ps.GroupInfo
    num_threads: int


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache every rank allocates (its own KV heads), and the RoPE length."""

    kv_cache_dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # per rank
    head_dim: int
    max_model_len: int


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def build_shard(spec: ShardSpec, rank: int) -> torch.nn.Module:
    """Rank ``rank``'s slice of the model, weights loaded from the full checkpoint."""
    from kvledger.loader.safetensors import load_safetensors_state_dict
    from kvledger.models.llama import LlamaForCausalLM

    with ps.building(rank, spec.group.world_size), torch.device("meta"):
        model = LlamaForCausalLM(spec.hf_config)
    model = model.to_empty(device=rank_device(spec.device_type, rank)).to(spec.dtype)
    model.load_hf_state_dict(load_safetensors_state_dict(Path(spec.model_dir), spec.dtype))
    return model.eval()


def build_cache(spec: CacheSpec, dtype: torch.dtype, device: torch.device) -> Any:
    from kvledger.layers.quantized_kv import make_kv_cache

    return make_kv_cache(spec.kv_cache_dtype, spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads,
                         spec.head_dim, dtype, device)


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor inside (lists, tuples, dicts, dataclasses) replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in fields(obj) if f.init})
    return obj


def _broadcast(message: Any) -> Any:
    """Rank 0's ``message`` on every rank (pickled over the gloo dispatch group)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ps.dispatch_group())
    return box[0]


def _worker(rank: int, spec: ShardSpec) -> None:
    """Rank ``rank``'s process: join, build the shard and the cache, then run steps until told to stop."""
    parent = os.getppid()

    def orphan_watch() -> None:  # rank 0 gone: nothing will ever be asked of this rank again
        while os.getppid() == parent:
            time.sleep(WATCHDOG_PERIOD_S)
        os._exit(3)

    threading.Thread(target=orphan_watch, daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    device = rank_device(spec.device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(spec.group.host, spec.group.port, spec.group.world_size, is_master=False,
                          timeout=_seconds(ps.STARTUP_TIMEOUT_S))
    ps.init_group(spec.group, rank, store)
    model = build_shard(spec, rank)
    cache_spec: CacheSpec = _broadcast(None)
    # the pool's block count is the minimum over ranks: a CUDA rank with less free memory lowers it
    mine = cache_spec.num_blocks
    if device.type == "cuda":
        from kvledger.config import GPU_MEMORY_UTILIZATION

        per_block = _block_bytes(cache_spec, spec.dtype)
        mine = min(mine, int(torch.cuda.mem_get_info(device)[0] * GPU_MEMORY_UTILIZATION) // per_block)
    cache_spec = replace(cache_spec, num_blocks=ps.all_reduce_min(mine))
    cache = build_cache(cache_spec, spec.dtype, device)
    model.set_rope(cache_spec.max_model_len)
    ps.all_gather_ints(cache.measured_bytes)
    with torch.inference_mode():
        while True:
            message = _broadcast(None)
            if message is None:
                break
            input_ids, positions, meta, logits_indices = _map_tensors(message, lambda t: t.to(device))
            model(input_ids, positions, meta, cache, logits_indices)
    ps.destroy_group()


def _block_bytes(spec: CacheSpec, dtype: torch.dtype) -> int:
    probe = build_cache(replace(spec, num_blocks=1), dtype, torch.device("meta"))
    return max(1, probe.measured_bytes)


def _seconds(s: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=s)


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start processes that run only kvledger's code: spawn re-runs the starting script's top
    level in every child unless that script guards it with ``if __name__ == "__main__"``; with
    the main module's file and spec hidden while the children start, it is not re-run at all."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class _BroadcastingModel:
    """Rank 0's model as the :class:`ModelRunner` calls it: the inputs go to every rank first."""

    def __init__(self, executor: "TPExecutor") -> None:
        self.executor = executor

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, cache: Any,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        inputs = (input_ids, positions, meta, logits_indices)
        if self.executor.device.type != "cpu":
            inputs = _map_tensors(inputs, lambda t: t.cpu())
        _broadcast(inputs)
        return self.executor.model(input_ids, positions, meta, cache, logits_indices)


class TPExecutor:
    """Starts ``size`` ranks for a checkpoint and runs steps on all of them; ``execute`` is
    :meth:`ModelRunner.execute`'s (the engine calls it in the runner's place).

    Built in two stages, as the engine sizes the pool between them: ``TPExecutor(...)`` spawns
    the ranks and loads rank 0's shard (:attr:`model`); :meth:`start_cache` agrees the block
    count with the ranks, allocates every rank's cache and returns rank 0's.
    """

    def __init__(self, size: int, model_dir: str | Path, hf_config: dict[str, Any], dtype: torch.dtype,
                 device: torch.device) -> None:
        if dist.is_initialized():
            raise KVLedgerError("this process already runs a tensor-parallel engine; shut it down "
                                "(LLMEngine.shutdown()) before starting another")
        self.size = size
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise KVLedgerError(f"--tensor-parallel-size {size} needs {size} CUDA devices, "
                                f"{torch.cuda.device_count()} are visible; lower it or use --device cpu")
        self.failure: str | None = None
        self.closed = False
        self.runner: Any = None
        self.rank_measured_bytes: list[int] = []
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=_seconds(ps.STARTUP_TIMEOUT_S),
                              wait_for_workers=False)
        group = ps.GroupInfo("127.0.0.1", store.port, size, backend)
        threads = max(1, torch.get_num_threads() // size)
        self.spec = ShardSpec(str(model_dir), hf_config, dtype, device.type, group, threads)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker, args=(r, self.spec), daemon=True, name=f"kvledger-tp-rank{r}")
                      for r in range(1, size)]
        with _main_module_hidden():
            for p in self.procs:
                p.start()
        atexit.register(self.shutdown)
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="kvledger-tp-watchdog")
        self._watchdog.start()
        try:
            ps.init_group(group, 0, store, alive=self._raise_if_failed)
            self.model = build_shard(self.spec, 0)
        except BaseException as err:
            self._fail_from(err, "starting")
        self._store = store

    # ---- start-up -----------------------------------------------------------------------------
    def start_cache(self, spec: CacheSpec) -> Any:
        """Agree the block count (minimum over ranks), allocate each rank's cache; rank 0's cache."""
        from kvledger.engine.model_runner import ModelRunner

        try:
            _broadcast(spec)
            spec = replace(spec, num_blocks=ps.all_reduce_min(spec.num_blocks))
            cache = build_cache(spec, self.spec.dtype, self.device)
            self.model.set_rope(spec.max_model_len)
            self.rank_measured_bytes = ps.all_gather_ints(cache.measured_bytes)
        except BaseException as err:
            self._fail_from(err, "allocating the KV caches")
        self.cache_spec = spec
        self.runner = ModelRunner(_BroadcastingModel(self), cache, self.device)  # type: ignore[arg-type]
        return cache

    # ---- steps --------------------------------------------------------------------------------
    @property
    def last_logits(self) -> torch.Tensor | None:
        return self.runner.last_logits

    def execute(self, out: Any, block_tables: dict[str, list[int]]) -> tuple[list[Any], torch.Tensor]:
        """One step on every rank; rank 0's sampling rows and logits (see :meth:`ModelRunner.execute`)."""
        if self.failure is not None or self.closed:
            raise RankFailure(self.failure or "the tensor-parallel engine was shut down")
        try:
            return self.runner.execute(out, block_tables)
        except BaseException as err:
            if isinstance(err, (RuntimeError, OSError)) or self.failure is not None:
                self._fail_from(err, "running a step")
            raise

    # ---- failure and shutdown -----------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)

    def _watch(self) -> None:
        while not self.closed and self.failure is None:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    self.failure = (f"tensor-parallel rank {rank} of {self.size} (pid {p.pid}) exited with code "
                                    f"{p.exitcode}; the engine stopped. Restart it.")
                    return
            time.sleep(WATCHDOG_PERIOD_S)

    def _fail_from(self, err: BaseException, stage: str) -> None:
        """Raise one RankFailure for ``err``: the watchdog's account of a dead rank if it has one
        (given a moment to notice), else the collective's own error; the other ranks are stopped."""
        deadline = time.monotonic() + 2 * WATCHDOG_PERIOD_S + 0.5
        while self.failure is None and time.monotonic() < deadline and self._watchdog.is_alive():
            time.sleep(0.05)
        if self.failure is None:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            self.failure = (f"tensor-parallel ranks failed while {stage} ({type(err).__name__}: {first}); "
                            f"the engine stopped. Restart it.")
        self._stop_ranks()
        raise RankFailure(self.failure) from err

    def _stop_ranks(self) -> None:
        self.closed = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        ps.destroy_group()

    def shutdown(self) -> None:
        """Stop every rank (idempotent): a clean stop message, then a kill for any that linger."""
        if self.closed:
            return
        self.closed = True  # the watchdog stops before the ranks exit
        if self.failure is None:
            try:
                _broadcast(None)
            except Exception:  # noqa: BLE001 - a rank already gone; it is killed below
                pass
            for p in self.procs:
                p.join(5)
        self._stop_ranks()
