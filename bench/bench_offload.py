"""The second KV tier (``--kv-offloading-size``) on this machine: SmolLM2 in float32, 2 threads.

Two measurements, printed with the ceilings measured here (float32 matmul FLOP/s, memory read
and copy bandwidth):

1. A 2,048-token prompt (random token ids) whose blocks the pool has evicted into tier 2, against
   the same prompt cold: time to first token, median of ``--repeats`` prompts, each one cold,
   then evicted by another 2,048-token prompt, then asked again. The pool holds exactly one such
   request (17 blocks of 128 tokens), so the filler evicts every block of the first. Host tier
   (memory) and disk tier (files; before each warm request the block files are flushed and
   dropped from the page cache with ``posix_fadvise(DONTNEED)``, so they are read from the disk).
   The warm and cold requests' greedy tokens must be the same. Targets: host >= 5x, disk >= 2x.
2. A multi-turn chat replay through the OpenAI server (in process, real sockets, streamed): four
   conversations with distinct ~700-token system prompts, three turns each, round robin, one
   request at a time, into a pool that holds fewer than two of them; TTFT p50 (client side) and
   the prefix hit rate of both tiers, without and with a 1 GiB host tier; the replies must be
   the same. Target: TTFT p50 at least 2x lower with the tier.

    .venv/bin/python bench/bench_offload.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")  # as the engine sets it; see kvledger/engine/__init__.py

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import print_ceilings  # noqa: E402

THREADS = 2
MODEL = "smollm2-135m"
BLOCK = 128  # the engine's CPU block
PROMPT = 2048
TIER_GIB = 1.0


# ---- 1. one long prompt: cold, and loaded back from tier 2 -------------------------------------
def drop_page_cache(directory: Path) -> None:
    """Write the block files to the disk and drop them from the page cache (no root needed)."""
    for f in directory.glob("*.kv"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ttft_cold_and_warm(path: str | None, repeats: int) -> tuple[list[float], list[float], bool, dict]:
    """(cold TTFTs, warm TTFTs, every warm run's tokens equal its cold run's, the tier's ledger)."""
    from kvledger import LLM, SamplingParams

    llm = LLM(model=MODEL, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=17,
              max_model_len=17 * BLOCK, kv_offloading_size=TIER_GIB, kv_offloading_path=path)
    engine = llm.llm_engine
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    cold, warm, same = [], [], True

    def run(ids: list[int]):
        out = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0]
        return out.first_token_time - out.arrival_time, list(out.outputs[0].token_ids), out.num_cached_tokens

    run([rng.randrange(1000, 40000) for _ in range(PROMPT)])  # warm-up: first-call costs out of the numbers
    for _ in range(repeats):
        prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT)]
        t_cold, tokens_cold, _ = run(prompt)
        run([rng.randrange(1000, 40000) for _ in range(PROMPT)])  # evicts every block of the prompt
        if path is not None:
            drop_page_cache(Path(path))
        t_warm, tokens_warm, cached = run(prompt)
        assert cached == (PROMPT - 1) // BLOCK * BLOCK, cached  # all of it from tier 2 (the pool kept none)
        cold.append(t_cold)
        warm.append(t_warm)
        same = same and tokens_warm == tokens_cold
    offload = engine.ledger().offload
    engine.check_integrity()
    return cold, warm, same, {"hits": offload.hits, "block_bytes": offload.block_bytes}


# ---- 2. a multi-turn chat replay through the server ------------------------------------------------
WORDS = ("river mountain station ticket morning harbour lantern garden copper meadow winter orchard village "
         "signal compass library window engine market bridge thunder canyon violin pepper marble").split()
QUESTIONS = ["Where should we start?", "Can you give one more detail?", "Summarise that in a sentence."]


def system_prompt(i: int) -> str:
    """A distinct system prompt of some 700 tokens: conversation ``i``'s own."""
    rng = random.Random(100 + i)
    return f"You are assistant number {i}. Remember these notes. " + " ".join(rng.choice(WORDS) for _ in range(650))


def replay(tier_gib: float | None) -> tuple[list[float], list[str], dict]:
    """(TTFT per request in s, the replies, the ledger when idle) of the replay on a fresh server."""
    import httpx

    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.server.launcher import BackgroundServer, build_app

    engine = LLMEngine(EngineConfig(model=MODEL, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=12,
                                    max_model_len=12 * BLOCK, kv_offloading_size=tier_gib))
    server = BackgroundServer(build_app(engine)).start()
    history = [[{"role": "system", "content": system_prompt(i)}] for i in range(4)]
    ttfts, texts = [], []
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for turn in range(len(QUESTIONS)):
                for conversation in history:
                    conversation.append({"role": "user", "content": QUESTIONS[turn]})
                    body = {"model": MODEL, "messages": conversation, "max_tokens": 16, "temperature": 0,
                            "stream": True}
                    start, first, parts = time.perf_counter(), None, []
                    with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]" and '"content":"' in line:
                                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                                if delta and first is None:
                                    first = time.perf_counter() - start
                                parts.append(delta)
                    ttfts.append(first)
                    texts.append("".join(parts))
                    conversation.append({"role": "assistant", "content": texts[-1]})
            ledger = client.get("/ledger").json()
    finally:
        server.stop()
    return ttfts, texts, ledger


def hit_rate(ledger: dict) -> float:
    offload = ledger["offload"]["hits"] if ledger["offload"] else 0
    return (ledger["prefix_cache_hits"] + offload) / ledger["prefix_cache_queries"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    _, _, copy_bw = print_ceilings()
    print(f"\n1. a {PROMPT:,}-token prompt evicted from the pool, back from tier 2, against the same prompt cold "
          f"(median of {args.repeats})")
    print("| tier | cold TTFT (ms) | warm TTFT (ms) | ratio | target | same greedy tokens |")
    print("|---|---|---|---|---|---|")
    ok = True
    for name, target in (("host memory", 5.0), ("disk", 2.0)):
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVLEDGER_BENCH_DISK")) as tmp:
            cold, warm, same, tier = ttft_cold_and_warm(tmp if name == "disk" else None, args.repeats)
        c, w = statistics.median(cold), statistics.median(warm)
        ok = ok and c / w >= target and same
        print(f"| {name} | {c * 1e3:,.0f} | {w * 1e3:,.0f} | {c / w:.1f}x | >= {target:g}x | {same} |")
    loaded = (PROMPT - 1) // BLOCK * tier["block_bytes"]
    print(f"a warm request loads {loaded / 2**20:.0f} MiB: {loaded / copy_bw * 2e3:.1f} ms at the copy ceiling")
    print("\n2. multi-turn chat replay through the server: 4 conversations x 3 turns, pool of 12 blocks "
          f"({12 * BLOCK:,} tokens)")
    print("| tier | TTFT p50 (ms) | TTFT mean (ms) | prefix hit rate (both tiers) | tier-2 hits (tokens) |")
    print("|---|---|---|---|---|")
    results = {}
    for name, gib in (("none", None), (f"{TIER_GIB:g} GiB host", TIER_GIB)):
        ttfts, texts, ledger = replay(gib)
        results[name] = (statistics.median(ttfts), texts)
        print(f"| {name} | {statistics.median(ttfts) * 1e3:,.0f} | {statistics.fmean(ttfts) * 1e3:,.0f} | "
              f"{hit_rate(ledger):.1%} | {ledger['offload']['hits'] if ledger['offload'] else 0:,} |")
    (p0, t0), (p1, t1) = results.values()
    print(f"TTFT p50 {p0 / p1:.1f}x lower with the tier (target >= 2x); replies the same: {t0 == t1}")
    ok = ok and p0 / p1 >= 2 and t0 == t1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
