"""Load client for ``kvledger bench serve``: replay a request trace against an OpenAI-compatible server.

Workload: rows of a trace (Azure LLM inference CSV, Mooncake JSONL, or a generic CSV/JSONL
with input/output lengths), lengths scaled by ``length_scale``, prompts of random token ids
(Mooncake's ``hash_ids`` become shared token blocks, so its prefix reuse is replayed), sent
as token ids or, for servers that take only text, decoded to text with a tokenizer;
``max_tokens`` = the trace's output length (all of it with ``ignore_eos``), greedy, streamed. Arrivals
follow a Poisson process at ``request_rate`` (seeded; gamma intervals with ``burstiness`` != 1),
all at once for ``inf``, or the trace's own timestamps.

The requests and their send times come from ``kvledger.workload.sampling`` (the simulator
draws the same ones), and the metrics have the definitions of vLLM's ``vllm bench serve``
(``kvledger.metrics.serving``), so numbers compare directly. An output chunk is a streamed chunk
with choices. Token counts are the server's ``usage`` when it streams one, else the tokenizer's
count of the text (vLLM's fallback), else one token per chunk.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.errors import KVLedgerError
from kvledger.metrics.serving import RequestResult, ServingMetrics, calculate_metrics
from kvledger.progress import progress_bar
from kvledger.workload.sampling import SampledRequest, sample_requests
from kvledger.workload.traces import MOONCAKE_BLOCK_TOKENS, read_trace


# --- prompts -------------------------------------------------------------------------------------

def make_prompts(requests: list[SampledRequest], *, seed: int, vocab_size: int, token_id_low: int,
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


# --- one request ---------------------------------------------------------------------------------

async def send_request(client: Any, url: str, model: str, prompt: list[int] | str, prompt_len: int,
                       max_tokens: int, headers: dict[str, str], extra_body: dict[str, Any]) -> RequestResult:
    """One streamed completion, timed as vLLM's benchmark client times it."""
    result = RequestResult(prompt_len, max_tokens)
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, **extra_body}
    st = result.start_time = time.perf_counter()
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
    id_seed: int | None = None
    """Seed of the prompts' token ids (None: ``seed``). Another value keeps the requests (rows,
    lengths, arrival times) and draws fresh ids, so that nothing of an earlier run is in a server's
    prefix cache when the same workload is sent again."""
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


@functools.cache
def load_tokenizer(name: str) -> Any:
    """A transformers tokenizer (a directory or a name), loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


async def served_models(client: Any, base_url: str, headers: dict[str, str]) -> list[str]:
    """The model ids ``GET /v1/models`` lists (a one-line error when the server cannot say)."""
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
    return [str(m.get("id")) for m in data]


async def send_workload(cfg: BenchConfig, progress: bool = False) -> tuple[list[RequestResult], float, dict[str, Any]]:
    """Replay the workload: what the client saw of each request (in the workload's order), the
    run's seconds, and a description of the run. ``progress``: a bar on stderr over the requests
    finished, shown once the run lasts a while."""
    import httpx

    trace = read_trace(cfg.trace)
    requests, times = sample_requests(trace, cfg.num_prompts, seed=cfg.seed, sample=cfg.sample,
                                      length_scale=cfg.length_scale, request_rate=cfg.request_rate,
                                      burstiness=cfg.burstiness, time_scale=cfg.time_scale,
                                      max_model_len=cfg.max_model_len)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    vocab = min(cfg.vocab_size, len(tokenizer)) if tokenizer is not None else cfg.vocab_size
    id_seed = cfg.seed if cfg.id_seed is None else cfg.id_seed
    prompts: list[Any] = make_prompts(requests, seed=id_seed, vocab_size=vocab, token_id_low=cfg.token_id_low,
                                      length_scale=cfg.length_scale)
    prompt_lens = [len(p) for p in prompts]
    if cfg.prompt_format == "text":
        if tokenizer is None:
            raise KVLedgerError("text prompts need --tokenizer to turn the random token ids into text")
        prompts = [tokenizer.decode(p) for p in prompts]
        prompt_lens = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    extra_body = {"ignore_eos": True} if cfg.ignore_eos else {}
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    base = cfg.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 10_000, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        served = await served_models(client, base, headers)
        model = cfg.model or served[0]
        if model not in served:  # before sending a single request
            raise KVLedgerError(f"{base} does not serve {model!r}; it serves {', '.join(served)}: give one of them to --model")
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = progress_bar(len(requests), "bench serve", "req", enabled=progress)

        async def one(i: int, start: float) -> RequestResult:
            delay = start + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            args = (client, base + cfg.endpoint, model, prompts[i], prompt_lens[i], requests[i].output_len,
                    headers, extra_body)
            if sem is None:
                result = await send_request(*args)
            else:
                async with sem:
                    result = await send_request(*args)
            bar.update(1)
            return result

        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(*(one(i, t0) for i in range(len(requests))))
        finally:
            bar.close()
        duration = time.perf_counter() - t0
    info = {"model": model, "trace": Path(cfg.trace).name, "format": trace.format, "num_prompts": len(requests),
            "length_scale": cfg.length_scale, "request_rate": cfg.request_rate, "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency, "seed": cfg.seed, "id_seed": id_seed, "ignore_eos": cfg.ignore_eos,
            "prompt_format": cfg.prompt_format,
            "mean_input_len": float(np.mean([r.input_len for r in requests])),
            "mean_output_len": float(np.mean([r.output_len for r in requests])),
            "expected_output_tokens": sum(r.output_len for r in requests)}
    return list(results), duration, info


async def run_benchmark(cfg: BenchConfig, progress: bool = False) -> tuple[ServingMetrics, dict[str, Any]]:
    """Replay the workload (:func:`send_workload`); returns the metrics and a description of the run."""
    results, duration, info = await send_workload(cfg, progress)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    return calculate_metrics(results, duration, list(cfg.percentiles), tokenizer), info


# --- reports ---------------------------------------------------------------------------------------

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def summary_rows(m: ServingMetrics) -> list[tuple[str, str]]:
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


def latency_rows(m: ServingMetrics) -> tuple[list[str], list[list[str]]]:
    keys = list(next(iter(m.stats_ms.values())).keys())
    head = ["metric (ms)"] + keys
    rows = [[_NAMES[name]] + [f"{stats[k]:.2f}" for k in keys] for name, stats in m.stats_ms.items()]
    return head, rows


def format_report(m: ServingMetrics, info: dict[str, Any], tablefmt: str = "simple") -> str:
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
