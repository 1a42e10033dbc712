"""``kvledger calibrate``: measure the real engine over a grid of batch shapes, fit the step model,
write the profile that ``kvledger simulate --profile`` uses."""

from __future__ import annotations

import argparse
import sys

from kvledger.cli.common import check_writable, positive_int
from kvledger.cli.flags import ENGINE_MODEL_HELP, add_block_size, add_engine_dtype, add_max_num_batched_tokens
from kvledger.config import CUDA_BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, VLLM_BLOCK_SIZES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit the simulator's step-time model to the real engine on this device",
        description="Run the engine over prefill chunks and decode batches, fit the step model's coefficients by "
                    "non-negative least squares (model run and CPU overhead apart), print the fit's error per "
                    "shape and write a JSON profile for 'kvledger simulate --profile'.")
    p.add_argument("--model", default=None, help=ENGINE_MODEL_HELP)
    add_engine_dtype(p, help="weights and activations dtype")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda if present)")
    p.add_argument("--out", default="profile.json", metavar="FILE", help="profile to write (default profile.json)")
    p.add_argument("--quick", action="store_true", help="a small grid, one repetition: seconds, a rougher fit")
    p.add_argument("--reps", type=positive_int, default=None, help="repetitions per shape (default 3, quick 1)")
    add_block_size(p, vllm_sizes=True,
                   help=f"tokens per KV block: {', '.join(map(str, VLLM_BLOCK_SIZES))} (default {CUDA_BLOCK_SIZE})")
    add_max_num_batched_tokens(p, help=f"the engine's token budget per step (default {MAX_NUM_BATCHED_TOKENS}, the "
                                       "engine's)")
    p.add_argument("--kv-cache-memory", default="1GiB", metavar="BYTES",
                   help="KV pool of the measuring engine (default 1GiB)")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="fit from a serving run's own steps ('kvledger serve --step-log FILE') instead of "
                        "measuring a grid; the CPU overhead includes the server's pause between steps")
    p.add_argument("--json", action="store_true", help="print the profile as JSON instead of the table")
    p.set_defaults(func=run)


def device_name(engine) -> str:
    """The device the engine runs on, in words: the GPU's name, or the CPU's model and threads."""
    import platform

    import torch

    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    model = platform.processor() or "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model}, {torch.get_num_threads()} threads"


def run(args: argparse.Namespace) -> int:
    check_writable(args.out, "--out")  # before the measurement, which takes minutes
    if args.step_log:  # no engine, no torch: the fit alone
        from kvledger.sim.calibrate import profile_from_step_log

        profile, report = profile_from_step_log(args.step_log)
        return write_and_report(profile, report, args)
    from datetime import datetime, timezone

    from kvledger.config import EngineConfig
    from kvledger.engine.limits import check_before_loading

    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                          max_model_len=2048)
    check_before_loading(config)  # the model's name and its pool, before torch and the model load
    from kvledger.engine.llm_engine import LLMEngine
    from kvledger.engine.sampling_params import SamplingParams
    from kvledger.sim.calibrate import fit, grid, measure
    from kvledger.sim.step_model import ModelFingerprint, ModelGeometry, Profile

    engine = LLMEngine(config)
    geometry = ModelGeometry.of(engine.spec, engine.kv_cache_dtype)
    shapes = grid(args.quick, args.max_num_batched_tokens)
    reps = args.reps or (1 if args.quick else 3)
    measure(engine, [shapes[0]], geometry, reps=1, vocab=engine.vocab_size, max_model_len=engine.max_model_len,
            sampling_params=lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))  # warm-up
    measured = measure(engine, shapes, geometry, reps=reps, vocab=engine.vocab_size,
                       max_model_len=engine.max_model_len,
                       sampling_params=lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                       progress=(lambda s: print(f"measuring {s}", file=sys.stderr)) if not args.json else None)
    coefficients, report = fit(measured)
    profile = Profile(device=device_name(engine), model=engine.spec.name, fingerprint=ModelFingerprint.of(engine.spec),
                      dtype=args.dtype, kv_cache_dtype=engine.kv_cache_dtype, tensor_parallel_size=1,
                      block_size=engine.block_size, num_blocks=engine.num_blocks, coefficients=coefficients,
                      fit=report, created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return write_and_report(profile, report, args)


def write_and_report(profile, report, args: argparse.Namespace) -> int:
    """Save the profile; print it (``--json``) or the fit's error per shape."""
    from tabulate import tabulate

    from kvledger.cli.common import print_json

    coefficients = profile.coefficients
    profile.save(args.out)
    if args.json:
        print_json(profile.to_json())
        return 0
    rows = [[r["shape"], r["steps"], f"{r['measured_ms']:.2f}", f"{r['predicted_ms']:.2f}", f"{r['error_pct']:+.1f}"]
            for r in report]
    steps = sum(r["steps"] for r in report if r["kind"] != "total")
    print(f"{profile.model} ({profile.dtype}) on {profile.device}: {steps} steps "
          + (f"of a serving run ({args.step_log})" if args.step_log else "measured"))
    print(tabulate(rows, headers=["shape", "steps", "measured ms", "fit ms", "error %"], disable_numparse=True))
    errors = [abs(r["error_pct"]) for r in report if r["kind"] != "total"]
    print(f"fit error: median {sorted(errors)[len(errors) // 2]:.1f}%, max {max(errors):.1f}%")
    print("coefficients: " + ", ".join(f"{k} {v:.3g}" for k, v in coefficients.items() if v))
    print(f"wrote {args.out}")
    return 0
