"""Inputs a new user tries (issue 13, item 8): each is one line and exit 2, or does what --help says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import assert_one_line_error, kvledger

PLAN = ("plan", "llama-3.1-8b", "--gpu", "h100-80gb")
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "kvledger" / "spec" / "configs"


@pytest.mark.parametrize("args, needles", [
    (PLAN + ("--gpu-memory", "1e30"), ("--gpu-memory", "1PiB")),
    (PLAN + ("--kv-cache-memory", "1000000TiB"), ("--kv-cache-memory", "1PiB")),
    (("kv-bytes", "llama-3.1-8b", "--tokens", "1" + "0" * 30), ("--tokens", "2^40")),
    (PLAN + ("--users", "2", "--context", "1" + "0" * 30), ("--context", "2^40")),
    (PLAN + ("--users", "2", "--context", "200000"), ("--context 200,000", "max_position_embeddings = 131,072")),
    (PLAN + ("--block-size", "7"), ("--block-size", "7", "16")),
    (PLAN + ("--context", "4096"), ("--context needs --users",)),
    (PLAN + ("--gpu-memory-utilization", "0"), ("--gpu-memory-utilization",)),
    (PLAN + ("--quantization", "awq"), ("--quantization",)),
    (("plan", "gpt-oss-20b", "--gpu", "h100-80gb", "--quantization", "fp8"), ("already quantized", "mxfp4")),
    (PLAN + ("--pipeline-parallel-size", "64"), ("--pipeline-parallel-size 64", "32 layers")),
    (("plan", "--gpu", "h100-80gb"), ("give a MODEL",)),
    (("verify", "--tokens", "100000000000"), ("needs about", "available", "--tokens")),
    (("verify", "--head-dim", "1000000000000"), ("needs about", "--head-dim")),
    (("verify", "--tolerance", "-1"), ("--tolerance", "zero or more")),
    (("bench", "serve", "--trace", "x.csv", "--length-scale", "1e30"), ("--length-scale", "at most 1000")),
])
def test_bad_input_is_one_line_exit_2(args, needles):
    assert_one_line_error(kvledger(*args), *needles)


def test_a_config_with_absurd_counts_is_one_line(tmp_path):
    config = json.loads((CONFIGS / "meta-llama--Llama-3.1-8B" / "config.json").read_text())
    for key, value in (("num_hidden_layers", 1e30), ("vocab_size", 1e30), ("hidden_size", float("inf"))):
        f = tmp_path / f"{key}.json"
        f.write_text(json.dumps({**config, key: value}).replace("Infinity", "1e400"))
        assert_one_line_error(kvledger("plan", str(f), "--gpu", "h100-80gb"), key)
    binary = tmp_path / "binary" / "config.json"
    binary.parent.mkdir()
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert_one_line_error(kvledger("plan", str(binary.parent), "--gpu", "h100-80gb"), "not a text file")


def test_a_workload_row_of_absurd_length_is_one_line(tmp_path):
    f = tmp_path / "huge.csv"
    f.write_text("prompt_tokens,output_tokens,timestamp\n" + "1" + "0" * 30 + ",10,0\n5,5,1\n")
    assert_one_line_error(kvledger(*PLAN, "--workload", str(f)), "huge.csv:2", "prompt_tokens")


def test_users_alone_takes_the_default_context():
    r = kvledger(*PLAN, "--users", "60", "--json")
    assert r.returncode == 0, r.stderr
    out = r.json()
    assert out["context"] == 8192 and out["users"] == 60 and out["kv_bytes_per_step"] == 60 * 8192 * 131_072


def test_model_name_of_a_config_path_is_its_directory(tmp_path):
    d = tmp_path / "my-llama"
    d.mkdir()
    (d / "config.json").write_text((CONFIGS / "meta-llama--Llama-3.1-8B" / "config.json").read_text())
    for arg, cwd in ((".", d), ("config.json", d), (str(d), tmp_path)):
        proc = subprocess.run([sys.executable, "-m", "kvledger.cli.main", "plan", arg, "--gpu", "h100-80gb"],
                              capture_output=True, text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0].startswith("my-llama: 32 layers"), proc.stdout.splitlines()[0]


def test_users_per_context_stops_at_the_models_context_and_max_model_len():
    phi = kvledger("plan", "phi-4", "--gpu", "h100-80gb", "--json").json()  # max_position_embeddings 16,384
    assert list(phi["users_per_context"]) == ["2048", "8192"]
    capped = kvledger(*PLAN, "--max-model-len", "8192", "--json").json()
    assert list(capped["users_per_context"]) == ["2048", "8192"]
    full = kvledger(*PLAN, "--json").json()
    assert list(full["users_per_context"]) == ["2048", "8192", "32768", "131072"]


def test_the_gpu_catalog_is_listed():
    for args in (("plan", "--gpu", "list"), ("gpus",)):
        r = kvledger(*args)
        assert r.returncode == 0, r.stderr
        assert "h100-80gb" in r.stdout and "79.19" in r.stdout and "a100-80gb" in r.stdout
    listed = kvledger("gpus", "--json").json()
    assert {g["name"] for g in listed} >= {"h100-80gb", "a100-80gb", "l4", "mi300x"}


def test_hugging_face_ids_resolve_to_bundled_configs():
    r = kvledger("plan", "meta-llama/Llama-3.1-8B", "--gpu", "h100-80gb", "--json")
    assert r.returncode == 0, r.stderr
    assert r.json()["model"] == "meta-llama/Llama-3.1-8B" and r.json()["bytes_per_token"] == 131_072
    assert_one_line_error(kvledger("plan", "meta-llama/Llama-9-1T", "--gpu", "h100-80gb"), "Llama-9-1T")


def test_fp8_on_sm80_plans_and_warns():
    r = kvledger("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--kv-cache-dtype", "fp8", "--json")
    assert r.returncode == 0
    assert r.json()["bytes_per_token"] == 65_536 and len(r.json()["warnings"]) == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "warning" in lines[0] and "SM 8.0" in lines[0] and "int8" in lines[0]


def test_engine_flags_refuse_bad_values_before_loading():
    assert_one_line_error(kvledger("generate", "hi", "--device", "tpu"), "--device", "tpu")
    assert_one_line_error(kvledger("generate", "hi", "--block-size", "7"), "--block-size")
    assert_one_line_error(kvledger("generate", "hi", "--kv-cache-dtype", "int4"), "--kv-cache-dtype")
    assert_one_line_error(kvledger("generate", "hi", "--kv-cache-memory", "1e30"), "--kv-cache-memory", "1PiB")
    assert_one_line_error(kvledger("generate", "hi", "--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization")
    help_text = kvledger("generate", "--help").stdout
    assert "int8" in help_text and "fp8_e4m3" in help_text and "--gpu-memory-utilization" in help_text


def test_a_model_directory_without_weights_says_so(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "meta-llama--Llama-3.1-8B" / "config.json").read_text())
    assert_one_line_error(kvledger("generate", "hi", "--model", str(tmp_path)), "no weights")


def test_a_pool_larger_than_the_machine_is_refused_before_allocating():
    assert_one_line_error(kvledger("generate", "hi", "--kv-cache-memory", "1000TiB"), "free", "--kv-cache-memory")
    assert_one_line_error(kvledger("generate", "hi", "--num-gpu-blocks-override", "1000000000"), "free",
                          "--num-gpu-blocks-override")


def test_an_unsupported_model_type_names_the_supported_ones(tmp_path):
    config = json.loads((CONFIGS / "google--gemma-2-9b-it" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    assert_one_line_error(kvledger("generate", "hi", "--model", str(tmp_path)), "gemma2", "supported: llama")


def test_serve_takes_the_model_positionally_as_vllm_does():
    from kvledger.cli.main import build_parser

    args = build_parser().parse_args(["serve", "smollm2-135m", "--port", "0"])
    assert args.model_tag == "smollm2-135m" and args.model is None
    assert_one_line_error(kvledger("serve", "smollm2-135m", "--model", "other"), "two models")


def test_engine_utilization_that_leaves_no_room_is_one_line():
    assert_one_line_error(kvledger("generate", "hi", "--gpu-memory-utilization", "0.0001"),
                          "--gpu-memory-utilization", "no room")


def test_bench_serve_checks_the_model_before_sending(tmp_path):
    import http.server
    import threading

    posts = []

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"object": "list", "data": [{"id": "smollm2-135m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            posts.append(self.path)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        trace = tmp_path / "t.csv"
        trace.write_text("prompt_tokens,output_tokens\n10,5\n12,6\n")
        r = kvledger("bench", "serve", "--base-url", f"http://127.0.0.1:{httpd.server_address[1]}", "--model", "gpt-4",
                     "--trace", str(trace), "--num-prompts", "2")
        assert_one_line_error(r, "does not serve 'gpt-4'", "smollm2-135m")
        assert posts == []  # not one request sent
    finally:
        httpd.shutdown()


def test_mooncake_without_hash_ids_and_an_empty_trace(tmp_path):
    rows = tmp_path / "mooncake.jsonl"
    rows.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 1000, "output_length": 50}) + "\n"
                            for i in range(20)))
    r = kvledger(*PLAN, "--workload", str(rows), "--json")
    assert r.returncode == 0, r.stderr
    assert r.json()["workload"]["requests"] == 20 and r.json()["workload"]["prefix_caching"] is None
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(kvledger(*PLAN, "--workload", str(empty)), "empty.jsonl is empty")
