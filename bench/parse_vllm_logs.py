"""Parse vLLM start-up logs into the validation table's data file (numbers only).

    python bench/parse_vllm_logs.py LOG_DIR SOURCE_PREFIX > tests/data/vllm_startup_logs.json

Each row keeps what vLLM printed about its memory wall (GiB as vLLM prints them: binary GiB,
rounded to 0.01) and the flags the run was started with; no text of the log is kept but the
category of a failure. SOURCE_PREFIX is the repository path of LOG_DIR, recorded per row.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

from kvledger.config import GPU_MEMORY_UTILIZATION

_FLOAT = r"([0-9]+(?:\.[0-9]+)?)"
_PATTERNS = {
    "total_memory_gib": rf"init memory snapshot: .*?total_memory={_FLOAT}GiB",
    "init_cuda_memory_gib": rf"init memory snapshot: .*?cuda_memory={_FLOAT}GiB",
    "weights_gib": rf"Model loading took {_FLOAT} GiB",
    "activation_gib": rf"torch peak memory increase: {_FLOAT}GiB",
    "non_torch_gib": rf"non-torch forward increase memory: {_FLOAT}GiB",
    "cuda_graph_estimated_gib": rf"Estimated CUDA graph memory: {_FLOAT} GiB total",
    "cuda_graph_actual_gib": rf"CUDA graph pool memory: {_FLOAT} GiB \(actual\)",
    "kv_memory_gib": rf"Available KV cache memory: {_FLOAT} GiB",
    "requested_gib": rf"worker requested memory: {_FLOAT}GiB",
}
_FAILURES = (
    ("max_model_len above the model's context", "is greater than the derived max_model_len"),
    ("out of memory warming up the sampler", "CUDA out of memory occurred when warming up sampler"),
    ("not divisible by the tensor-parallel size", "is not divisible by"),
    ("another process held the GPU", "on startup is less than desired GPU memory utilization"),
    ("model files not downloaded", "couldn't connect to 'https://huggingface.co'"),
    ("model type unknown to transformers", "Transformers does not recognize this architecture"),
)


def _workers(text: str, pattern: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, text)]


def parse(path: Path, prefix: str) -> dict:
    text = path.read_text(errors="replace")
    args_match = re.search(r"non-default args: (\{.*\})", text)
    args = ast.literal_eval(args_match.group(1)) if args_match else {}
    row: dict = {
        "source": f"{prefix.rstrip('/')}/{path.name}",
        "model": args.get("model"),
        "tensor_parallel_size": int(args.get("tensor_parallel_size", 1)),
        "pipeline_parallel_size": int(args.get("pipeline_parallel_size", 1)),
        "data_parallel_size": int(args.get("data_parallel_size", 1)),
        "max_model_len": args.get("max_model_len"),
        "gpu_memory_utilization": float(args.get("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)),
        "dtype": args.get("dtype", "auto"),
        "quantization": args.get("quantization"),
        "kv_cache_dtype": args.get("kv_cache_dtype", "auto"),
    }
    seqs = re.search(r"Defaulting max_num_seqs to (\d+)", text)
    batched = re.search(r"Defaulting max_num_batched_tokens to (\d+)", text)
    row["max_num_seqs"] = int(seqs.group(1)) if seqs else None
    row["max_num_batched_tokens"] = int(batched.group(1)) if batched else None
    for key, pattern in _PATTERNS.items():
        values = _workers(text, pattern)
        # Under TP every worker prints its own line and they agree (to rounding); take the largest.
        row[key] = max(values) if values else None
    # Under PP the stages differ and only the first prints its pool: the binding stage is the one
    # with the most non-KV memory, and its pool is the requested memory less that.
    profiles = re.findall(rf"Total non KV cache memory: {_FLOAT}GiB; torch peak memory increase: {_FLOAT}GiB; "
                          rf"non-torch forward increase memory: {_FLOAT}GiB; weights memory: {_FLOAT}GiB", text)
    requested = _workers(text, rf"worker requested memory: {_FLOAT}GiB")
    if profiles:
        non_kv, activation, non_torch, weights = max((tuple(map(float, p)) for p in profiles), key=lambda p: p[0])
        row.update(weights_gib=weights, activation_gib=activation, non_torch_gib=non_torch)
        printed = row["kv_memory_gib"]
        if requested and int(args.get("pipeline_parallel_size", 1)) > 1:
            row["kv_memory_gib"] = round(min(requested) - non_kv, 2)
            row["kv_memory_printed_gib"] = printed
    tokens = re.findall(r"GPU KV cache size: ([0-9,]+) tokens", text)
    row["kv_tokens"] = min(int(t.replace(",", "")) for t in tokens) if tokens else None
    conc = re.search(r"Maximum concurrency for [0-9,]+ tokens per request: ([0-9.]+)x", text)
    row["max_concurrency"] = float(conc.group(1)) if conc else None
    failed = path.name.endswith(".FAILED.log")
    row["started"] = not failed
    row["failure"] = None
    if failed:
        row["failure"] = next((label for label, needle in _FAILURES if needle in text), "engine start-up failed (other)")
    return row


def main() -> None:
    log_dir, prefix = Path(sys.argv[1]), sys.argv[2]
    rows = [parse(p, prefix) for p in sorted(log_dir.glob("*.log"))]
    json.dump(rows, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
