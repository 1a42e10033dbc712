"""Tensor parallelism: TP N against TP 1 step by step, per-rank cache bytes, a rank that dies.

SmolLM2-135M at TP 3 (9 query heads, 3 KV heads: one per rank) and at TP 2 (whole GQA groups,
unevenly: 2 KV heads and 6 query heads on rank 0, 1 and 3 on rank 1) runs in lockstep beside a
TP-1 engine of the same configuration: every step's logits within 5e-6 of the largest one, the
same greedy tokens, the same preemptions (the pool is too small for the whole batch). Gemma-3
270M (4 query heads, 1 KV head) runs at TP 2 through the real CLI, its KV head replicated on
both ranks, sliding-window layers past their window, and gives TP 1's tokens; so does a
random-weight Llama with one KV head. Each rank's cache tensors weigh what
``kv-bytes --tensor-parallel-size N`` prints: the per-rank figure (rank 0's, the largest), the
smaller rank of an uneven split its own heads' share.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
import torch

from tests.cli_helpers import kvledger

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "A KV cache stores", "Once upon a time, in a",
    "The three laws of motion are", "SELECT name FROM users WHERE", "Water boils at", "My favourite book is",
    "import numpy as np\n", "The quick brown fox", "In 1969, the first", "Paged attention splits",
]
NEW_TOKENS = 32
# 30 blocks of 16 tokens: the 12 requests need 36 by their end, so both engines preempt (recompute)
ENGINE_ARGS = dict(model="smollm2-135m", dtype="float32", num_gpu_blocks_override=30, max_num_batched_tokens=256,
                   block_size=16)


def _lockstep(a, b, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """Run engines ``a`` and ``b`` on the same greedy requests one step at a time; assert the same
    tokens every step; return the largest logit difference seen, the largest logit (its
    magnitude) and the steps run."""
    from kvledger import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        a.add_request(str(i), ids, sp)
        b.add_request(str(i), ids, sp)
    worst, scale, steps = 0.0, 0.0, 0
    while a.has_unfinished_requests():
        out_a, out_b = a.step(), b.step()
        steps += 1
        assert [(o.request_id, o.new_token_ids) for o in out_a] == [(o.request_id, o.new_token_ids) for o in out_b]
        la, lb = a.runner.last_logits, b.runner.last_logits
        assert la.shape == lb.shape
        worst = max(worst, (la - lb).abs().max().item())
        scale = max(scale, la.abs().max().item())
    assert not b.has_unfinished_requests()
    return worst, scale, steps


@pytest.mark.slow
def test_smollm2_tp2_splits_the_kv_heads_unevenly_matches_tp1_and_kv_bytes():
    """First in the module: a process runs one tensor-parallel group at a time (the TP-3 fixture's
    comes after this one is shut down)."""
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine

    tp1 = LLMEngine(EngineConfig(**ENGINE_ARGS))
    tp2 = LLMEngine(EngineConfig(**ENGINE_ARGS, tensor_parallel_size=2))
    try:
        assert tp2.runner.cache.num_kv_heads == 2  # rank 0: KV heads 0 and 1 (rank 1 holds head 2)
        prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
        worst, scale, steps = _lockstep(tp1, tp2, prompts, NEW_TOKENS)
        assert steps >= NEW_TOKENS
        assert worst <= 5e-6 * scale, f"per-step logits differ by up to {worst:.2e} (largest logit {scale:.1f})"
        assert tp2.scheduler.num_preemptions == tp1.scheduler.num_preemptions > 0
        ledger = tp2.ledger()
        cli = kvledger("kv-bytes", "HuggingFaceTB/SmolLM2-135M-Instruct", "--tokens",
                       str(ledger.num_blocks * ledger.block_size), "--tensor-parallel-size", "2",
                       "--kv-cache-dtype", "float32", "--json")
        assert cli.returncode == 0, cli.stderr
        per_rank, all_ranks = cli.json()["total_bytes"], cli.json()["total_bytes_all_ranks"]
        assert ledger.measured_bytes_by_rank == [per_rank, per_rank // 2]  # rank 1: one KV head of rank 0's two
        assert ledger.bytes_per_rank == per_rank
        assert ledger.measured_bytes == ledger.predicted_bytes == all_ranks == tp1.ledger().measured_bytes
    finally:
        tp2.shutdown()


@pytest.fixture(scope="module")
def tp3():
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(**ENGINE_ARGS, tensor_parallel_size=3))
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1_step_by_step(tp3):
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine

    tp1 = LLMEngine(EngineConfig(**ENGINE_ARGS))
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
    worst, scale, steps = _lockstep(tp1, tp3, prompts, NEW_TOKENS)
    assert steps >= NEW_TOKENS
    # float32 summed in another order (a rank's share of each product, then the all-reduce). The
    # difference follows the products' own rounding: 8e-5 with MKL's (median relative error of a
    # product 2.5e-7 against float64) and 1.4e-4 with oneDNN's (4.5e-7), against logits up to 46
    assert worst <= 5e-6 * scale, f"per-step logits differ by up to {worst:.2e} (largest logit {scale:.1f})"
    assert tp3.scheduler.num_preemptions == tp1.scheduler.num_preemptions > 0
    # every block back in the pool, on the one pool rank 0 keeps for all ranks
    assert tp3.pool.num_free_blocks == tp3.pool.num_blocks
    tp3.check_integrity()


def test_each_rank_holds_the_bytes_kv_bytes_predicts(tp3):
    ledger = tp3.ledger()
    tokens = ledger.num_blocks * ledger.block_size
    cli = kvledger("kv-bytes", "smollm2-135m", "--tokens", str(tokens), "--tensor-parallel-size", "3",
                   "--kv-cache-dtype", "float32", "--json")
    assert cli.returncode == 0, cli.stderr
    per_rank = cli.json()["total_bytes"]
    assert ledger.ranks == 3
    assert ledger.measured_bytes_by_rank == [per_rank] * 3
    assert ledger.bytes_per_rank == per_rank
    assert ledger.measured_bytes == ledger.predicted_bytes == 3 * per_rank
    assert tp3.cache.num_kv_heads == 1  # SmolLM2's 3 KV heads, one per rank


@pytest.fixture(scope="module")
def one_kv_head_llama(tmp_path_factory):
    """A random-weight Llama with 4 query heads and 1 KV head, saved as an HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvledger.loader.resolve import converted_dir, resolve_model

    path = tmp_path_factory.mktemp("llama-1kv")
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                  max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                                  initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for f in converted_dir(resolve_model(None)).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def test_one_kv_head_replicated_at_tp2_through_the_cli(one_kv_head_llama):
    from kvledger import SamplingParams
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.spec import ModelSpec, kv_bytes

    prompt = "Paged attention splits the cache"
    tp2 = kvledger("generate", prompt, "--model", str(one_kv_head_llama), "--max-tokens", "24", "--ignore-eos",
                   "--num-gpu-blocks-override", "40", "--tensor-parallel-size", "2", "--json")
    assert tp2.returncode == 0, tp2.stderr
    two = tp2.json()
    tp1 = LLMEngine(EngineConfig(model=str(one_kv_head_llama), num_gpu_blocks_override=40))
    tp1.add_request("0", tp1.tokenizer.encode(prompt), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    while tp1.has_unfinished_requests():
        (out,) = tp1.step()
    assert two["token_ids"] == out.outputs[0].token_ids and len(two["token_ids"]) == 24
    spec = ModelSpec.from_config_dict({**tp1.hf_config, "torch_dtype": "float32"})
    per_rank = kv_bytes(spec, "float32", tokens=40 * tp1.block_size, tensor_parallel_size=2).total_bytes
    kv = two["kv"]
    assert kv["ranks"] == 2 and kv["bytes_per_rank"] == per_rank == tp1.ledger().measured_bytes  # the head is copied
    assert kv["measured_bytes_by_rank"] == [per_rank, per_rank] and kv["measured_bytes"] == 2 * per_rank


@pytest.mark.slow
def test_gemma3_tp2_replicates_its_kv_head_and_matches_tp1_through_the_cli():
    """A 700-odd-token prompt: the sliding layers (window 512) drop blocks on both ranks."""
    prompt = " ".join(f"Note {i}: the heron crossed the river {i % 7} times." for i in range(60))
    args = ("generate", prompt, "--model", "gemma-3-270m", "--max-tokens", "16", "--ignore-eos",
            "--kv-cache-memory", "64MiB", "--block-size", "16", "--json")
    runs = {tp: kvledger(*args, "--tensor-parallel-size", str(tp)) for tp in (1, 2)}
    for tp, run in runs.items():
        assert run.returncode == 0, (tp, run.stderr)
    one, two = runs[1].json(), runs[2].json()
    assert one["prompt_tokens"] > 512
    assert two["token_ids"] == one["token_ids"] and len(two["token_ids"]) == 16
    cli = kvledger("kv-bytes", "gemma-3-270m", "--tensor-parallel-size", "2", "--kv-cache-dtype", "float32", "--json")
    assert cli.returncode == 0, cli.stderr
    kb = cli.json()
    assert kb["kv_heads_by_rank"] == [1, 1]
    page = 16 * kb["bytes_per_token"] // kb["num_layers"] * kb["group_layers"]  # a block of one group's 3 layers
    kv = two["kv"]
    assert kv["num_blocks"] == one["kv"]["num_blocks"]  # the same 64 MiB per rank, the same bytes per rank
    assert kv["measured_bytes_by_rank"] == [kv["num_blocks"] * page] * 2 == [one["kv"]["measured_bytes"]] * 2
    assert kv["measured_bytes"] == kv["predicted_bytes"] == 2 * one["kv"]["measured_bytes"]  # the head is copied


def test_a_size_that_cannot_split_the_heads_is_refused_before_any_rank_starts(one_kv_head_llama):
    from kvledger.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.errors import KVLedgerError

    with pytest.raises(KVLedgerError, match="tensor-parallel size 3 cannot split"):  # 4 query heads
        LLMEngine(EngineConfig(model=str(one_kv_head_llama), tensor_parallel_size=3))


def test_a_killed_rank_ends_the_engine_with_one_error(tp3):
    """Last in the module: it ends the shared TP-3 engine."""
    from kvledger import SamplingParams
    from kvledger.distributed.ranks import RankFailure

    victim = tp3.runner.ranks.procs[1]
    tp3.add_request("long", list(range(100, 140)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    tp3.add_request("short", list(range(200, 210)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    for _ in range(2):
        tp3.step()
    threading.Timer(0.1, os.kill, (victim.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        while tp3.has_unfinished_requests():
            tp3.step()
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"the engine took {elapsed:.1f} s to notice"
    assert f"rank 2 of 3 (pid {victim.pid})" in str(info.value), str(info.value)
    assert not tp3.has_unfinished_requests()  # the step's requests were aborted, their blocks freed
    assert tp3.pool.num_free_blocks == tp3.pool.num_blocks
    tp3.add_request("after", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RankFailure, match="rank 2 of 3"):  # and it stays stopped, at once
        tp3.step()
