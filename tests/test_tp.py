"""Tensor parallelism: TP N against TP 1 step by step, per-rank cache bytes, a rank that dies.

SmolLM2-135M at TP 3 (9 query heads, 3 KV heads: one per rank) runs in lockstep beside a TP-1
engine of the same configuration: every step's logits within 1e-4, the same greedy tokens. A
random-weight Llama with one KV head runs at TP 2 (the head replicated on both ranks) through the
real CLI. Each rank's cache tensors weigh what ``kv-bytes --tensor-parallel-size N`` prints.
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
ENGINE_ARGS = dict(model="smollm2-135m", dtype="float32", num_gpu_blocks_override=96, max_num_batched_tokens=256)


def _lockstep(a, b, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Run engines ``a`` and ``b`` on the same greedy requests one step at a time; assert the same
    tokens every step; return the largest logit difference seen and the steps run."""
    from kvledger import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        a.add_request(str(i), ids, sp)
        b.add_request(str(i), ids, sp)
    worst, steps = 0.0, 0
    while a.has_unfinished_requests():
        out_a, out_b = a.step(), b.step()
        steps += 1
        assert [(o.request_id, o.new_token_ids) for o in out_a] == [(o.request_id, o.new_token_ids) for o in out_b]
        la, lb = a.runner.last_logits, b.runner.last_logits
        assert la.shape == lb.shape
        worst = max(worst, (la - lb).abs().max().item())
    assert not b.has_unfinished_requests()
    return worst, steps


@pytest.fixture(scope="module")
def tp3():
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(**ENGINE_ARGS, tensor_parallel_size=3))
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1_step_by_step(tp3):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine

    tp1 = LLMEngine(EngineConfig(**ENGINE_ARGS))
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
    worst, steps = _lockstep(tp1, tp3, prompts, NEW_TOKENS)
    assert steps >= NEW_TOKENS
    assert worst <= 1e-4, f"per-step logits differ by up to {worst:.2e}"
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
    args = ["generate", "Paged attention splits the cache", "--model", str(one_kv_head_llama), "--max-tokens", "24",
            "--ignore-eos", "--num-gpu-blocks-override", "40", "--json"]
    tp1 = kvledger(*args)
    tp2 = kvledger(*args, "--tensor-parallel-size", "2")
    assert tp1.returncode == 0 and tp2.returncode == 0, tp2.stderr
    one, two = tp1.json(), tp2.json()
    assert two["token_ids"] == one["token_ids"] and len(two["token_ids"]) == 24
    kv = two["kv"]
    per_rank = kvledger("kv-bytes", str(one_kv_head_llama / "config.json"), "--tokens", str(40 * 16),
                        "--tensor-parallel-size", "2", "--kv-cache-dtype", "float32", "--json").json()["total_bytes"]
    assert kv["ranks"] == 2 and kv["bytes_per_rank"] == per_rank == one["kv"]["measured_bytes"]  # the head is copied
    assert kv["measured_bytes"] == 2 * per_rank


def test_a_killed_rank_ends_the_engine_with_one_error(one_kv_head_llama):
    from kvledger import SamplingParams
    from kvledger.distributed.executor import RankFailure
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(one_kv_head_llama), num_gpu_blocks_override=64,
                                    tensor_parallel_size=2))
    try:
        victim = engine.executor.procs[0]
        engine.add_request("0", [5, 6, 7, 8], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        killer = threading.Timer(0.2, os.kill, (victim.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            while engine.has_unfinished_requests():
                engine.step()
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"the engine took {elapsed:.1f} s to notice"
        assert "rank 1 of 2" in str(info.value) and f"pid {victim.pid}" in str(info.value)
        assert not engine.has_unfinished_requests()  # the step's requests were aborted, their blocks freed
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        with pytest.raises(RankFailure, match="rank 1 of 2"):  # and it stays stopped, at once
            engine.add_request("1", [5, 6], SamplingParams(max_tokens=2))
            engine.step()
    finally:
        engine.shutdown()


def test_bad_tensor_parallel_size_is_one_line(one_kv_head_llama):
    from tests.cli_helpers import assert_one_line_error

    result = kvledger("generate", "hi", "--model", str(one_kv_head_llama), "--tensor-parallel-size", "3")
    assert_one_line_error(result, "tensor-parallel size 3")
