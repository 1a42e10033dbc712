"""Engine speed on this machine (float32, 2 threads), kvledger beside transformers in the same run.

Three measurements, each printed with the ceilings measured here (float32 matmul FLOP/s,
memory read and copy bandwidth):

1. Throughput: 64 requests drawn with a fixed seed from the Azure 2023 conversation trace,
   prompt and output lengths divided by 4, random token ids, greedy, ignore_eos. kvledger
   (``LLM.generate``) versus transformers ``generate`` in padded batches of 16 and
   transformers' continuous batching (``generate_batch``'s manager, each request with its
   own ``max_new_tokens``). Useful tokens: each request's own output length. Also the share
   of the FLOP ceiling: FLOPs the workload needs (matmuls and attention) over the measured
   matmul rate, divided by kvledger's wall time. Targets: >= 2x the better peer, >= 50%.
2. Batch-1 decode step at a 512-token context versus its memory floor: bytes of weights and
   KV read per step over the measured read bandwidth. Target <= 1.5x. Peer: transformers.
3. Prefix caching: a 2,048-token shared prefix, then 16 requests with distinct 32-token
   suffixes, one after another; time to first token of the later ones over the first's.
   Target <= 15%.

    .venv/bin/python bench/bench_engine.py [--requests 64] [--skip-peers] [--trace FILE]
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")  # as the engine sets it; see kvledger/engine/__init__.py

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import DEFAULT_TRACE, bandwidth, matmul_flops  # noqa: E402

THREADS = 2


# ---- workload ---------------------------------------------------------------------------------
def draw_workload(trace: Path, n: int, vocab: int, max_len: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs: trace rows drawn with ``seed``, lengths / 4."""
    with open(trace, newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    out = []
    for context, generated in rng.sample(rows, n):
        p, o = max(1, context // 4), max(1, generated // 4)
        p = min(p, max_len - o)
        out.append(([rng.randrange(vocab) for _ in range(p)], o))
    return out


def flops_needed(config: dict, workload: list[tuple[list[int], int]]) -> float:
    """Matmul + attention FLOPs the workload needs: each token through every layer once, logits only when sampled."""
    d, L = config["hidden_size"], config["num_hidden_layers"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // h
    per_layer = d * (h * hd + 2 * kv * hd) + h * hd * d + 3 * d * config["intermediate_size"]
    total = 0.0
    for prompt, out in workload:
        tokens = len(prompt) + out - 1  # the last sampled token is never fed back
        total += 2 * per_layer * L * tokens
        total += 2 * config["vocab_size"] * d * out
        total += 4 * L * h * hd * tokens * (tokens + 1) / 2  # QK^T and PV over the causal context
    return total


def run_kvledger(llm, workload) -> float:
    from kvledger import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in workload]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(x.outputs[0].token_ids) for x in outs] == [o for _, o in workload]
    return elapsed


def run_hf_padded(model, workload, batch: int = 16) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(workload), batch):
            chunk = workload[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            new = max(o for _, o in chunk)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def run_hf_continuous(model, workload) -> float:
    from transformers.generation.continuous_batching import continuous_api

    WorkloadHints = continuous_api.WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in workload),
                          max_generated_length=max(o for _, o in workload), num_requests=len(workload))
    start = time.perf_counter()
    with model.continuous_batching_context_manager(block=True, timeout=5, workload_hints=hints) as manager:
        for i, (prompt, out) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out)
        done = 0
        while done < len(workload):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                done += 1
                assert len(result.generated_tokens) == workload[int(result.request_id[1:])][1], result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped early")
    return time.perf_counter() - start


# ---- decode at 512 ------------------------------------------------------------------------------
def kvledger_decode_step(llm, context: int = 512, steps: int = 32) -> float:
    from kvledger import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(1)
    engine.add_request("decode", [rng.randrange(1000, 40000) for _ in range(context)],
                       SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_decode_step(model, context: int = 512, steps: int = 32) -> float:
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(1000, 40000) for _ in range(context)]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        def timed(n: int) -> float:
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - start
        one = min(timed(1) for _ in range(2))
        many = timed(steps + 1)
    return (many - one) / steps


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every matrix once, the embedding only for one row."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    emb = model.embed_tokens.weight
    total += emb.shape[1] * emb.element_size()
    if model.tie_word_embeddings:  # the logits read the whole tied matrix
        total += emb.numel() * emb.element_size()
    return total


# ---- prefix caching ------------------------------------------------------------------------------
def prefix_ttft(llm, prefix_len: int = 2048, suffix_len: int = 32, later: int = 16) -> tuple[float, list[float]]:
    from kvledger import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(2)
    prefix = [rng.randrange(1000, 40000) for _ in range(prefix_len)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def ttft(request_id: str) -> float:
        engine.add_request(request_id, prefix + [rng.randrange(1000, 40000) for _ in range(suffix_len)], sp)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    first = ttft("prefix-0")
    return first, [ttft(f"prefix-{i + 1}") for i in range(later)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--skip-peers", action="store_true", help="measure kvledger only")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)

    flops = matmul_flops()
    read_bw, copy_bw = bandwidth()
    print(f"ceilings at start ({THREADS} threads, float32): matmul {flops / 1e9:.1f} GFLOP/s, read "
          f"{read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s", flush=True)

    from kvledger import LLM

    llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="2GiB")
    engine = llm.llm_engine
    config = engine.hf_config
    hf = None
    if not args.skip_peers:
        from transformers import AutoModelForCausalLM

        from kvledger.loader.resolve import smollm2_gguf_path

        path = smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # ignore_eos

    # 1. throughput
    if not args.skip_throughput:
        workload = draw_workload(args.trace, args.requests, config["vocab_size"], engine.max_model_len)
        useful = sum(o for _, o in workload)
        need = flops_needed(config, workload)
        print(f"\nworkload: {len(workload)} requests, {sum(len(p) for p, _ in workload)} prompt tokens, "
              f"{useful} output tokens, {need / 1e12:.2f} TFLOP needed", flush=True)
        run_kvledger(llm, workload[:4])  # warm-up
        t_kv = run_kvledger(llm, workload)
        ledger = llm.ledger()
        print(f"kvledger:                      {t_kv:7.2f} s  {useful / t_kv:7.1f} useful tok/s  "
              f"{need / t_kv / 1e9:.1f} GFLOP/s needed-work rate  (peak blocks {ledger.blocks_allocated_peak}, "
              f"preemptions {ledger.num_preemptions})", flush=True)
        peers = {}
        if hf is not None:
            peers["transformers generate (batches of 16, padded)"] = run_hf_padded(hf, workload)
            print(f"transformers generate, padded: {peers['transformers generate (batches of 16, padded)']:7.2f} s  "
                  f"{useful / peers['transformers generate (batches of 16, padded)']:7.1f} useful tok/s", flush=True)
            try:
                peers["transformers continuous batching"] = run_hf_continuous(hf, workload)
                print(f"transformers continuous:       {peers['transformers continuous batching']:7.2f} s  "
                      f"{useful / peers['transformers continuous batching']:7.1f} useful tok/s", flush=True)
            except Exception as err:  # noqa: BLE001 - report, keep the other figures
                print(f"transformers continuous batching failed: {err}", flush=True)
            best = min(peers.values())
            print(f"throughput ratio vs the better peer: {best / t_kv:.2f}x (target >= 2x)", flush=True)

    # 2. decode at 512
    step = kvledger_decode_step(llm)
    hf_step = hf_decode_step(hf) if hf is not None else None
    kv_bytes = 512 * engine.bytes_per_token
    w_bytes = weight_bytes_per_step(engine.model)
    print(f"\nbatch-1 decode at 512 tokens: kvledger {step * 1e3:.1f} ms/step"
          + (f", transformers {hf_step * 1e3:.1f} ms/step" if hf_step else ""), flush=True)

    # 3. prefix caching
    first, later = prefix_ttft(llm)
    print(f"\nprefix caching, 2,048-token shared prefix: first TTFT {first * 1e3:.0f} ms; later 16: median "
          f"{statistics.median(later) * 1e3:.0f} ms, max {max(later) * 1e3:.0f} ms = "
          f"{max(later) / first:.1%} of the first (target <= 15%)", flush=True)

    # ceilings again: the best of both measurements is the machine's (shared cores make one noisy)
    flops2 = matmul_flops()
    read2, copy2 = bandwidth()
    flops, read_bw, copy_bw = max(flops, flops2), max(read_bw, read2), max(copy_bw, copy2)
    print(f"\nceilings at end: matmul {flops2 / 1e9:.1f} GFLOP/s, read {read2 / 1e9:.1f} GB/s, copy {copy2 / 1e9:.1f} GB/s;"
          f" best: matmul {flops / 1e9:.1f} GFLOP/s, read {read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s")
    if not args.skip_throughput:
        print(f"throughput: kvledger runs at {need / flops / t_kv:.0%} of the FLOP ceiling (target >= 50%)")
    floor = (w_bytes + kv_bytes) / read_bw
    print(f"decode floor {floor * 1e3:.1f} ms ({(w_bytes + kv_bytes) / 1e6:.0f} MB read per step: weights "
          f"{w_bytes / 1e6:.0f} MB + KV {kv_bytes / 1e6:.1f} MB, at {read_bw / 1e9:.1f} GB/s): kvledger "
          f"{step / floor:.2f}x the floor (target <= 1.5x)" + (f", transformers {hf_step / floor:.2f}x" if hf_step else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
