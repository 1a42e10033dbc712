"""``kvledger kv-quality``: what an 8-bit KV cache costs, bucket by bucket of context position."""

from __future__ import annotations

import argparse

from kvledger.cli.common import positive_int, print_json
from kvledger.cli.flags import ENGINE_MODEL_HELP, add_engine_dtype
from kvledger.config import CUDA_BLOCK_SIZE
from kvledger.spec.dtypes import ENGINE_QUANTIZED_KV_DTYPES, KV_QUALITY_DEFAULT_KINDS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kv-quality", help="KL, top-1 agreement and perplexity of 8-bit KV caches along a long text",
        description="Runs the engine teacher-forced over a long real text with the unquantized cache and with each "
                    "8-bit kind, and reports per context-position bucket the mean KL divergence of the next-token "
                    "distributions, top-1 agreement and perplexity; plus the first token at which greedy "
                    "continuations part.")
    p.add_argument("--model", default=None, help=ENGINE_MODEL_HELP)
    p.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text (default: the Python language reference shipped with Python)")
    p.add_argument("--kv-cache-dtype", nargs="+", action="extend", choices=ENGINE_QUANTIZED_KV_DTYPES, metavar="D",
                   dest="kinds", help="8-bit kinds to compare with the unquantized cache "
                                      f"(default: {' '.join(KV_QUALITY_DEFAULT_KINDS)})")
    add_engine_dtype(p, help="model dtype, also the reference cache's")
    p.add_argument("--max-tokens", type=positive_int, default=6400, help="tokens of the text to read (default 6400)")
    p.add_argument("--buckets", type=positive_int, default=8, help="context-position buckets (default 8)")
    p.add_argument("--chunk", type=positive_int, default=1024, help="tokens per forward chunk (default 1024)")
    p.add_argument("--greedy-tokens", type=positive_int, default=128,
                   help="greedy continuation length for the divergence check (default 128)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png", help="draw KL, top-1 agreement and perplexity per bucket")
    p.set_defaults(func=run)


def check_context(model: str | None, max_tokens: int, greedy_tokens: int) -> None:
    """Refuse, before torch or the model loads, ``--max-tokens`` read plus ``--greedy-tokens``
    generated (in whole blocks of ``CUDA_BLOCK_SIZE`` tokens: the cache the scorer sizes) that run
    past the model's context (``max_position_embeddings``, in tokens), read from its config alone."""
    from kvledger.errors import KVLedgerError
    from kvledger.loader.resolve import model_config, resolve_model

    checkpoint = resolve_model(model)
    config = model_config(checkpoint)
    max_pos = int(config.get("max_position_embeddings") or 0)
    need = -(-(max_tokens + greedy_tokens) // CUDA_BLOCK_SIZE) * CUDA_BLOCK_SIZE
    if max_pos and need > max_pos:
        most = max(0, max_pos // CUDA_BLOCK_SIZE * CUDA_BLOCK_SIZE - greedy_tokens)
        raise KVLedgerError(f"--max-tokens {max_tokens:,} and --greedy-tokens {greedy_tokens:,} need {need:,} "
                            f"positions, more than {checkpoint.name}'s context (max_position_embeddings = "
                            f"{max_pos:,}); lower --max-tokens to {most:,} or less")


def run(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from kvledger.plotting import pyplot

    if args.plot:
        pyplot(args.plot)  # a wrong name or a missing matplotlib fails now, not after the run
    check_context(args.model, args.max_tokens, args.greedy_tokens)
    from kvledger.evaluate.kv_quality import QualityConfig, run_kv_quality, to_json

    kinds = tuple(dict.fromkeys(args.kinds or KV_QUALITY_DEFAULT_KINDS))
    cfg = QualityConfig(model=args.model, text=args.text, kv_cache_dtypes=kinds, dtype=args.dtype,
                        max_tokens=args.max_tokens, num_buckets=args.buckets, chunk_tokens=args.chunk,
                        greedy_new_tokens=args.greedy_tokens)
    report = run_kv_quality(cfg, progress=not args.json)
    if args.plot:
        plot_quality(report, args.plot)
    if args.json:
        print_json(to_json(report))
        return 0
    meta = next(iter(report.values())).meta
    print(f"{meta['model']} over {meta['tokens']:,} tokens of {meta['text']}; reference cache {meta['reference']}")
    for name, q in report.items():
        print(f"\n{name}: cache {q.cache_bytes:,} bytes")
        rows = [(f"{b.start:,}-{b.end:,}", f"{b.kl:.5f}", f"{b.top1_agreement:.4f}", f"{b.ppl:.3f}") for b in q.buckets]
        rows.append(("all", f"{q.kl_total:.5f}", f"{q.top1_total:.4f}", f"{q.ppl_total:.3f}"))
        print(tabulate(rows, headers=["positions", "KL (nats)", "top-1 agree", "perplexity"],
                       colalign=("left", "right", "right", "right")))
        diverge = "never" if q.greedy_divergence is None else f"token {q.greedy_divergence}"
        print(f"greedy continuation ({meta['greedy_new_tokens']} tokens after {meta['greedy_prompt_tokens']}) "
              f"parts from the reference at: {diverge}")
    if args.plot:
        print(f"\nplot written to {args.plot}")
    return 0


def plot_quality(report, path: str) -> None:
    """KL, top-1 agreement and perplexity increase per context bucket, one line per cache, to a PNG."""
    from kvledger.plotting import pyplot, save_png

    fig, axes = pyplot(path).subplots(1, 3, figsize=(15, 4.2))
    reference = next(iter(report.values()))  # the unquantized cache comes first
    for name, q in report.items():
        mids = [(b.start + b.end) / 2 for b in q.buckets]
        axes[0].plot(mids, [b.kl for b in q.buckets], marker="o", label=name)
        axes[1].plot(mids, [b.top1_agreement for b in q.buckets], marker="o", label=name)
        axes[2].plot(mids, [100 * (b.ppl / r.ppl - 1) for b, r in zip(q.buckets, reference.buckets)], marker="o", label=name)
    for ax, label in zip(axes, ("mean KL(reference || cache), nats", "top-1 agreement",
                                "perplexity increase over the reference (%)")):
        ax.set(xlabel="context position (tokens)", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("symlog", linthresh=1e-4)
    axes[0].legend()
    meta = reference.meta
    fig.suptitle(f"KV-cache quantization along the context: {meta['model']}, {meta['tokens']:,} tokens")
    save_png(fig, path)
