"""Per-request recurrent state of hybrid models: which layers keep it, and its bytes, with vLLM's rules.

A hybrid model (Qwen3-Next, Qwen3.5, granite-4.0-h, Nemotron-H, Falcon-H1, Jamba, LFM2, MiniMax,
Kimi Linear, ...) keeps per-token K and V only in its attention layers. Every other layer with a
cache keeps a fixed-size state per request however long the context: a convolution window and an
SSM or delta-rule state. This module reads the state's geometry from ``config.json`` and sizes it
on one tensor-parallel rank the way vLLM 0.32 does
(``vllm/model_executor/layers/mamba/mamba_utils.py``, ``MambaStateShapeCalculator`` and
``MambaStateDtypeCalculator``; each model's ``get_mamba_state_shape_from_config``).

Families and the state of one layer on one rank (``tp`` ranks; ``/`` is an exact division, as
vLLM's ``divide`` asserts):

* **Mamba1** (Jamba, Mamba): conv ``(k - 1) x I/tp`` and SSM ``I/tp x N``, ``I`` the inner width.
* **Mamba2** (granite-4.0-h, Bamba, Nemotron-H, Falcon-H1, Zamba2, Mamba2): the ``G`` groups are
  padded up to ``tp`` when ``tp`` does not divide them (vLLM's ``extra_groups_for_head_shards``);
  conv ``(k - 1) x (I + 2 G N)/tp``, SSM ``heads/tp x head_dim x N``.
* **Gated DeltaNet** (Qwen3-Next, Qwen3.5): conv ``(k - 1) x (2 Hk dk + Hv dv)/tp``,
  state ``Hv/tp x dv x dk``.
* **Short conv** (LFM2): conv ``(k - 1) x C/tp``.
* **MiniMax linear attention**: state ``H/tp x d x d``.
* **Kimi delta attention**: conv ``(k - 1) x (H d + 2 Hk dk)/tp``, state ``H/tp x d x d`` in float32.

Dtypes: the conv state (and a linear-attention state) takes the cache dtype of the state, vLLM's
``--mamba-cache-dtype``, ``auto`` being the model dtype (not ``--kv-cache-dtype``: an fp8 KV cache
leaves the state as it is). The SSM state takes ``--mamba-ssm-cache-dtype`` when given, else the
config's ``mamba_ssm_cache_dtype`` (Nemotron-H, float32 when absent) or ``mamba_ssm_dtype``
(Qwen3.5), else the conv state's dtype. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.errors import ConfigError, KVLedgerError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"
"""A linear-attention layer (Gated DeltaNet, MiniMax lightning attention, Kimi delta attention)."""
MAMBA = "mamba"
"""A state-space layer (Mamba1 or Mamba2)."""
CONV = "conv"
"""A short-convolution layer (LFM2)."""
NO_CACHE = "no_cache"
"""A layer that keeps nothing per request (Nemotron-H's MLP and MoE layers)."""
STATE_KINDS = (LINEAR, MAMBA, CONV)
"""Layer kinds that keep a fixed-size state per request instead of per-token K and V."""
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)

MAMBA1, MAMBA2, GDN, SHORT_CONV, MINIMAX, KDA = ("mamba1", "mamba2", "gated_deltanet", "short_conv",
                                              "minimax_linear", "kimi_delta")
STATE_FAMILIES = (MAMBA1, MAMBA2, GDN, SHORT_CONV, MINIMAX, KDA)

MAMBA_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""vLLM's ``--mamba-ssm-cache-dtype`` / ``--mamba-cache-dtype`` choices (``auto`` aside)."""
MAMBA_SSM_CACHE_DTYPES = ("auto", *MAMBA_DTYPE_BYTES)

# Families whose vLLM model class reads the SSM dtype from the config, and its default there.
_CONFIG_SSM_DTYPE_KEYS = ("mamba_ssm_cache_dtype", "mamba_ssm_dtype")
_FAMILY_SSM_DTYPE_DEFAULT = {"nemotron_h": "float32"}
"""``NemotronHForCausalLMConfig.DEFAULT_MAMBA_SSM_CACHE_DTYPE`` (vLLM: "only float32 is known to
have no accuracy issues")."""


@dataclass(frozen=True)
class StateSpec:
    """The recurrent-state geometry of a hybrid model's state layers (counts, not bytes)."""

    family: str
    """One of ``STATE_FAMILIES``."""
    conv_kernel: int = 0
    """Convolution width ``k``: the conv state keeps ``k - 1`` positions (0: no conv state)."""
    conv_dim: int = 0
    """Channels of the convolution before TP (Mamba2: without the groups' share, see ``n_groups``)."""
    inner_size: int = 0
    """Mamba: the inner width ``I`` (``expand x hidden``)."""
    n_groups: int = 0
    """Mamba2: B/C groups ``G`` (padded up to TP where TP does not divide them)."""
    num_heads: int = 0
    """Mamba2 SSM heads; GDN value heads; linear-attention and KDA heads."""
    head_dim: int = 0
    """Mamba2 head width; GDN value head width; linear-attention and KDA head width."""
    state_size: int = 0
    """Mamba ``d_state``; GDN key head width ``dk``."""
    num_k_heads: int = 0
    """GDN / KDA key heads."""
    ssm_dtype_from_config: str | None = None
    """The config's SSM-state dtype (``mamba_ssm_cache_dtype`` / ``mamba_ssm_dtype``) or the family default."""


@dataclass(frozen=True)
class StateBytes:
    """One state layer's per-request state on one rank, bytes."""

    family: str
    conv_bytes: int
    ssm_bytes: int
    conv_dtype: str
    ssm_dtype: str
    shapes: tuple[tuple[int, ...], ...]
    """vLLM's state shapes on one rank (conv first, as vLLM lists them)."""

    @property
    def page_bytes(self) -> int:
        """vLLM's unpadded ``MambaSpec.page_size_bytes``: the whole state of one layer."""
        return self.conv_bytes + self.ssm_bytes


def _int(cfg: dict[str, Any], where: str, *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
                raise ConfigError(f"{where}: '{key}' must be a positive integer, got {value!r}")
            return int(value)
    if default is not None:
        return default
    raise ConfigError(f"{where}: a hybrid model's state needs '{keys[0]}', absent from the config")


def layer_kinds(cfg: dict[str, Any], model_type: str, num_layers: int, where: str) -> tuple[str, ...] | None:
    """Per layer, its kind when the config declares linear-attention or state-space layers, from
    any of the ways configs say it; ``None`` for a model with attention layers only."""
    explicit = cfg.get("layer_types")
    names = {"full_attention": FULL, "attention": FULL, "sliding_attention": SLIDING, "linear_attention": LINEAR,
             "mamba": MAMBA, "mamba2": MAMBA, "conv": CONV, "mlp": NO_CACHE, "moe": NO_CACHE}
    if isinstance(explicit, list) and any(t in ("linear_attention", "mamba", "mamba2", "conv") for t in explicit):
        unknown = sorted({t for t in explicit if t not in names})
        if unknown:
            raise ConfigError(f"{where}: layer_types has kinds kvledger does not know: {', '.join(map(str, unknown))}")
        return _checked([names[t] for t in explicit], num_layers, "layer_types", where)
    blocks = cfg.get("layers_block_type")
    if isinstance(blocks, list) and blocks:
        unknown = sorted({t for t in blocks if t not in names})
        if unknown:
            raise ConfigError(f"{where}: layers_block_type has kinds kvledger does not know: {', '.join(map(str, unknown))}")
        return _checked([names[t] for t in blocks], num_layers, "layers_block_type", where)
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:  # Nemotron-H: M mamba, * attention, - MLP, E MoE
        table = {"M": MAMBA, "*": FULL, "-": NO_CACHE, "E": NO_CACHE}
        bad = sorted(set(pattern) - set(table))
        if bad:
            raise ConfigError(f"{where}: hybrid_override_pattern has symbols kvledger does not know: {''.join(bad)}")
        return _checked([table[c] for c in pattern], num_layers, "hybrid_override_pattern", where)
    if cfg.get("full_attention_interval") and model_type.startswith(("qwen3_next", "qwen3_5")):
        every = _int(cfg, where, "full_attention_interval")
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(num_layers))
    indices = cfg.get("attn_layer_indices")
    if isinstance(indices, list) and _mamba_keys(cfg):
        return tuple(FULL if i in indices else MAMBA for i in range(num_layers))
    if cfg.get("attn_layer_period") and _mamba_keys(cfg):  # Jamba
        period = _int(cfg, where, "attn_layer_period")
        offset = int(cfg.get("attn_layer_offset") or 0)
        return tuple(FULL if i % period == offset else MAMBA for i in range(num_layers))
    attn_types = cfg.get("attn_type_list")  # MiniMax-Text-01 / M1: 0 lightning (linear), 1 softmax
    if isinstance(attn_types, list) and attn_types:
        return _checked([FULL if t == 1 else LINEAR for t in attn_types], num_layers, "attn_type_list", where)
    linear = cfg.get("linear_attn_config")  # Kimi Linear: 1-based indices of the KDA and full layers
    if isinstance(linear, dict) and isinstance(linear.get("kda_layers"), list):
        kda = {int(i) - 1 for i in linear["kda_layers"]}
        return tuple(LINEAR if i in kda else FULL for i in range(num_layers))
    if model_type == "falcon_h1":  # attention and Mamba2 side by side in every layer: counted apart
        return None
    if model_type in ("mamba", "mamba2", "falcon_mamba"):
        return (MAMBA,) * num_layers
    return None


def _checked(kinds: list[str], num_layers: int, key: str, where: str) -> tuple[str, ...]:
    if len(kinds) != num_layers:
        raise ConfigError(f"{where}: {key} has {len(kinds)} entries but num_hidden_layers is {num_layers}")
    return tuple(kinds)


def _mamba_keys(cfg: dict[str, Any]) -> bool:
    return any(k in cfg for k in ("mamba_d_state", "mamba_expand", "ssm_state_size", "mamba_n_heads"))


def parallel_state_layers(cfg: dict[str, Any], model_type: str, num_layers: int) -> int:
    """State layers that sit beside an attention layer (Falcon-H1: every layer has both); 0 elsewhere."""
    return num_layers if model_type == "falcon_h1" else 0


def state_spec(cfg: dict[str, Any], model_type: str, hidden: int, where: str) -> StateSpec:
    """The state geometry of a model whose config declares state layers (``layer_kinds``)."""
    ssm_dtype = next((str(cfg[k]) for k in _CONFIG_SSM_DTYPE_KEYS if cfg.get(k)), None)
    ssm_dtype = ssm_dtype or _FAMILY_SSM_DTYPE_DEFAULT.get(model_type)
    if ssm_dtype is not None and ssm_dtype not in MAMBA_DTYPE_BYTES:
        raise ConfigError(f"{where}: the config's SSM-state dtype {ssm_dtype!r} is not one of "
                          f"{', '.join(MAMBA_DTYPE_BYTES)}")
    if "linear_num_value_heads" in cfg:  # Gated DeltaNet
        return StateSpec(GDN, conv_kernel=_int(cfg, where, "linear_conv_kernel_dim"),
                         num_heads=_int(cfg, where, "linear_num_value_heads"),
                         head_dim=_int(cfg, where, "linear_value_head_dim"),
                         num_k_heads=_int(cfg, where, "linear_num_key_heads"),
                         state_size=_int(cfg, where, "linear_key_head_dim"), ssm_dtype_from_config=ssm_dtype)
    linear = cfg.get("linear_attn_config")
    if isinstance(linear, dict):  # Kimi delta attention
        heads, dim = _int(linear, where, "num_heads"), _int(linear, where, "head_dim")
        return StateSpec(KDA, conv_kernel=_int(linear, where, "short_conv_kernel_size", default=4), num_heads=heads,
                         head_dim=dim, num_k_heads=heads, state_size=dim)
    if isinstance(cfg.get("attn_type_list"), list):  # MiniMax lightning attention
        heads = _int(cfg, where, "num_attention_heads")
        dim = _int(cfg, where, "head_dim", default=hidden // heads)
        return StateSpec(MINIMAX, num_heads=heads, head_dim=dim)
    if "conv_L_cache" in cfg:  # LFM2 short convolutions
        return StateSpec(SHORT_CONV, conv_kernel=_int(cfg, where, "conv_L_cache"), conv_dim=_int(cfg, where, "conv_dim"))
    if model_type in ("jamba", "mamba", "falcon_mamba"):  # Mamba1
        if model_type == "jamba":
            inner = _int(cfg, where, "mamba_expand") * hidden
            return StateSpec(MAMBA1, conv_kernel=_int(cfg, where, "mamba_d_conv"), inner_size=inner,
                             state_size=_int(cfg, where, "mamba_d_state"), ssm_dtype_from_config=ssm_dtype)
        return StateSpec(MAMBA1, conv_kernel=_int(cfg, where, "conv_kernel"),
                         inner_size=_int(cfg, where, "intermediate_size"), state_size=_int(cfg, where, "state_size"),
                         ssm_dtype_from_config=ssm_dtype)
    # Mamba2, under each family's key names
    if model_type == "nemotron_h":
        heads, head_dim = _int(cfg, where, "mamba_num_heads"), _int(cfg, where, "mamba_head_dim")
        return StateSpec(MAMBA2, conv_kernel=_int(cfg, where, "conv_kernel"), inner_size=heads * head_dim,
                         n_groups=_int(cfg, where, "n_groups"), num_heads=heads, head_dim=head_dim,
                         state_size=_int(cfg, where, "ssm_state_size"), ssm_dtype_from_config=ssm_dtype)
    if model_type == "zamba2":
        return StateSpec(MAMBA2, conv_kernel=_int(cfg, where, "mamba_d_conv"),
                         inner_size=_int(cfg, where, "mamba_expand") * hidden,
                         n_groups=_int(cfg, where, "mamba_ngroups"), num_heads=_int(cfg, where, "n_mamba_heads"),
                         head_dim=_int(cfg, where, "mamba_headdim"), state_size=_int(cfg, where, "mamba_d_state"),
                         ssm_dtype_from_config=ssm_dtype)
    if model_type == "mamba2":
        return StateSpec(MAMBA2, conv_kernel=_int(cfg, where, "conv_kernel"),
                         inner_size=_int(cfg, where, "expand") * hidden, n_groups=_int(cfg, where, "n_groups"),
                         num_heads=_int(cfg, where, "num_heads"), head_dim=_int(cfg, where, "head_dim"),
                         state_size=_int(cfg, where, "state_size"), ssm_dtype_from_config=ssm_dtype)
    if "mamba_d_state" in cfg:  # granite-4.0-h (granitemoehybrid), Bamba, Falcon-H1
        inner = cfg.get("mamba_d_ssm") or int(_int(cfg, where, "mamba_expand") * hidden)
        return StateSpec(MAMBA2, conv_kernel=_int(cfg, where, "mamba_d_conv"), inner_size=int(inner),
                         n_groups=_int(cfg, where, "mamba_n_groups"), num_heads=_int(cfg, where, "mamba_n_heads"),
                         head_dim=_int(cfg, where, "mamba_d_head"), state_size=_int(cfg, where, "mamba_d_state"),
                         ssm_dtype_from_config=ssm_dtype)
    raise ConfigError(f"{where}: the config declares state-space or linear-attention layers, but kvledger does not "
                      f"know the state geometry of model_type {model_type!r}")


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise KVLedgerError(f"tensor-parallel size {tp} does not divide the {n} {what} of the state layers "
                            "(vLLM requires it)")
    return n // tp


def extra_groups_for_head_shards(n_groups: int, tp: int) -> int:
    """Groups vLLM adds so that every rank holds the groups its Mamba2 heads need: 0 when ``tp``
    divides ``n_groups``, else ``tp - n_groups``."""
    return 0 if n_groups % tp == 0 else tp - n_groups


def state_bytes(state: StateSpec, tp: int = 1, model_dtype: str = "bfloat16",
                mamba_ssm_cache_dtype: str = "auto", mamba_cache_dtype: str = "auto") -> StateBytes:
    """One state layer's per-request state on one of ``tp`` ranks, with vLLM's shapes and dtypes."""
    if mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
        raise KVLedgerError(f"unknown --mamba-ssm-cache-dtype {mamba_ssm_cache_dtype!r}; choose one of "
                            f"{', '.join(MAMBA_SSM_CACHE_DTYPES)}")
    conv_dtype = model_dtype if mamba_cache_dtype == "auto" else mamba_cache_dtype
    if conv_dtype not in MAMBA_DTYPE_BYTES:
        raise KVLedgerError(f"the state's dtype {conv_dtype!r} is not one vLLM keeps a state in; choose one of "
                            f"{', '.join(MAMBA_DTYPE_BYTES)}")
    ssm_dtype = (mamba_ssm_cache_dtype if mamba_ssm_cache_dtype != "auto"
                 else state.ssm_dtype_from_config or conv_dtype)
    window = state.conv_kernel - 1
    f = state.family
    if f == MAMBA1:
        conv = (window, _divide(state.inner_size, tp, "inner channels"))
        ssm: tuple[int, ...] = (_divide(state.inner_size, tp, "inner channels"), state.state_size)
    elif f == MAMBA2:
        groups = state.n_groups + extra_groups_for_head_shards(state.n_groups, tp)
        conv = (window, _divide(state.inner_size + 2 * groups * state.state_size, tp, "conv channels"))
        ssm = (_divide(state.num_heads, tp, "SSM heads"), state.head_dim, state.state_size)
    elif f == GDN:
        width = 2 * state.num_k_heads * state.state_size + state.num_heads * state.head_dim
        conv = (window, _divide(width, tp, "conv channels"))
        ssm = (_divide(state.num_heads, tp, "value heads"), state.head_dim, state.state_size)
    elif f == KDA:
        width = state.num_heads * state.head_dim + 2 * state.num_k_heads * state.state_size
        conv = (window, _divide(width, tp, "conv channels"))
        ssm = (_divide(state.num_heads, tp, "heads"), state.head_dim, state.head_dim)
        ssm_dtype = "float32"  # MambaStateDtypeCalculator.kda_state_dtype: the recurrent state is float32
    elif f == SHORT_CONV:
        conv, ssm = (window, _divide(state.conv_dim, tp, "conv channels")), ()
    elif f == MINIMAX:  # one state, in the cache dtype (linear_attention_state_dtype)
        conv, ssm = (), (_divide(state.num_heads, tp, "heads"), state.head_dim, state.head_dim)
        ssm_dtype = conv_dtype
    else:
        raise KVLedgerError(f"unknown state family {f!r}")
    conv_bytes = _prod(conv) * MAMBA_DTYPE_BYTES[conv_dtype] if conv else 0
    ssm_bytes = _prod(ssm) * MAMBA_DTYPE_BYTES[ssm_dtype] if ssm else 0
    return StateBytes(family=f, conv_bytes=conv_bytes, ssm_bytes=ssm_bytes, conv_dtype=conv_dtype,
                      ssm_dtype=ssm_dtype if ssm else "", shapes=tuple(s for s in (conv, ssm) if s))


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
