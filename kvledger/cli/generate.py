"""``kvledger generate``: run the engine on one prompt, streaming text, then print the KV ledger."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvledger.cli.common import positive_int, signed_seed
    from kvledger.cli.engine_args import add_engine_args

    p = subparsers.add_parser(
        "generate", help="generate text with the paged-KV engine and print its KV ledger",
        description="Generate from PROMPT with the engine (paged KV cache, prefix caching, continuous batching). "
                    "Text streams to stdout as it is produced, then the ledger: blocks, tokens, waste, prefix-cache "
                    "hits and cache bytes, Eq 2.2 prediction versus the real tensors. --json prints one object.")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    p.add_argument("--max-tokens", type=positive_int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="F", help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="F", help="nucleus sampling mass (default 1, off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest (default 0, off)")
    p.add_argument("--seed", type=signed_seed, default=None, metavar="N", help="sampling seed")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message with the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, finish_reason, kv")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvledger.cli.engine_args import engine_config_from_args
    from kvledger.engine.limits import check_before_loading
    from kvledger.engine.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    config = engine_config_from_args(args)
    check_before_loading(config, args.max_tokens)  # the model's name and the token limits, in seconds
    from kvledger.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(args.prompt)
    engine.add_request("0", ids, sampling, prompt=args.prompt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not args.json and out.text_delta:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
            if out.finished:
                final = out
    engine.shutdown()  # the tensor-parallel ranks, if any
    ledger = engine.ledger()
    assert final is not None
    completion = final.outputs[0]
    if args.json:
        from kvledger.cli.common import print_json

        kv = asdict(ledger)
        kv["model"] = engine.model_name
        print_json({"text": completion.text, "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason, "prompt_tokens": len(ids),
                    "num_cached_tokens": final.num_cached_tokens, "kv": kv})
        return 0
    sys.stdout.write("\n\n")
    print(_ledger_table(ledger, engine.model_name, len(ids), completion))
    return 0


def _ledger_table(ledger, model: str, prompt_tokens: int, completion) -> str:  # type: ignore[no-untyped-def]
    from tabulate import tabulate

    from kvledger.units import format_bytes

    bs = ledger.block_size
    rows = [
        ("model", model),
        ("finish reason", f"{completion.finish_reason} after {len(completion.token_ids)} tokens "
                          f"(prompt {prompt_tokens} tokens)"),
        ("KV blocks", f"{ledger.num_blocks} x {bs} tokens; peak allocated {ledger.blocks_allocated_peak} "
                      f"({ledger.blocks_allocated_peak * bs} token slots)"),
        ("bytes per token (Eq 2.2)", f"{ledger.bytes_per_token:,} B = {format_bytes(ledger.bytes_per_token)} "
                                     f"({ledger.kv_cache_dtype} cache)"),
    ]
    if len(ledger.groups) > 1:  # a hybrid model: one row per KV-cache group
        for i, g in enumerate(ledger.groups):
            kind = f"sliding window {g.sliding_window}" if g.sliding_window else "full attention"
            rows.append((f"KV group {i}", f"{kind}, layers {','.join(map(str, g.layers))}: peak "
                                          f"{g.blocks_allocated_peak} blocks"))
        rows.append(("bytes per block", f"{ledger.bytes_per_block:,} B (one group's {len(ledger.groups[0].layers)} layers)"))
    if ledger.scale_bytes:
        rows.append(("scale bytes", f"{ledger.scale_bytes_per_token:,} B per token; {ledger.scale_bytes:,} B in the pool"))
    rows += [
        ("predicted pool bytes", f"{ledger.predicted_bytes:,} B = {format_bytes(ledger.predicted_bytes)}"),
        ("measured pool bytes", f"{ledger.measured_bytes:,} B "
                                f"({'equal' if ledger.measured_bytes == ledger.predicted_bytes else 'DIFFERENT'})"),
    ]
    if ledger.ranks > 1:
        rows.append(("tensor-parallel ranks", f"{ledger.ranks}; measured bytes per rank "
                                              f"{', '.join(f'{b:,}' for b in ledger.measured_bytes_by_rank)} B "
                                              f"(pool bytes above: all ranks)"))
    rows += [
        ("prefix cache", f"{ledger.prefix_cache_hits} of {ledger.prefix_cache_queries} tokens hit"),
        ("preemptions", str(ledger.num_preemptions)),
        ("free blocks holding cached prefixes", str(ledger.blocks_cached_free)),
    ]
    off = ledger.offload
    if off is not None:
        where = f"files in {off.path}" if off.backend == "disk" else "host memory"
        rows += [
            (f"second KV tier ({where})", f"{off.stored_blocks} of {off.capacity_blocks} blocks stored, "
                                          f"{off.bytes:,} B = {format_bytes(off.bytes)}"),
            ("tier-2 hits", f"{off.hits} of {off.queries} tokens asked of it were loaded"),
        ]
    return tabulate(rows, tablefmt="simple")
