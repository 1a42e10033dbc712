"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over the paged KV cache.

GQA, RMSNorm, SwiGLU, RoPE with its scaling variants, tied embeddings, Qwen2's q/k/v bias and
Qwen3's per-head q/k RMSNorm. The q/k/v and gate/up projections are fused into one matmul each;
the fused weights are the checkpoint's, concatenated. Sliding-window attention is not
implemented (every token attends to its whole context).

``forward`` takes a flat batch of tokens and returns logits only for ``logits_indices``:
the tokens at which a new token is sampled.

Tensor parallelism (:mod:`kvledger.layers.parallel`): built inside a TP group, each rank holds
the query and KV heads :mod:`kvledger.spec.head_split` gives it (whole GQA groups, unevenly when
TP does not divide ``H_kv``: SmolLM2's 3 KV heads at TP 2 are 2 and 1; a KV head copied when TP
exceeds ``H_kv``), q/k/v and gate/up column-parallel, o and down row-parallel (one all-reduce
each), and :meth:`LlamaForCausalLM.load_hf_state_dict` slices the full checkpoint to the rank's
share. The embedding, norms and LM head are replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvledger.errors import KVLedgerError
from kvledger.layers.activation import silu_and_mul
from kvledger.layers.attention import AttentionMetadata, paged_attention
from kvledger.layers.linear import Linear, PackedWeight, linear, pack_weight
from kvledger.layers.parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, rank_slice
from kvledger.kvcache.storage import KVCache
from kvledger.layers.rmsnorm import RMSNorm
from kvledger.layers.rotary import RotaryEmbedding, apply_rotary

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Attention(nn.Module):
    def __init__(self, config: dict[str, Any], layer: int) -> None:
        super().__init__()
        self.layer = layer
        total_heads = config["num_attention_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // total_heads
        bias = bool(config.get("attention_bias", config["model_type"] == "qwen2"))
        self.qkv_proj = QKVParallelLinear(config["hidden_size"], self.head_dim, total_heads,
                                          config.get("num_key_value_heads") or total_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config["hidden_size"], bias=False,
                                        in_features_slice=self.qkv_proj.q_features)
        self.qk_norm = config["model_type"] == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
                cos_sin: tuple[torch.Tensor, torch.Tensor], residual: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """``residual`` plus the attention block's output, ``[N, hidden]``; only rows ``keep`` of
        it when given (every row's K and V are still written to the cache)."""
        qkv = self.qkv_proj(x)
        n, h = qkv.shape[0], self.num_heads
        # queries and keys are rotated together as one [N, H + H_kv, d] view
        qk = qkv[:, : self.q_size + self.kv_size].view(n, h + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = apply_rotary(qk, *cos_sin)
        q, k = qk[:, :h], qk[:, h:]
        o = paged_attention(self.layer, q, k, v, meta, cache, self.scale).reshape(-1, self.q_size)
        if keep is not None:
            o, residual = o[keep], residual[keep]
        return self.o_proj(o, residual)


class MLP(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        inter = config["intermediate_size"]
        self.gate_up_proj = ColumnParallelLinear(config["hidden_size"], [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(inter, config["hidden_size"], bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus the MLP's output, ``[N, hidden]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)), residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.mlp = MLP(config)

    def forward(self, h, meta, cache, cos_sin, keep=None):  # type: ignore[no-untyped-def]
        h = self.self_attn(self.input_layernorm(h), meta, cache, cos_sin, residual=h, keep=keep)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward`` is one engine step over the paged cache."""

    trims_last_layer = True
    """The last layer's output projection and MLP run only for the rows whose logits are read (a
    prefill chunk's last position), as llama.cpp does; turned off under ``torch.compile``, where
    every layer runs one graph."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise KVLedgerError(
                f"model_type {config.get('model_type')!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.config = config
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.rope: RotaryEmbedding | None = None
        self.lm_head_packed: PackedWeight | None = None  # pack_weight(lm_head_weight), set by pack()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (float32) for a flat batch ``input_ids`` ``[N]``."""
        assert self.rope is not None, "call set_rope() before forward()"
        h = self.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions)
        *body, last = self.layers
        for layer in body:
            h = layer(h, meta, cache, cos_sin)
        if self.trims_last_layer and logits_indices.numel() < input_ids.numel():
            h = last(h, meta, cache, cos_sin, keep=logits_indices)
        else:
            h = last(h, meta, cache, cos_sin)[logits_indices]
        return linear(self.norm(h), self.lm_head_weight, packed=self.lm_head_packed).float()

    def pack(self) -> None:
        """Prepack every projection weight for the CPU kernels (:mod:`kvledger.layers.linear`); done
        by :meth:`load_hf_state_dict`, again by whoever changes the weights afterwards."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.lm_head_packed = pack_weight(self.lm_head_weight, logits=True)

    def set_rope(self, max_len: int) -> None:
        """Precompute RoPE tables for positions ``[0, max_len)``."""
        head_dim = self.layers[0].self_attn.head_dim
        weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(self.config, head_dim, max_len, weight.dtype, weight.device)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up and keeping this rank's slice
        of the parallel projections; strict about what is missing: one KVLedgerError names every
        tensor the checkpoint lacks."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        absent: list[str] = []
        state = {k.removeprefix("model.") if not k.startswith("lm_head") else k: v for k, v in state.items()}

        def put(name: str, *sources: str) -> None:
            """Copy the checkpoint tensors ``sources`` (concatenated) into parameter ``name``, if all present."""
            tensors = [state.get(source) for source in sources]
            absent.extend(source for source, t in zip(sources, tensors) if t is None)
            if any(t is None for t in tensors):
                return
            tensor = rank_slice(self, name, tensors)
            param = own[name]
            if param.shape != tensor.shape:
                raise KVLedgerError(f"checkpoint tensor for {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)

        for i in range(len(self.layers)):
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                if f"{p}self_attn.qkv_proj.{kind}" in own:
                    put(f"{p}self_attn.qkv_proj.{kind}", *(f"{p}self_attn.{n}_proj.{kind}" for n in ("q", "k", "v")))
            put(f"{p}mlp.gate_up_proj.weight", f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight")
            for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                      "post_attention_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                if f"{p}{n}" in own:
                    put(f"{p}{n}", f"{p}{n}")
        for name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            if name in own:
                put(name, name)
        missing = absent or sorted(set(own) - loaded)
        if missing:
            raise KVLedgerError(f"checkpoint lacks {len(missing)} tensors: {', '.join(missing)}")
        self.pack()
