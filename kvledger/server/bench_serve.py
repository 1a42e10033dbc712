"""Load client for ``kvledger bench serve``: replay a request trace against an OpenAI-compatible server.

Workload: rows of a trace (Azure LLM inference CSV, Mooncake JSONL, or a generic CSV/JSONL
with input/output lengths), lengths scaled by ``length_scale``, prompts of random token ids
(Mooncake's ``hash_ids`` become shared token blocks, so its prefix reuse is replayed), sent
as token ids or, for servers that take only text, decoded to text with a tokenizer;
``max_tokens`` = the trace's output length (all of it with ``ignore_eos``), greedy, streamed. Arrivals
follow a Poisson process at ``request_rate`` (seeded; gamma intervals with ``burstiness`` != 1),
all at once for ``inf``, or the trace's own timestamps.

Metrics have the definitions of vLLM's ``vllm bench serve``, so numbers compare directly:

- TTFT: request sent -> first streamed chunk with choices (per request).
- ITL: the gaps between successive chunks of a request, all requests pooled.
- TPOT: per request ``(E2EL - TTFT) / (output_tokens - 1)``, requests with more than one token.
- E2EL: request sent -> last chunk with choices.
- Throughput: completed requests, output tokens and input + output tokens, each over the
  benchmark's wall time. Token counts are the server's ``usage`` when it streams one, else
  the tokenizer's count of the text (vLLM's fallback), else one token per chunk.

Means, medians, standard deviations and percentiles (``numpy.percentile``) in milliseconds.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from kvledger.errors import KVLedgerError

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
INPUT_KEYS = ("input_len", "input_length", "prompt_len", "prompt_tokens", "ContextTokens", "context_tokens")
OUTPUT_KEYS = ("output_len", "output_length", "completion_tokens", "GeneratedTokens", "generated_tokens")
TIME_KEYS = ("timestamp", "TIMESTAMP", "arrival", "arrival_time")


@dataclass
class TraceRequest:
    """One trace row: lengths in tokens, arrival in seconds from the trace's start (None if absent)."""

    input_len: int
    output_len: int
    arrival_s: float | None = None
    hash_ids: list[int] | None = None


# --- traces ----------------------------------------------------------------------------------

def _pick(row: dict[str, Any], keys: tuple[str, ...], what: str, path: Path) -> Any:
    for key in keys:
        if key in row and row[key] not in (None, ""):
            return row[key]
    raise KVLedgerError(f"{path}: a row has no {what} column (looked for {', '.join(keys)})")


def _time_seconds(value: Any, fmt: str) -> float:
    if fmt == "mooncake":
        return float(value) / 1000.0  # integer milliseconds
    try:
        return float(value)
    except (TypeError, ValueError):
        return datetime.fromisoformat(str(value)[:26]).timestamp()  # Azure: '2023-11-16 18:15:46.6805900'


def detect_format(path: Path, first: dict[str, Any]) -> str:
    if "ContextTokens" in first and "GeneratedTokens" in first:
        return "azure"
    if "input_length" in first and "output_length" in first and "hash_ids" in first:
        return "mooncake"
    return "generic"


def _rows(path: Path) -> Iterable[dict[str, Any]]:
    if path.suffix in (".jsonl", ".json"):
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as err:
                        raise KVLedgerError(f"{path}:{n}: not a JSON object per line ({err})") from None
    else:
        with path.open(newline="") as f:
            yield from csv.DictReader(f)


def load_trace(path: str | Path) -> tuple[str, list[TraceRequest]]:
    """Read a trace file; returns its detected format and its rows in file order."""
    path = Path(path)
    if not path.is_file():
        raise KVLedgerError(f"trace file {path} not found")
    rows = iter(_rows(path))
    first = next(rows, None)
    if first is None:
        raise KVLedgerError(f"trace file {path} is empty")
    fmt = detect_format(path, first)
    out: list[TraceRequest] = []
    t0: float | None = None
    for row in [first, *rows]:
        try:
            inp = int(_pick(row, INPUT_KEYS, "input length", path))
            outp = int(_pick(row, OUTPUT_KEYS, "output length", path))
        except (TypeError, ValueError):
            raise KVLedgerError(f"{path}: a length is not an integer in row {row}") from None
        t = next((row[k] for k in TIME_KEYS if row.get(k) not in (None, "")), None)
        arrival = None
        if t is not None:
            ts = _time_seconds(t, fmt)
            t0 = ts if t0 is None else t0
            arrival = ts - t0
        out.append(TraceRequest(inp, outp, arrival, row.get("hash_ids") if fmt == "mooncake" else None))
    return fmt, out


def select(trace: list[TraceRequest], num_prompts: int, *, seed: int, sample: str, length_scale: float,
           max_model_len: int | None = None) -> list[TraceRequest]:
    """``num_prompts`` rows (random with ``seed``, or the first), lengths scaled (at least 1 token).

    With ``max_model_len``, prompts are cut so that prompt + output fits (outputs are kept).
    """
    if num_prompts < 1:
        raise KVLedgerError(f"--num-prompts must be at least 1, got {num_prompts}")
    if sample == "random":
        rng = np.random.default_rng(seed)
        idx = sorted(rng.choice(len(trace), size=min(num_prompts, len(trace)), replace=False).tolist())
    else:
        idx = list(range(min(num_prompts, len(trace))))
    chosen = []
    for i in idx:
        r = trace[i]
        inp = max(1, math.ceil(r.input_len * length_scale))
        outp = max(1, math.ceil(r.output_len * length_scale))
        if max_model_len is not None:
            if outp >= max_model_len:
                outp = max_model_len - 1
            inp = min(inp, max_model_len - outp)
        chosen.append(TraceRequest(inp, outp, r.arrival_s, r.hash_ids))
    return chosen


def make_prompts(requests: list[TraceRequest], *, seed: int, vocab_size: int, token_id_low: int,
                 length_scale: float) -> list[list[int]]:
    """Random token ids per request; Mooncake hash ids map to fixed blocks so equal ids share prefixes."""
    rng = np.random.default_rng(seed)
    block_len = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    blocks: dict[int, list[int]] = {}
    prompts = []
    for r in requests:
        if r.hash_ids:
            ids: list[int] = []
            for h in r.hash_ids:
                if h not in blocks:
                    blocks[h] = np.random.default_rng((seed, h)).integers(token_id_low, vocab_size, block_len).tolist()
                ids.extend(blocks[h])
                if len(ids) >= r.input_len:
                    break
            if len(ids) < r.input_len:
                ids.extend(rng.integers(token_id_low, vocab_size, r.input_len - len(ids)).tolist())
            prompts.append(ids[:r.input_len])
        else:
            prompts.append(rng.integers(token_id_low, vocab_size, r.input_len).tolist())
    return prompts


def arrival_times(n: int, request_rate: float | str, *, seed: int, burstiness: float = 1.0,
                  trace: list[TraceRequest] | None = None, time_scale: float = 1.0) -> list[float]:
    """Send times in seconds from the start.

    ``inf``: all at 0. A rate: gamma-distributed gaps with mean ``1/rate`` (Poisson for
    burstiness 1), rescaled so the last request goes out at ``n / rate`` as vLLM does.
    ``"trace"``: the trace's own timestamps divided by ``time_scale``.
    """
    if request_rate == "trace":
        if not trace or any(r.arrival_s is None for r in trace):
            raise KVLedgerError("--request-rate trace needs a trace with timestamps")
        start = min(r.arrival_s for r in trace)  # type: ignore[type-var]
        return [(r.arrival_s - start) / time_scale for r in trace]  # type: ignore[operator]
    rate = float(request_rate)
    if rate <= 0:
        raise KVLedgerError(f"--request-rate must be positive or inf, got {request_rate}")
    if math.isinf(rate):
        return [0.0] * n
    if burstiness <= 0:
        raise KVLedgerError(f"--burstiness must be positive, got {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    return times.tolist()


# --- one request ---------------------------------------------------------------------------------

@dataclass
class RequestResult:
    """What the client saw for one request; times in seconds."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    start_time: float = 0.0


async def send_request(client: Any, url: str, model: str, prompt: list[int] | str, prompt_len: int,
                       max_tokens: int, headers: dict[str, str], extra_body: dict[str, Any]) -> RequestResult:
    """One streamed completion, timed as vLLM's benchmark client times it."""
    result = RequestResult(prompt_len, max_tokens)
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, **extra_body}
    st = time.perf_counter()
    result.start_time = time.time()
    last = st
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += chunk["choices"][0].get("text") or ""
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    result.prompt_len = int(chunk["usage"].get("prompt_tokens") or result.prompt_len)
        result.latency = last - st
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "the stream ended without any output"
    except Exception as err:  # network errors count as failed requests, as in vLLM
        result.error = f"{type(err).__name__}: {err}"
    return result


# --- metrics -------------------------------------------------------------------------------------

@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    stats_ms: dict[str, dict[str, float]]  # metric -> {"mean", "median", "std", "p50", ...}
    errors: list[str] = field(default_factory=list)


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    arr = np.asarray(values or [0.0]) * 1000.0
    out = {"mean": float(np.mean(arr)), "median": float(np.median(arr)), "std": float(np.std(arr))}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      percentiles: list[float] = (50, 90, 99), tokenizer: Any = None) -> BenchmarkMetrics:
    """vLLM's ``calculate_metrics``: per-request TTFT, TPOT and E2EL; ITL pooled over all requests."""
    ttfts, tpots, itls, e2els = [], [], [], []
    total_input = total_output = completed = 0
    for r in results:
        if not r.success:
            continue
        n_out = r.output_tokens
        if not n_out:  # no usage from the server: count the text's tokens, else one per chunk
            n_out = (len(tokenizer(r.generated_text, add_special_tokens=False).input_ids) if tokenizer is not None
                     else len(r.itl) + 1)
        completed += 1
        total_input += r.prompt_len
        total_output += n_out
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        if n_out > 1:
            tpots.append((r.latency - r.ttft) / (n_out - 1))
    pct = list(percentiles)
    return BenchmarkMetrics(
        completed=completed, failed=len(results) - completed, duration_s=duration_s,
        total_input=total_input, total_output=total_output,
        request_throughput=completed / duration_s, output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats_ms={"ttft": _stats(ttfts, pct), "tpot": _stats(tpots, pct), "itl": _stats(itls, pct),
                  "e2el": _stats(e2els, pct)},
        errors=[r.error for r in results if not r.success],
    )


# --- the run -------------------------------------------------------------------------------------

@dataclass
class BenchConfig:
    base_url: str
    trace: str
    model: str | None = None
    endpoint: str = "/v1/completions"
    num_prompts: int = 64
    length_scale: float = 1.0
    request_rate: float | str = float("inf")
    burstiness: float = 1.0
    time_scale: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    sample: str = "random"
    vocab_size: int = 32000
    token_id_low: int = 256
    max_model_len: int | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    prompt_format: str = "ids"  # "ids" (token ids) or "text" (decoded with ``tokenizer``)
    tokenizer: str | None = None  # a tokenizer directory or name (transformers), for text prompts
    percentiles: tuple[float, ...] = (50, 90, 99)
    timeout_s: float = 600.0


async def first_model(client: Any, base_url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        resp = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.HTTPError as err:
        raise KVLedgerError(f"cannot reach {base_url} ({type(err).__name__}: {err}); is the server running?") from None
    if resp.status_code != 200:
        raise KVLedgerError(f"GET {base_url}/v1/models answered {resp.status_code}; give --model")
    data = resp.json().get("data") or []
    if not data:
        raise KVLedgerError(f"{base_url}/v1/models lists no model; give --model")
    return data[0]["id"]


async def run_benchmark(cfg: BenchConfig) -> tuple[BenchmarkMetrics, dict[str, Any]]:
    """Replay the workload; returns the metrics and a description of the run."""
    import httpx

    fmt, trace = load_trace(cfg.trace)
    requests = select(trace, cfg.num_prompts, seed=cfg.seed, sample=cfg.sample, length_scale=cfg.length_scale,
                      max_model_len=cfg.max_model_len)
    tokenizer = None
    if cfg.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    vocab = min(cfg.vocab_size, len(tokenizer)) if tokenizer is not None else cfg.vocab_size
    prompts: list[Any] = make_prompts(requests, seed=cfg.seed, vocab_size=vocab, token_id_low=cfg.token_id_low,
                                      length_scale=cfg.length_scale)
    prompt_lens = [len(p) for p in prompts]
    if cfg.prompt_format == "text":
        if tokenizer is None:
            raise KVLedgerError("text prompts need --tokenizer to turn the random token ids into text")
        prompts = [tokenizer.decode(p) for p in prompts]
        prompt_lens = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    extra_body = {"ignore_eos": True} if cfg.ignore_eos else {}
    times = arrival_times(len(requests), cfg.request_rate, seed=cfg.seed, burstiness=cfg.burstiness,
                          trace=requests, time_scale=cfg.time_scale)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    base = cfg.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 10_000, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        model = cfg.model or await first_model(client, base, headers)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def one(i: int, start: float) -> RequestResult:
            delay = start + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            args = (client, base + cfg.endpoint, model, prompts[i], prompt_lens[i], requests[i].output_len,
                    headers, extra_body)
            if sem is None:
                return await send_request(*args)
            async with sem:
                return await send_request(*args)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, t0) for i in range(len(requests))))
        duration = time.perf_counter() - t0
    metrics = calculate_metrics(list(results), duration, list(cfg.percentiles), tokenizer)
    info = {"model": model, "trace": Path(cfg.trace).name, "format": fmt, "num_prompts": len(requests),
            "length_scale": cfg.length_scale, "request_rate": cfg.request_rate, "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency, "seed": cfg.seed, "ignore_eos": cfg.ignore_eos,
            "prompt_format": cfg.prompt_format,
            "mean_input_len": float(np.mean([r.input_len for r in requests])),
            "mean_output_len": float(np.mean([r.output_len for r in requests])),
            "expected_output_tokens": sum(r.output_len for r in requests)}
    return metrics, info


# --- reports ---------------------------------------------------------------------------------------

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def summary_rows(m: BenchmarkMetrics) -> list[tuple[str, str]]:
    return [
        ("Successful requests", f"{m.completed}"),
        ("Failed requests", f"{m.failed}"),
        ("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", f"{m.total_input}"),
        ("Total generated tokens", f"{m.total_output}"),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]


def latency_rows(m: BenchmarkMetrics) -> tuple[list[str], list[list[str]]]:
    keys = list(next(iter(m.stats_ms.values())).keys())
    head = ["metric (ms)"] + keys
    rows = [[_NAMES[name]] + [f"{stats[k]:.2f}" for k in keys] for name, stats in m.stats_ms.items()]
    return head, rows


def format_report(m: BenchmarkMetrics, info: dict[str, Any], tablefmt: str = "simple") -> str:
    from tabulate import tabulate

    rate = info["request_rate"]
    lines = [f"{info['num_prompts']} requests from {info['trace']} ({info['format']}), lengths x{info['length_scale']:g} "
             f"(mean input {info['mean_input_len']:.1f}, output {info['mean_output_len']:.1f} tokens), "
             f"request rate {rate}, max concurrency {info['max_concurrency'] or 'unlimited'}, seed {info['seed']}, "
             f"{info['prompt_format']} prompts, ignore_eos {info['ignore_eos']}, greedy, model {info['model']}", ""]
    lines.append(tabulate(summary_rows(m), headers=["", "value"], tablefmt=tablefmt, disable_numparse=True))
    lines.append("")
    head, rows = latency_rows(m)
    lines.append(tabulate(rows, headers=head, tablefmt=tablefmt, disable_numparse=True))
    if m.errors:
        lines += ["", f"{len(m.errors)} failed; first: {m.errors[0]}"]
    return "\n".join(lines)
