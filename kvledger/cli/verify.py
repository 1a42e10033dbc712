"""``kvledger verify``: the chapter's artifact, full causal attention versus an append-only KV cache."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from kvledger.cli.common import non_negative_float, positive_int, print_json, signed_seed


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="check cached attention against full causal attention, and cache bytes against Eq 2.2",
        description="Runs a stack of attention layers twice (whole sequence with a triangular mask; one token at a "
                    "time with an append-only KV cache), reports the largest output difference and the cache bytes "
                    "predicted by Eq 2.2 versus measured from the tensors. Exits 1 if either check fails.")
    p.add_argument("--layers", type=positive_int, default=1, metavar="L", help="layers (default 1)")
    p.add_argument("--heads", type=positive_int, default=1, metavar="H", help="query heads (default 1)")
    p.add_argument("--kv-heads", type=positive_int, default=None, metavar="K", help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=128, metavar="D", help="head dimension (default 128)")
    p.add_argument("--tokens", type=positive_int, default=64, metavar="T", help="tokens (default 64)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B", help="sequences (default 1)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--no-rope", dest="rope", action="store_false", help="disable rotary position embedding")
    p.add_argument("--seed", type=signed_seed, default=0, metavar="N",
                   help="seed of the random weights and inputs (default 0)")
    p.add_argument("--tolerance", type=non_negative_float, default=None,
                   help="max allowed |difference|, zero or more (default 1e-5 float32, 1e-12 float64)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def memory_needed(layers: int, heads: int, kv_heads: int, head_dim: int, tokens: int, batch: int,
                  element_bytes: int) -> int:
    """Bytes the artifact holds at its peak (an estimate from its shapes): the layers' Q/K/V/O
    weights, the full pass's ``tokens x tokens`` scores per head (the masked scores and their
    softmax) and its mask, the hidden states of both passes, and the KV cache (Eq 2.2)."""
    hidden = heads * head_dim
    kv_width = kv_heads * head_dim
    weights = layers * (2 * hidden * hidden + 2 * hidden * kv_width) * element_bytes
    scores = 2 * batch * heads * tokens * tokens * element_bytes + tokens * tokens
    states = 6 * batch * tokens * hidden * element_bytes
    cache = 2 * layers * batch * tokens * kv_width * element_bytes
    return weights + scores + states + cache


def run(args: argparse.Namespace) -> int:
    from kvledger.errors import KVLedgerError
    from kvledger.units import available_ram_bytes, format_bytes

    need = memory_needed(args.layers, args.heads, args.kv_heads or args.heads, args.head_dim, args.tokens, args.batch,
                         8 if args.dtype == "float64" else 4)
    have = available_ram_bytes()
    if need > have:  # checked before torch allocates anything
        raise KVLedgerError(f"this geometry needs about {format_bytes(need)} of memory (its weights, "
                            f"{args.tokens:,} x {args.tokens:,} attention scores per head and the KV cache) but "
                            f"{format_bytes(have)} is available; lower --tokens, --head-dim, --heads or --batch")
    from kvledger.evaluate.verify import VerifyConfig, run_verify

    cfg = VerifyConfig(layers=args.layers, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                       head_dim=args.head_dim, tokens=args.tokens, batch=args.batch, dtype=args.dtype,
                       rope=args.rope, seed=args.seed, tolerance=args.tolerance)
    result = run_verify(cfg, progress=True)  # on stderr: stdout and --json are the result alone
    if args.json:
        print_json(asdict(result))
    else:
        print(f"{cfg.layers} layer(s), {cfg.heads} query head(s) over {cfg.kv_heads} KV head(s) "
              f"({cfg.spec().attention_kind}), d_h {cfg.head_dim}, "
              f"{cfg.tokens} {cfg.dtype} tokens, batch {cfg.batch}, RoPE {'on' if cfg.rope else 'off'}")
        ok = "ok" if result.max_abs_diff <= result.tolerance else "FAIL"
        print(f"max |full - cached|  {result.max_abs_diff:.3e}  (tolerance {result.tolerance:.0e})  {ok}")
        same = "ok" if result.predicted_bytes == result.measured_bytes else "FAIL"
        print(f"cache bytes, Eq 2.2  {result.predicted_bytes:,}  ({format_bytes(result.predicted_bytes)})")
        print(f"cache bytes, tensors {result.measured_bytes:,}  ({format_bytes(result.measured_bytes)})  {same}")
        print("PASSED" if result.passed else "FAILED")
    return 0 if result.passed else 1
