"""``kvledger kv-bytes``: Equation 2.2 for a model, its seven terms in a table."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import TYPE_CHECKING

from kvledger.cli.common import positive_int, print_json, token_count
from kvledger.cli.flags import add_block_size, add_kv_cache_dtype, add_mamba_ssm_cache_dtype, add_tensor_parallel_size
from kvledger.config import CUDA_BLOCK_SIZE

if TYPE_CHECKING:
    from kvledger.spec import KVBytes, ModelSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kv-bytes", help="Eq 2.2: KV-cache bytes per token and in total for a model",
        description="Equation 2.2, M_kv = 2 L B T H_kv d_h s, for a preset, a config.json, a model directory, "
                    "or a custom spec (--layers --kv-heads --head-dim).")
    p.add_argument("model", nargs="?", help="preset name (e.g. llama-3.1-8b), config.json or model directory")
    add_kv_cache_dtype(p)
    p.add_argument("--tokens", type=token_count, default=1, metavar="T", help="cached tokens per sequence (default 1)")
    p.add_argument("--batch", type=token_count, default=1, metavar="B", help="concurrent sequences (default 1)")
    add_block_size(p, metavar="N",
                   help="tokens per KV block: sliding-window layers keep whole blocks, so they hold between the "
                        f"window and the window + N - 1 tokens, as the engine does (default {CUDA_BLOCK_SIZE}, the "
                        "engine's; 1 counts exactly the window)")
    add_tensor_parallel_size(p, help="tensor-parallel ranks; bytes are then per rank (default 1)")
    add_mamba_ssm_cache_dtype(p)
    custom = p.add_argument_group("custom spec (instead of, or overriding, MODEL)")
    custom.add_argument("--layers", type=positive_int, metavar="L")
    custom.add_argument("--kv-heads", type=positive_int, metavar="H")
    custom.add_argument("--heads", type=positive_int, metavar="H", help="query heads (default: --kv-heads)")
    custom.add_argument("--head-dim", type=positive_int, metavar="D")
    p.add_argument("--list", action="store_true", help="list the bundled presets (and which the engine has weights for) and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def resolve_spec(args: argparse.Namespace):
    """The ModelSpec named by MODEL with --layers/--heads/--kv-heads/--head-dim set in its config, so
    the family's rules and checks apply to them; or a custom spec from those flags alone."""
    from kvledger.errors import ConfigError, KVLedgerError
    from kvledger.spec import ModelSpec, load_model_spec

    given = {flag: value for flag, value in (("--layers", args.layers), ("--heads", args.heads),
                                             ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)) if value}
    if not args.model and not (args.layers and args.kv_heads and args.head_dim):
        raise KVLedgerError("give a MODEL (preset, config.json or directory) or all of --layers, --kv-heads and --head-dim")
    try:
        if not args.model:
            return ModelSpec.custom(args.layers, args.kv_heads, args.head_dim, heads=args.heads)
        spec = load_model_spec(args.model)
        return spec.with_config(**_config_overrides(spec, args)) if given else spec
    except ConfigError as err:
        if not given:
            raise
        raise ConfigError(f"{' '.join(f'{flag} {value}' for flag, value in given.items())}: {err}") from None


def _config_overrides(spec, args: argparse.Namespace) -> dict[str, int]:
    """config.json keys for the flags given. ``d_h`` stays the model's unless --head-dim is given
    (a family that derives it as hidden_size / heads would otherwise change it with --heads); MLA
    caches a latent, not KV heads of ``d_h``, so --kv-heads and --head-dim do not apply to it."""
    from kvledger.errors import KVLedgerError

    keys = {k: v for k, v in (("num_hidden_layers", args.layers), ("num_attention_heads", args.heads),
                              ("num_key_value_heads", args.kv_heads), ("head_dim", args.head_dim)) if v}
    if spec.is_mla:
        for flag, value in (("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
            if value:
                raise KVLedgerError(f"{flag} does not apply to {spec.name}: MLA caches one latent of kv_lora_rank + "
                                  f"qk_rope_head_dim = {spec.kv_lora_rank + spec.qk_rope_head_dim} elements per token "
                                  "per layer, not KV heads")
        if args.heads:  # MLA expands one K and V per attention head
            keys["num_key_value_heads"] = args.heads
    elif args.heads and not args.head_dim:
        keys["head_dim"] = spec.head_dim
    return keys


def run(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from kvledger.spec import kv_bytes, presets
    from kvledger.units import format_bytes

    if args.list:
        from kvledger.spec.names import BUNDLED_WEIGHTS

        installed = {w.config_dir for w in BUNDLED_WEIGHTS if w.checkpoint() is not None}
        for name, path in presets().items():
            engine = "weights installed: the engine runs it" if path.name in installed else ""
            print(f"{name:32s} {path.name:44s} {engine}".rstrip())
        return 0
    spec = resolve_spec(args)
    kb = kv_bytes(spec, args.kv_cache_dtype, tokens=args.tokens, batch=args.batch,
                  tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
                  mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    if args.json:
        print_json({**asdict(kb), "attention": spec.attention_kind, "notes": _notes(spec, kb)})
        return 0
    print(spec.describe())
    print(tabulate([(sym, meaning, f"{value:,}") for sym, meaning, value, _ in kb.terms()],
                   headers=["term", "meaning", "value"], colalign=("left", "left", "right")))
    tp = f" per rank (TP {kb.tensor_parallel_size})" if kb.tensor_parallel_size > 1 else ""
    rows = [(f"bytes per token{tp}", f"{kb.bytes_per_token:,}", format_bytes(kb.bytes_per_token))]
    if kb.scale_bytes_per_token:
        rows.append((f"scale bytes per token{tp}", f"{kb.scale_bytes_per_token:,}", format_bytes(kb.scale_bytes_per_token)))
    if kb.scale_bytes_fixed:
        rows.append(("scale bytes, per-layer k/v scales", f"{kb.scale_bytes_fixed:,}", "fixed, not per token"))
    if kb.num_sliding_layers and kb.sliding_window and kb.tokens > kb.sliding_window:
        rows.append((f"sliding layers hold ({kb.num_sliding_layers} of {kb.num_layers})",
                     f"{kb.sliding_tokens:,} tokens", f"window {kb.sliding_window:,} in blocks of {kb.block_size}"))
    rows.append((f"total (B x T){tp}", f"{kb.total_bytes:,}", format_bytes(kb.total_bytes)))
    if kb.num_state_layers:
        rows.append((f"{kb.state_family} state per request{tp} ({kb.num_state_layers} layers x "
                     f"{kb.state_bytes_per_layer:,})", f"{kb.state_bytes_per_request:,}",
                     "fixed, not per token"))
        rows.append((f"state, B requests{tp}", f"{kb.total_state_bytes:,}", format_bytes(kb.total_state_bytes)))
        if kb.tensor_parallel_size > 1:
            rows.append(("state per request, all ranks", f"{kb.state_bytes_per_request_all_ranks:,}",
                         format_bytes(kb.state_bytes_per_request_all_ranks)))
    if kb.total_scale_bytes:
        with_scales = kb.total_bytes + kb.total_scale_bytes
        rows.append((f"total with scales{tp}", f"{with_scales:,}", format_bytes(with_scales)))
    if kb.tensor_parallel_size > 1:
        rows.append(("total, all ranks", f"{kb.total_bytes_all_ranks:,}", format_bytes(kb.total_bytes_all_ranks)))
    print()
    print(tabulate(rows, headers=["", "bytes", "binary units"], colalign=("left", "right", "right")))
    for note in _notes(spec, kb):
        print(f"note: {note}")
    return 0


def _notes(spec: ModelSpec, kb: KVBytes) -> list[str]:
    """The spec's notes, and one for a tensor-parallel size that splits the KV heads unevenly."""
    return list(spec.notes) + ([kb.uneven_split_note] if kb.uneven_split_note else [])
