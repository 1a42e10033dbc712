"""``kvledger bench serve``: replay a trace against an OpenAI-compatible server (vLLM's metrics)."""

from __future__ import annotations

import argparse
import shlex
from datetime import datetime, timezone

from kvledger.cli.common import length_scale, positive_float, positive_int, request_rate, seed, time_scale


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks against a running server",
                              description="Benchmarks. 'kvledger bench serve' measures any OpenAI-compatible server.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=type(p))
    sub.required = True
    s = sub.add_parser(
        "serve", help="replay a trace against an OpenAI-compatible server: TTFT, TPOT, ITL, E2EL, throughput",
        description="Replay a request trace (Azure CSV, Mooncake JSONL, or a generic CSV/JSONL with input and "
                    "output lengths), scaled, at a request rate, against any OpenAI-compatible /v1/completions "
                    "server. Metrics have vLLM's 'bench serve' definitions.")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default http://127.0.0.1:8000)")
    s.add_argument("--endpoint", default="/v1/completions", help="completions path (default /v1/completions)")
    s.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--trace", required=True, help="trace file: .csv (Azure or generic) or .jsonl (Mooncake or generic)")
    s.add_argument("--num-prompts", type=positive_int, default=64, help="requests to send (default 64)")
    s.add_argument("--sample", choices=["random", "head"], default="random",
                   help="pick rows at random with --seed, or the first ones (default random)")
    s.add_argument("--length-scale", type=length_scale, default=1.0,
                   help="multiply prompt and output lengths by this, e.g. 0.25 (default 1)")
    s.add_argument("--max-model-len", type=positive_int, default=None,
                   help="cut prompts so prompt + output fits this many tokens")
    s.add_argument("--request-rate", type=request_rate, default=float("inf"),
                   help="requests/s (Poisson), 'inf' for all at once, or 'trace' for the trace's timestamps "
                        "(default inf)")
    s.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier (default 1)")
    s.add_argument("--time-scale", type=time_scale, default=1.0,
                   help="with --request-rate trace: divide the trace's times by this (default 1)")
    s.add_argument("--max-concurrency", type=positive_int, default=None, help="cap on requests in flight")
    s.add_argument("--seed", type=seed, default=0, help="seed for row sampling, token ids and arrivals (default 0)")
    s.add_argument("--id-seed", type=seed, default=None,
                   help="seed for the prompts' token ids alone (default: --seed); another value sends the same "
                        "requests with fresh ids, which a server's prefix cache has not seen")
    s.add_argument("--vocab-size", type=positive_int, default=32000,
                   help="random prompt token ids are drawn below this (default 32000)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="ask for all max_tokens (vLLM's ignore_eos), so outputs have the trace's lengths")
    s.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send prompts as token ids, or as text decoded with --tokenizer (default ids)")
    s.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for text prompts and for counting tokens when the server sends no usage")
    s.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles (default 50,90,99)")
    s.add_argument("--json", action="store_true", help="print the metrics as JSON")
    s.add_argument("--markdown", metavar="FILE", default=None,
                   help="also append the result (command and tables) to this Markdown file, e.g. results.md; "
                        "without it nothing is written")
    s.set_defaults(func=run)


_FLAGS = ["base_url", "endpoint", "model", "trace", "num_prompts", "sample", "length_scale", "max_model_len",
          "request_rate", "burstiness", "time_scale", "max_concurrency", "seed", "vocab_size", "prompt_format",
          "tokenizer", "percentiles"]


def _command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (API key left out)."""
    words = ["kvledger", "bench", "serve"]
    for name in _FLAGS:
        value = getattr(args, name)
        if value is not None:
            words += [f"--{name.replace('_', '-')}", str(value)]
    if args.ignore_eos:
        words.append("--ignore-eos")
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import asdict

    from kvledger.cli.common import print_json
    from kvledger.errors import KVLedgerError
    from kvledger.loadgen.serve import BenchConfig, format_report, run_benchmark

    try:
        percentiles = tuple(float(p) for p in args.percentiles.split(","))
    except ValueError:
        raise KVLedgerError(f"--percentiles {args.percentiles!r}: give numbers separated by commas") from None
    cfg = BenchConfig(base_url=args.base_url, trace=args.trace, model=args.model, endpoint=args.endpoint,
                      num_prompts=args.num_prompts, length_scale=args.length_scale, request_rate=args.request_rate,
                      burstiness=args.burstiness, time_scale=args.time_scale, max_concurrency=args.max_concurrency,
                      seed=args.seed, id_seed=args.id_seed, sample=args.sample, vocab_size=args.vocab_size,
                      max_model_len=args.max_model_len, api_key=args.api_key, ignore_eos=args.ignore_eos,
                      prompt_format=args.prompt_format, tokenizer=args.tokenizer, percentiles=percentiles)
    metrics, info = asyncio.run(run_benchmark(cfg, progress=True))  # the bar on stderr, the report on stdout
    if args.json:
        print_json({"info": info, "metrics": asdict(metrics)})
    else:
        print(format_report(metrics, info))
    if args.markdown:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        append_markdown(args.markdown, f"\n`{_command_line(args)}` ({stamp})\n\n"
                                       + format_report(metrics, info, tablefmt="github") + "\n")
    return 0 if metrics.completed else 1


def append_markdown(path: str, text: str) -> None:
    """Append ``text`` to the Markdown file ``path``; a file that cannot be written is a KVLedgerError."""
    from kvledger.errors import KVLedgerError

    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as err:
        raise KVLedgerError(f"cannot append to --markdown {path}: {err.strerror or err}") from None
