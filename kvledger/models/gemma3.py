"""Gemma-3 (text) over the paged KV cache, with its sliding-window layers in their own KV groups.

What sets the family apart from Llama: a GELU-tanh gated MLP; four RMSNorms per layer (input,
post-attention, pre- and post-feedforward), each scaling by ``1 + weight`` (folded into the
weight at load, so the plain :class:`RMSNorm` runs); RMSNorm over each query and key head;
embeddings multiplied by ``sqrt(hidden_size)``; queries scaled by ``query_pre_attn_scalar ** -0.5``;
RoPE with ``rope_local_base_freq`` on sliding layers and ``rope_theta`` (with its scaling) on
full ones; tied embeddings; and the per-layer pattern of ``layer_types`` (or the family default,
one full layer in six), read through :class:`ModelSpec` as the planner reads it.

Tensor parallelism as in :mod:`kvledger.models.llama`: the heads split by
:mod:`kvledger.spec.head_split` (Gemma-3 270M's one KV head copied to both ranks at TP 2, each
with 2 of its 4 query heads; the per-head q/k norms replicated), q/k/v and gate/up
column-parallel, o and down row-parallel; embeddings, the other norms and the tied LM head
replicated.

The KV cache is cut into groups (:func:`kv_cache_groups`): layer ``i`` writes slot
``cache_layer`` of the cache through its group's block tables, and ``forward`` takes one
:class:`AttentionMetadata` per group. A sliding layer's metadata carries its window in its masks.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from kvledger.kvcache.groups import KVCacheGroup, kv_cache_groups
from kvledger.errors import KVLedgerError
from kvledger.layers.activation import gelu_tanh_and_mul
from kvledger.layers.attention import AttentionMetadata, paged_attention
from kvledger.layers.linear import Linear, PackedWeight, linear, pack_weight
from kvledger.layers.parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, rank_slice
from kvledger.kvcache.storage import KVCache
from kvledger.layers.rmsnorm import RMSNorm
from kvledger.layers.rotary import RotaryEmbedding, apply_rotary

SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma3")
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def model_kv_groups(config: dict[str, Any]) -> list[KVCacheGroup]:
    """The KV-cache groups of a Gemma-3 config: its layer pattern as the planner's spec reads it."""
    from kvledger.spec import ModelSpec

    spec = ModelSpec.from_config_dict(config)
    return kv_cache_groups(spec.layer_types, spec.sliding_window)


class Attention(nn.Module):
    def __init__(self, config: dict[str, Any], layer: int, cache_layer: int, group: int) -> None:
        super().__init__()
        self.layer, self.cache_layer, self.group = layer, cache_layer, group
        total_heads = config["num_attention_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // total_heads
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config["hidden_size"], self.head_dim, total_heads,
                                          config.get("num_key_value_heads") or total_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config["hidden_size"], bias=False,
                                        in_features_slice=self.qkv_proj.q_features)
        self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.scale = float(config.get("query_pre_attn_scalar") or 256) ** -0.5

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
                cos_sin: tuple[torch.Tensor, torch.Tensor], keep: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output ``[N, hidden]`` (before its post-attention norm); only rows
        ``keep`` of it when given (every row's K and V are still written to the cache)."""
        qkv = self.qkv_proj(x)
        n, h = qkv.shape[0], self.num_heads
        q = self.q_norm(qkv[:, : self.q_size].reshape(n, h, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size: self.q_size + self.kv_size].reshape(n, self.num_kv_heads, self.head_dim))
        v = qkv[:, self.q_size + self.kv_size:].reshape(n, self.num_kv_heads, self.head_dim)
        qk = apply_rotary(torch.cat((q, k), dim=1), *cos_sin)
        o = paged_attention(self.cache_layer, qk[:, :h], qk[:, h:], v, meta, cache, self.scale).reshape(-1, self.q_size)
        return self.o_proj(o if keep is None else o[keep])


class MLP(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        inter = config["intermediate_size"]
        self.gate_up_proj = ColumnParallelLinear(config["hidden_size"], [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(inter, config["hidden_size"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer: int, cache_layer: int, group: int, sliding: bool) -> None:
        super().__init__()
        eps = config["rms_norm_eps"]
        self.sliding = sliding
        self.self_attn = Attention(config, layer, cache_layer, group)
        self.mlp = MLP(config)
        for name in _NORMS:
            setattr(self, name, RMSNorm(config["hidden_size"], eps))

    def forward(self, h, metas, cache, cos_sin, keep=None):  # type: ignore[no-untyped-def]
        attn = self.self_attn(self.input_layernorm(h), metas[self.self_attn.group], cache, cos_sin, keep)
        h = (h if keep is None else h[keep]) + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(nn.Module):
    """Gemma-3 text decoder; ``forward`` is one engine step over the grouped paged cache."""

    trims_last_layer = True
    """The last layer's output projection and MLP run only for the rows whose logits are read
    (:attr:`kvledger.models.llama.LlamaForCausalLM.trims_last_layer`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise KVLedgerError(f"model_type {config.get('model_type')!r} is not Gemma-3; supported: "
                                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if config.get("attn_logit_softcapping"):
            raise KVLedgerError("attention logit soft-capping (Gemma-2) is not implemented; give a Gemma-3 model")
        self.config = config
        self.kv_groups = model_kv_groups(config)
        placement = {layer: (g, slot) for g, group in enumerate(self.kv_groups) for slot, layer in enumerate(group.layers)}
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, placement[i][1], placement[i][0],
                         self.kv_groups[placement[i][0]].sliding_window is not None)
            for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        self.rope_local: RotaryEmbedding | None = None
        self.rope_global: RotaryEmbedding | None = None
        self.lm_head_packed: PackedWeight | None = None

    @property
    def cache_layers(self) -> int:
        """Layers of the cache tensor: a group's size (every group pages that many layers)."""
        return max(len(g.layers) for g in self.kv_groups)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | Sequence[AttentionMetadata], cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (float32); ``meta`` holds one entry per KV group."""
        assert self.rope_local is not None and self.rope_global is not None, "call set_rope() before forward()"
        metas = [meta] if isinstance(meta, AttentionMetadata) else list(meta)
        weight = self.embed_tokens.weight
        h = self.embed_tokens(input_ids) * torch.tensor(self.config["hidden_size"] ** 0.5, dtype=weight.dtype)
        local, full = self.rope_local.cos_sin(positions), self.rope_global.cos_sin(positions)
        *body, last = self.layers
        for layer in body:
            h = layer(h, metas, cache, local if layer.sliding else full)
        rope = local if last.sliding else full
        if self.trims_last_layer and logits_indices.numel() < input_ids.numel():
            h = last(h, metas, cache, rope, keep=logits_indices)
        else:
            h = last(h, metas, cache, rope)[logits_indices]
        logits = linear(self.norm(h), weight, packed=self.lm_head_packed).float()
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def pack(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.lm_head_packed = pack_weight(self.lm_head_weight, logits=True)

    def set_rope(self, max_len: int) -> None:
        """Precompute both RoPE tables (local base for sliding layers, global base and scaling for
        full ones) for positions ``[0, max_len)``."""
        head_dim = self.layers[0].self_attn.head_dim
        weight = self.embed_tokens.weight
        base = {k: v for k, v in self.config.items() if k not in ("rope_scaling", "rope_parameters")}
        local = {**base, "rope_theta": float(self.config.get("rope_local_base_freq") or 10000.0)}
        full = {**base, "rope_theta": float(self.config.get("rope_theta") or 1_000_000.0),
                "rope_scaling": self.config.get("rope_scaling")}
        self.rope_local = RotaryEmbedding(local, head_dim, max_len, weight.dtype, weight.device)
        self.rope_global = RotaryEmbedding(full, head_dim, max_len, weight.dtype, weight.device)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face names (``model.layers.N...``), fusing q/k/v and gate/up and adding Gemma's
        ``1 +`` to every norm weight; one KVLedgerError names every tensor the checkpoint lacks."""
        own = dict(self.named_parameters())
        state = {k.removeprefix("model."): v for k, v in state.items()}
        loaded: set[str] = set()
        absent: list[str] = []

        def put(name: str, *sources: str, plus_one: bool = False) -> None:
            tensors = [state.get(source) for source in sources]
            absent.extend(source for source, t in zip(sources, tensors) if t is None)
            if any(t is None for t in tensors):
                return
            tensor = rank_slice(self, name, tensors)
            param = own[name]
            if param.shape != tensor.shape:
                raise KVLedgerError(f"checkpoint tensor for {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(1.0 + tensor.float() if plus_one else tensor)
            loaded.add(name)

        for i in range(len(self.layers)):
            p = f"layers.{i}."
            put(f"{p}self_attn.qkv_proj.weight", *(f"{p}self_attn.{n}_proj.weight" for n in ("q", "k", "v")))
            if f"{p}self_attn.qkv_proj.bias" in own:
                put(f"{p}self_attn.qkv_proj.bias", *(f"{p}self_attn.{n}_proj.bias" for n in ("q", "k", "v")))
            put(f"{p}mlp.gate_up_proj.weight", f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight")
            put(f"{p}self_attn.o_proj.weight", f"{p}self_attn.o_proj.weight")
            put(f"{p}mlp.down_proj.weight", f"{p}mlp.down_proj.weight")
            for n in (*_NORMS, "self_attn.q_norm", "self_attn.k_norm"):
                put(f"{p}{n}.weight", f"{p}{n}.weight", plus_one=True)
        put("embed_tokens.weight", "embed_tokens.weight")
        put("norm.weight", "norm.weight", plus_one=True)
        missing = absent or sorted(set(own) - loaded)
        if missing:
            raise KVLedgerError(f"checkpoint lacks {len(missing)} tensors: {', '.join(missing)}")
        self.pack()
