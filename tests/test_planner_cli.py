"""``kvledger plan`` as a user runs it: the interface outside checks call, the chapter's numbers,
vLLM's, bad input, plots, and no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli_helpers import assert_one_line_error, kvledger

CHAPTER = ("llama-3.1-8b", "--gpu", "a100-80gb", "--gpu-memory", "80GiB", "--gpu-memory-utilization", "1.0",
           "--overhead", "3GiB")
GiB = 1 << 30


def plan(*args: str) -> dict:
    r = kvledger("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    return r.json()


def test_json_interface_keys():
    out = plan(*CHAPTER, "--users", "60", "--context", "8192", "--bandwidth", "1.5TB/s")
    for key in ("weights_bytes", "kv_pool_bytes", "bytes_per_token", "scale_bytes_per_token", "num_blocks", "kv_tokens",
                "users_per_context", "crossover_tokens", "step_time_s", "tokens_per_s", "tokens_per_s_per_user",
                "kv_byte_share", "verdict", "weight_bytes_read_per_step"):
        assert key in out, key
    assert out["verdict"] == "fits" and out["weight_bytes_read_per_step"] == out["weights_bytes"]
    assert list(out["users_per_context"]) == ["2048", "8192", "32768", "131072"]
    assert all(isinstance(v, int) for v in out["users_per_context"].values())


def test_chapter_numbers_through_the_cli():
    out = plan(*CHAPTER, "--users", "60", "--context", "8192", "--bandwidth", "1.5TB/s")
    assert round(out["weights_bytes"] / GiB, 2) == 14.96
    assert round(out["kv_pool_bytes"] / GiB) == 62
    assert abs(out["kv_tokens"] - 496_000) <= 0.03 * 496_000
    for context, users in {"2048": 242, "8192": 60, "32768": 15, "131072": 3}.items():
        assert abs(out["users_per_context"][context] - users) <= 0.05 * users
    assert out["kv_bytes_per_step"] == 60 * GiB
    assert abs(out["total_bytes_per_step"] / GiB - 75) < 0.5
    assert abs(out["step_time_s"] - 0.054) < 0.001
    assert abs(out["tokens_per_s"] - 1100) < 30 and abs(out["tokens_per_s_per_user"] - 18) < 1
    assert round(out["kv_byte_share"], 2) == 0.80
    assert abs(out["crossover_tokens"] - 122_000) < 1000 and round(out["crossover_conversations"]) == 15


def test_vllm_public_example():
    """vLLM 0.19: Llama-3.1-8B, H100 80 GB, utilization 0.95 -> 58.11 GiB, 476,016 tokens."""
    given = plan("llama-3.1-8b", "--gpu", "h100-80gb", "--gpu-memory-utilization", "0.95", "--kv-cache-memory", "58.11GiB")
    assert abs(given["kv_tokens"] - 476_016) <= 0.005 * 476_016
    scratch = plan("llama-3.1-8b", "--gpu", "h100-80gb", "--gpu-memory-utilization", "0.95")
    assert abs(scratch["kv_tokens"] - 476_016) <= 0.05 * 476_016


def test_text_shows_every_term():
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--kv-cache-dtype", "int8", "--max-model-len", "16384")
    assert r.returncode == 0, r.stderr
    for needle in ("x gpu-memory-utilization 0.9", "- weights", "- activation peak", "- non-torch memory",
                   "- CUDA graphs", "= KV cache pool", "bytes per token (Eq 2.2, int8)", "65,536",
                   "scale bytes per token", "1,024", "GPU KV cache size (tokens)", "crossover", "useful work?",
                   "16,384"):
        assert needle in r.stdout, needle


def test_int8_plan_counts_scale_bytes():
    out = plan("llama-3.1-8b", "--gpu", "a100-80gb", "--kv-cache-dtype", "int8")
    assert out["bytes_per_token"] == 65_536 and out["scale_bytes_per_token"] == 1024
    assert out["num_blocks"] == out["kv_pool_bytes"] // (16 * (65_536 + 1024))


def test_max_model_len_row_and_vllm_error():
    out = plan("llama-3.1-8b", "--gpu", "l4", "--max-model-len", "20000")
    assert "20000" in out["users_per_context"]
    assert out["max_concurrency"] == pytest.approx(out["num_blocks"] / 1250)  # vLLM's "Maximum concurrency" line
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "l4", "--max-model-len", "131072")
    assert_one_line_error(r, "KV cache is needed, which is larger than the available KV cache memory",
                          "the estimated maximum model length is")


@pytest.mark.parametrize("args, needles", [
    (("llama-3.1-8b", "--gpu", "a100-80"), ("unknown GPU", "a100-80gb")),
    (("llama-3.1-8x", "--gpu", "a100-80gb"), ("unknown model", "llama-3.1-8b")),
    (("llama-3.1-70b", "--gpu", "a100-80gb"), ("does not fit", "GiB", "--tensor-parallel-size 2 would fit")),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--gpu-memory", "0"), ("must be positive",)),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--overhead", "-3GiB"), ("--overhead",)),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--kv-cache-memory", "0GiB"), ("--kv-cache-memory",)),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--block-size", "0"), ("--block-size",)),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--context", "4096"), ("--context needs --users",)),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--bandwidth", "fast"), ("--bandwidth",)),
])
def test_bad_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(kvledger("plan", *args), *needles)


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "plan.png"
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--plot", str(out))
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert_one_line_error(kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--plot", str(tmp_path / "x.pdf")),
                          ".png")


def test_plan_never_imports_torch():
    code = ("import sys, io, contextlib\n"
            "from kvledger.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['plan', 'llama-3.1-8b', '--gpu', 'a100-80gb'])\n"
            "    rc |= main(['advise', 'llama-3.1-8b', '--gpu', 'a100-80gb', '--prompt-tokens', '6144',\n"
            "                '--output-tokens', '400', '--users', '40', '--target-users', '100'])\n"
            "assert rc == 0, rc\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print('TORCH' if loaded else 'NO-TORCH', loaded[:3])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("NO-TORCH"), proc.stdout


@pytest.mark.parametrize("args, needles", [
    (("llama-3.1-8b", "--gpu", "a100-80gb", "-tp", "3"), ("tensor-parallel size 3", "1, 2, 4, 8, 16, 32")),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--gpu-memory", "1e400"), ("--gpu-memory", "finite")),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--users", "4", "--context", "100", "--bandwidth", "1e400TB/s"),
     ("--bandwidth", "finite")),
    (("llama-3.1-8b", "--gpu", "h200", "--max-model-len", "200000"), ("max_position_embeddings = 131,072",)),
    (("llama-3.1-8b", "--gpu", "a100-80gb", "--weights-dtype", "int3"), ("--weights-dtype", "mxfp4")),
])
def test_more_bad_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(kvledger("plan", *args), *needles)


def test_crossover_of_a_sliding_window_model_counts_the_window():
    """Mistral-7B-v0.1 in 32K conversations: a live token reads 131,072 x 4,096 / 32,768 = 16,384 bytes."""
    out = plan("mistral-7b", "--gpu", "a100-80gb", "--users", "2", "--context", "32768")
    assert out["crossover_tokens"] == -(-out["weights_bytes"] // 16_384)
    assert out["kv_bytes_per_step"] == 2 * 32 * 2 * 8 * 128 * 2 * 4096
    assert out["max_fitting_length"] == 32768


def test_gpu_memory_flag_is_recorded_and_labelled():
    assert plan("llama-3.1-8b", "--gpu", "a100-80gb")["gpu_memory_given"] is False
    assert plan(*CHAPTER)["gpu_memory_given"] is True
    assert "total memory (--gpu-memory)" in kvledger("plan", *CHAPTER).stdout
    assert "total memory (as the device reports)" in kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb").stdout


def test_max_num_seqs_sizes_the_profiling_pass():
    """The sampler's bf16 logits and three float32 copies: 128,256 x (2 + 3 x 4) bytes more per extra sequence."""
    few, many = plan(*CHAPTER[:3], "--max-num-seqs", "1"), plan(*CHAPTER[:3], "--max-num-seqs", "257")
    assert many["activation_bytes"] - few["activation_bytes"] == 256 * 128_256 * (2 + 3 * 4)


def test_plot_that_cannot_be_written_is_one_line(tmp_path):
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--plot", str(tmp_path / "missing" / "plan.png"))
    assert_one_line_error(r, "cannot write --plot")


@pytest.mark.parametrize("argv", [
    ["plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--plot", "plan.png"],
    ["kv-quality", "--plot", "quality.png"],  # refused before the (long) run starts
])
def test_missing_matplotlib_is_one_line(tmp_path, argv):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from kvledger.cli.main import main\n"
            f"rc = main({argv!r})\n"
            "print('torch' in sys.modules)\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs matplotlib" in lines[0] and "kvledger[plot]" in lines[0], proc.stderr
    assert proc.stdout.strip().endswith("False")  # the engine was never loaded
    assert not list(tmp_path.iterdir())


def test_live_tokens_panel_draws_the_pool_and_labelled_percentiles():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from kvledger.planner.plot import plot_live_tokens
    from kvledger.planner.trace_sizing import Replay

    rep = Replay(times_s=np.linspace(0, 600, 100), live_tokens=np.arange(100.0) * 1000, sequences=np.ones(100),
                 step_time_s=0.01, prefill_s_per_token=1e-5, iterations=1)
    fig, ax = plt.subplots()
    plot_live_tokens(ax, rep, 50_000)
    assert list(ax.lines[0].get_ydata()) == list(rep.live_tokens)
    levels = [line.get_ydata()[0] for line in ax.lines[1:]]
    assert levels == pytest.approx([50_000, 49_500, 89_100, 98_010])  # the pool, then p50, p90, p99 of 0..99,000
    assert [t.get_text() for t in ax.texts] == ["p50 49,500", "p90 89,100", "p99 98,010"]
    assert "49.0% of the time above" in ax.get_title() and "live tokens" in ax.get_title()
    plt.close(fig)


def test_plot_with_a_timed_workload_has_the_live_tokens_panel(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_tokens,output_tokens,timestamp\n" + "".join(f"{1000 + i},{100},{i * 0.5}\n" for i in range(200)))
    out = tmp_path / "plan.png"
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--workload", str(trace), "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_max_model_len_the_verdict_holds_the_models_context():
    """vLLM starts with the model's own context unless told otherwise: on an L4 Llama-3.1-8B's
    131,072 tokens do not fit, so the plan must not say "fits"."""
    out = plan("llama-3.1-8b", "--gpu", "l4")
    assert out["verdict"] == "does not fit" and out["verdict_term"] == "max-model-len"
    assert f"--max-model-len {out['max_fitting_length']}" in out["verdict_advice"]
    assert plan("llama-3.1-8b", "--gpu", "l4", "--max-model-len", "8192")["verdict"] == "fits"  # 0.57 GiB left, 0.5 needed


def test_plan_refuses_an_uneven_head_split_that_kv_bytes_and_the_engine_run():
    """SmolLM2's 3 KV heads at TP 2 (2 and 1): vLLM refuses the size, so its memory wall does,
    naming the sizes vLLM runs and the one kvledger's engine adds; kv-bytes prints rank 0's bytes."""
    assert_one_line_error(kvledger("plan", "smollm2-135m", "--gpu", "l4", "-tp", "2"),
                          "tensor-parallel size 2 cannot split the 9 attention heads and 3 KV heads of smollm2-135m "
                          "evenly, as vLLM requires; sizes that do: 1, 3, 9; kvledger's engine also runs 2")
    assert plan("smollm2-135m", "--gpu", "l4", "-tp", "3")["bytes_per_token"] == 2 * 30 * 1 * 64 * 2
    assert kvledger("kv-bytes", "smollm2-135m", "-tp", "2", "--json").json()["bytes_per_token"] == 2 * 30 * 2 * 64 * 2


# ---- the second KV tier (--kv-offloading-size) ---------------------------------------------------
@pytest.mark.parametrize("flags, block_bytes, blocks", [
    # bfloat16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes x 16 tokens = 2 MiB, whole host pages
    ((), 2 * 2**20, 10 * 512),
    # float32 doubles it
    (("--kv-cache-dtype", "float32"), 4 * 2**20, 10 * 256),
    # int8 with float16 scales per token and KV head: (65,536 + 1,024) x 16 = 1,064,960 bytes = 260 pages
    (("--kv-cache-dtype", "int8"), 1_064_960, 10 * 2**30 // 1_064_960),
    # TP 2: half the heads per rank, a copy per rank: the same block in all
    (("--tensor-parallel-size", "2"), 2 * 2**20, 10 * 512),
])
def test_offload_capacity_is_vllms_arithmetic(flags, block_bytes, blocks):
    out = plan("llama-3.1-8b", "--gpu", "h100-80gb", "--kv-offloading-size", "10", *flags)
    assert out["offload_block_bytes"] == out["offload_slot_bytes"] == block_bytes
    assert (out["offload_capacity_blocks"], out["offload_capacity_tokens"]) == (blocks, blocks * 16)
    assert out["offload_bytes"] == blocks * block_bytes <= 10 * GiB


def test_offload_load_against_recompute_and_the_link_override():
    pcie5 = plan("llama-3.1-8b", "--gpu", "h100-80gb", "--kv-offloading-size", "64", "--context", "32768")
    assert pcie5["offload_link"] == "PCIe Gen5 x16" and pcie5["offload_bandwidth_bytes_per_s"] == 64e9
    assert pcie5["offload_prefix_tokens"] == 32768
    assert pcie5["offload_load_s"] == pytest.approx(32768 * 131072 / 64e9)  # 2,048 blocks of 2 MiB over 64 GB/s
    assert pcie5["offload_recompute_s"] > 10 * pcie5["offload_load_s"]  # a 32K prefill takes seconds on an H100
    slow = plan("llama-3.1-8b", "--gpu", "h100-80gb", "--kv-offloading-size", "64", "--context", "32768",
                "--kv-offloading-bandwidth", "2GB/s", "--kv-offloading-path", "/tmp/kv")
    assert slow["offload_medium"] == "disk" and slow["offload_load_s"] == pytest.approx(32 * pcie5["offload_load_s"])
    assert slow["offload_recompute_s"] == pcie5["offload_recompute_s"]
    text = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--kv-offloading-size", "16").stdout
    assert "second KV tier: --kv-offloading-size 16 GiB" in text and "PCIe Gen4 x16" in text


@pytest.mark.parametrize("args, needles", [
    (("gemma-3-27b-it", "--gpu", "h100-80gb", "--kv-offloading-size", "8"), ("sliding-window",)),
    (("llama-3.1-8b", "--gpu", "h100-80gb", "--kv-offloading-size", "0"), ("--kv-offloading-size", "positive")),
    (("llama-3.1-8b", "--gpu", "h100-80gb", "--kv-offloading-size", "0.001"), ("holds no block",)),
])
def test_offload_bad_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(kvledger("plan", *args), *needles)
