"""``ModelSpec``: the attention and weight geometry of a model, read from a Hugging Face ``config.json``.

Only what Eq 2.2 and the planner need is kept: layers, KV heads, head width, which layers
are sliding-window, MLA latent width, MoE expert counts and the sizes needed to count
parameters. Pure Python: no torch, no transformers.

Family defaults: some published files leave fields to the defaults of the model family's
configuration class in transformers. Where that happens the default is applied here, the
same value transformers would use, and recorded in ``ModelSpec.notes`` so the user can see it.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.errors import ConfigError, InputWarning, parse_json
from kvledger.spec.state import (ATTENTION_KINDS, LINEAR, MAMBA, MAMBA1, MAMBA2, STATE_KINDS, StateSpec, layer_kinds,
                                 parallel_state_layers, state_spec)

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
"""Llama 4's local layers: attention within fixed chunks of ``attention_chunk_size`` tokens."""

# Defaults of transformers' configuration classes for keys that published files omit.
# {model_type: {key: default}}; only keys that matter for Eq 2.2 or the weight count.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "head_dim": 256,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "gemma2": {"sliding_window": 4096, "head_dim": 256, "tie_word_embeddings": True},
    "gemma": {"head_dim": 256, "tie_word_embeddings": True},
}

KNOWN_MODEL_TYPES: frozenset[str] = frozenset({
    "llama", "llama4", "llama4_text", "mistral", "mistral3", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "gemma", "gemma2", "gemma3",
    "gemma3_text", "phi", "phi3", "granite", "granitemoehybrid", "deepseek_v2", "deepseek_v3", "gpt_oss",
    "starcoder2", "gpt2", "gpt_neox", "gpt_bigcode", "falcon", "opt", "jamba", "mamba", "mamba2", "falcon_mamba",
    "falcon_h1", "zamba2", "bamba", "nemotron_h", "lfm2", "minimax_text_01", "minimax_m1", "kimi_linear",
})
"""The ``model_type`` values of the bundled presets and of the families this package has rules for
(defaults, which layers slide, hybrid state, weight counts). Any other is read as a generic
decoder from the standard keys, with a warning (:class:`kvledger.errors.InputWarning`)."""

# Families whose ``sliding_window`` applies to every layer when ``layer_types`` is absent.
_ALL_LAYERS_SLIDING = {"mistral", "phi3", "mixtral", "starcoder2"}
# Families whose ``sliding_window`` is only used when ``use_sliding_window`` is true,
# and then only on layers at index >= ``max_window_layers``.
_QWEN_STYLE = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}


@dataclass(frozen=True)
class ModelSpec:
    """Attention and weight geometry of one model. All sizes are counts (not bytes)."""

    name: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None
    torch_dtype: str
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    """Per layer, ``"full_attention"`` or ``"sliding_attention"`` (``"chunked_attention"`` for
    Llama 4's local layers); in a hybrid model also ``"linear_attention"``, ``"mamba"``, ``"conv"``
    (layers with a fixed-size state per request) or ``"no_cache"`` (an MLP-only layer)."""
    sliding_window: int | None
    """Tokens a sliding-window layer keeps; ``None`` when no layer slides."""
    kv_lora_rank: int | None = None
    """MLA only: width of the compressed KV latent per token per layer."""
    qk_rope_head_dim: int | None = None
    """MLA only: width of the decoupled RoPE key, cached beside the latent."""
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int | None = None
    weights_bytes_published: int | None = None
    """``metadata.total_size`` of ``model.safetensors.index.json`` when shipped, in bytes."""
    quant_method: str | None = None
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The parsed ``config.json`` as given (see ``with_config``)."""
    raw_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The language model's own keys (``text_config`` for a multimodal file), family defaults applied."""
    notes: tuple[str, ...] = ()
    source: str = ""
    state: StateSpec | None = None
    """Hybrid models: the geometry of the per-request state its state layers keep (``spec.state``)."""
    num_state_layers: int = 0
    """Layers that keep a fixed-size state per request (linear attention, Mamba, short conv)."""

    # ------------------------------------------------------------------ derived
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_kind(self) -> str:
        """``MLA``, ``MHA`` (H_kv = H), ``MQA`` (H_kv = 1) or ``GQA``."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == SLIDING)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """``layer_types`` with a hybrid's state-space layers named ``"mamba"`` (transformers, and so
        ``layer_types``, calls them ``"linear_attention"`` as it does Gated DeltaNet layers)."""
        if self.state is None or self.state.family not in (MAMBA1, MAMBA2):
            return self.layer_types
        return tuple(MAMBA if t == LINEAR else t for t in self.layer_types)

    @property
    def attention_layer_types(self) -> tuple[str, ...]:
        """The kinds of the layers that keep per-token K and V (all layers but a hybrid's state and MLP layers)."""
        return tuple(t for t in self.layer_types if t in ATTENTION_KINDS)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_types)

    @property
    def num_full_layers(self) -> int:
        return self.num_attention_layers - self.num_sliding_layers

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a fixed-size state per request (a linear-attention or state-space hybrid)."""
        return self.num_state_layers > 0

    def describe(self) -> str:
        kv = f"MLA latent {self.kv_lora_rank}+{self.qk_rope_head_dim}" if self.is_mla else (
            f"{self.attention_kind} {self.num_attention_heads}q/{self.num_kv_heads}kv x {self.head_dim}"
        )
        sliding = f", {self.num_sliding_layers} sliding layers (window {self.sliding_window})" if self.num_sliding_layers else ""
        moe = f", MoE {self.num_experts} experts (top {self.num_experts_per_token})" if self.is_moe else ""
        hybrid = (f" ({self.num_attention_layers} attention, {self.num_state_layers} {self.state.family} state)"
                  if self.state is not None else "")
        return f"{self.name}: {self.num_layers} layers{hybrid}, {kv}{sliding}{moe}"

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_config_dict(
        cls,
        config: dict[str, Any],
        name: str = "custom",
        source: str = "",
        weights_bytes_published: int | None = None,
    ) -> "ModelSpec":
        """Build a spec from a parsed ``config.json``; raises ConfigError naming any missing or bad key."""
        where = source or name
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: config.json must hold a JSON object, got {type(config).__name__}")
        outer = config
        text = config.get("text_config")
        cfg = dict(text) if isinstance(text, dict) else dict(config)
        model_type = str(cfg.get("model_type") or outer.get("model_type") or "unknown")
        _warn_unknown_model_type(cfg.get("model_type") or outer.get("model_type"), where)
        notes: list[str] = []
        if isinstance(text, dict):
            notes.append("read from text_config (multimodal model; the vision tower has no KV cache)")
            cfg.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
            if "tie_word_embeddings" not in cfg and "tie_word_embeddings" in outer:
                cfg["tie_word_embeddings"] = outer["tie_word_embeddings"]
        for key, default in _FAMILY_DEFAULTS.get(model_type, {}).items():
            if cfg.get(key) is None:
                cfg[key] = default
                notes.append(f"{key} = {default} (transformers' default for {model_type}; absent from the file)")

        def need(key: str, *alts: str) -> int:
            for k in (key, *alts):
                if cfg.get(k) is not None:
                    return _positive_int(cfg[k], k, where)
            raise ConfigError(
                f"{where}: config has no '{key}', which Eq 2.2 needs; is this a Hugging Face config.json of a decoder model?"
            )

        num_layers = need("num_hidden_layers", "n_layer", "num_layers")
        num_heads = need("num_attention_heads", "n_head")
        hidden = need("hidden_size", "n_embd", "d_model")
        num_kv = need("num_key_value_heads") if cfg.get("num_key_value_heads") is not None else num_heads
        if cfg.get("head_dim") is not None:
            head_dim = need("head_dim")
        else:
            if hidden % num_heads:
                raise ConfigError(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {num_heads}; give head_dim")
            head_dim = hidden // num_heads
        if num_heads % num_kv:
            raise ConfigError(f"{where}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")

        max_pos = _count(cfg, ("max_position_embeddings",), where) or None
        layer_types, window = _layer_types(cfg, model_type, num_layers, max_pos, where, notes)
        kinds = layer_kinds(cfg, model_type, num_layers, where)
        state, num_state = None, parallel_state_layers(cfg, model_type, num_layers)
        if kinds is not None:
            # transformers' names: a Mamba layer is a "linear_attention" layer (its GraniteMoeHybrid and
            # Qwen3-Next configs say so); ``layer_kinds`` tells the state-space ones apart
            layer_types = tuple(LINEAR if k == MAMBA else k if k != FULL or t != SLIDING else t
                                for k, t in zip(kinds, layer_types))
            num_state = sum(1 for k in kinds if k in STATE_KINDS)
            if not any(t == SLIDING for t in layer_types):
                window = None
        if num_state:
            state = state_spec(cfg, model_type, hidden, where)
            notes.append(f"hybrid: {num_state} of {num_layers} layers keep a fixed-size {state.family} state per "
                         f"request; {sum(1 for t in layer_types if t in ATTENTION_KINDS)} attention layers keep K and V")
        kv_lora_rank = rope_dim = None
        if cfg.get("kv_lora_rank") is not None:
            kv_lora_rank = need("kv_lora_rank")
            rope_dim = _count(cfg, ("qk_rope_head_dim",), where)
            notes.append(f"MLA: one latent of kv_lora_rank + qk_rope_head_dim = {kv_lora_rank + rope_dim} elements per token per layer")

        quant = cfg.get("quantization_config") or outer.get("quantization_config") or {}
        torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or outer.get("torch_dtype")
        if not torch_dtype:
            notes.append("torch_dtype absent: bfloat16 assumed")
        return cls(
            name=name,
            model_type=model_type,
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=_count(cfg, ("intermediate_size", "n_inner"), where) or 4 * hidden,
            vocab_size=_count(cfg, ("vocab_size",), where),
            max_position_embeddings=max_pos,
            torch_dtype=str(torch_dtype or "bfloat16"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            layer_types=layer_types,
            sliding_window=window,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope_dim,
            num_experts=_count(cfg, ("num_local_experts", "num_experts", "n_routed_experts"), where),
            num_experts_per_token=_count(cfg, ("num_experts_per_tok", "experts_per_token", "num_experts_per_token"), where),
            moe_intermediate_size=_count(cfg, ("moe_intermediate_size",), where) or None,
            weights_bytes_published=weights_bytes_published,
            quant_method=quant.get("quant_method") if isinstance(quant, dict) else None,
            config=config,
            raw_config=cfg,
            notes=tuple(notes),
            source=source,
            state=state,
            num_state_layers=num_state,
        )

    @classmethod
    def custom(cls, layers: int, kv_heads: int, head_dim: int, heads: int | None = None,
               torch_dtype: str = "bfloat16", name: str = "custom") -> "ModelSpec":
        """A bare decoder with Eq 2.2's geometry only: ``layers`` layers, ``heads`` query heads
        (default ``kv_heads``) over ``kv_heads`` KV heads of ``head_dim`` elements, hidden size
        ``heads x head_dim``. Checked as any config is."""
        heads = heads or kv_heads
        return cls.from_config_dict({
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "hidden_size": heads * head_dim, "torch_dtype": torch_dtype,
        }, name=name)

    def with_config(self, **keys: Any) -> "ModelSpec":
        """This model rebuilt from its config with ``keys`` (config.json names) set, in
        ``text_config`` for a multimodal file, so that the family's rules (which layers slide,
        defaults) and every check apply again. Raises ConfigError as parsing does. The published
        checkpoint size no longer describes a changed geometry and is dropped."""
        config = dict(self.config)
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"], **keys}
        else:
            config.update(keys)
        return ModelSpec.from_config_dict(config, name=self.name, source=self.source)

    @classmethod
    def from_path(cls, path: str | Path, name: str | None = None) -> "ModelSpec":
        """From a ``config.json`` file or a model directory holding one (and maybe an index)."""
        p = Path(path)
        config_file = p / "config.json" if p.is_dir() else p
        if not config_file.exists():
            where = f"directory {p} has no config.json" if p.is_dir() else f"no such file: {p}"
            raise ConfigError(f"{where}; give a config.json, a model directory or a preset name (kvledger kv-bytes --list)")
        config = read_config(config_file)
        index = config_file.parent / "model.safetensors.index.json"
        published = None
        if index.exists():
            meta = _read_json(index, "a safetensors index", "fix or remove it")
            meta = meta.get("metadata") if isinstance(meta, dict) else None
            total = meta.get("total_size") if isinstance(meta, dict) else None
            published = int(total) if total else None
        return cls.from_config_dict(config, name=name or config_file.parent.name, source=str(config_file),
                                    weights_bytes_published=published)

    def with_overrides(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def _warn_unknown_model_type(model_type: Any, where: str) -> None:
    """An :class:`InputWarning` when the config names a ``model_type`` outside ``KNOWN_MODEL_TYPES``
    (none named: a bare geometry, nothing to doubt)."""
    if model_type and str(model_type) not in KNOWN_MODEL_TYPES:
        warnings.warn(InputWarning(
            f"{where}: model_type {reprlib.repr(str(model_type))} is not a family kvledger knows; it is read as a "
            "generic decoder from the standard keys (every layer full attention unless layer_types or "
            "sliding_window says otherwise): check the model_type, or the numbers against the model's card"),
            stacklevel=3)


MAX_CONFIG_COUNT = 2**31 - 1
"""The largest count a config key may hold (vLLM and torch index with int32)."""
MAX_CONFIG_LAYERS = 10_000
"""The most layers a config may declare (published models have at most a few hundred)."""


def _positive_int(value: Any, key: str, where: str) -> int:
    """``value`` as a positive int of at most ``MAX_CONFIG_COUNT`` (``MAX_CONFIG_LAYERS`` for a
    layer count), or a ConfigError that names the key."""
    if isinstance(value, str):  # "32" in a hand-written file: a typo to show, not a count to guess
        raise ConfigError(f"{where}: '{key}' must be a positive integer, got the string {reprlib.repr(value)}; "
                          f"write it as a JSON number, without quotes")
    try:
        number = int(value)
        exact = not isinstance(value, bool) and float(value) == number
    except (TypeError, ValueError, OverflowError):
        number, exact = 0, False
    if not exact or number <= 0:
        raise ConfigError(f"{where}: '{key}' must be a positive integer, got {reprlib.repr(value)}")
    limit = MAX_CONFIG_LAYERS if key in ("num_hidden_layers", "n_layer", "num_layers") else MAX_CONFIG_COUNT
    if number > limit:
        raise ConfigError(f"{where}: '{key}' = {reprlib.repr(value)} is larger than any model has (at most {limit:,})")
    return number


def _count(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> int:
    """The first of ``keys`` set to a non-zero value, as a positive int (ConfigError naming the key
    otherwise); 0 when none is set."""
    for key in keys:
        if cfg.get(key):
            return _positive_int(cfg[key], key, where)
    return 0


CONFIG_HINT = "give a Hugging Face config.json"


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object a model's ``config.json`` at ``path`` holds; a one-line :class:`ConfigError`
    saying the file is not a model's config otherwise (not text, not JSON, not an object)."""
    config = _read_json(path, "a model's config", CONFIG_HINT)
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a model's config: its JSON is a {type(config).__name__}, not an object; "
                          f"{CONFIG_HINT}")
    return config


def _read_json(path: Path, what: str, hint: str) -> Any:
    """The parsed JSON file at ``path``; the message says it is not ``what``, then ``hint``."""
    try:
        return parse_json(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not {what}: not valid JSON (line {err.lineno}: {err.msg}); {hint}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not {what}: not a text file; {hint}") from None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None


def _layer_types(cfg: dict[str, Any], model_type: str, num_layers: int, max_pos: int | None, where: str,
                 notes: list[str]) -> tuple[tuple[str, ...], int | None]:
    """Which layers slide, following the rule transformers uses for the family, and the window."""
    explicit = cfg.get("layer_types")
    if explicit is not None and not (isinstance(explicit, list) and all(isinstance(t, str) for t in explicit)):
        raise ConfigError(f"{where}: 'layer_types' must be a list of names such as 'full_attention', "
                          f"got {reprlib.repr(explicit)}")
    if explicit:
        if len(explicit) != num_layers:
            raise ConfigError(f"{where}: layer_types has {len(explicit)} entries but num_hidden_layers is {num_layers}")
        types = tuple(SLIDING if t == SLIDING else FULL for t in explicit)
    elif model_type == "llama4_text" and cfg.get("attention_chunk_size"):
        # transformers' Llama4TextConfig: the RoPE layers attend within chunks, every 4th (NoPE) is global
        nope = cfg.get("no_rope_layers")
        if not isinstance(nope, list) or len(nope) != num_layers:
            nope = [int((i + 1) % 4 != 0) for i in range(num_layers)]
        types = tuple(CHUNKED if rope else FULL for rope in nope)
        notes.append(f"llama4: RoPE layers attend within chunks of {cfg['attention_chunk_size']} tokens, every 4th "
                     "layer is global (transformers' rule); a chunked layer is counted in full (no saving below "
                     "one chunk)")
    elif cfg.get("sliding_window") is None:
        types = (FULL,) * num_layers
    elif model_type in _QWEN_STYLE:
        if cfg.get("use_sliding_window"):
            start = _count(cfg, ("max_window_layers",), where)
            types = tuple(SLIDING if i >= start else FULL for i in range(num_layers))
        else:
            types = (FULL,) * num_layers
    elif model_type == "gemma2":
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
        notes.append("gemma2: layers alternate sliding/full (transformers' rule)")
    elif model_type.startswith("gemma3"):
        pattern = _count(cfg, ("sliding_window_pattern",), where) or 6
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
        notes.append(f"gemma3: every {pattern}th layer is full attention, the rest slide (transformers' rule)")
    elif model_type in _ALL_LAYERS_SLIDING:
        types = (SLIDING,) * num_layers
    else:
        types = (FULL,) * num_layers
    if SLIDING not in types:
        return types, None
    window = _positive_int(cfg.get("sliding_window"), "sliding_window", where)
    if max_pos is not None and window >= max_pos:
        notes.append(f"sliding_window {window} >= max_position_embeddings {max_pos}: no layer ever drops a token")
    return types, window
