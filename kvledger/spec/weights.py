"""Weight bytes of a model: the published checkpoint size when known, else a parameter count.

The count follows the architecture's tensors (embeddings, attention projections, MLP or
experts, norms, biases). MoE experts all count: every expert's weights are resident even
though a token uses only a few. Sizes are in parameters (counts) or bytes as named.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import KVLedgerError
from kvledger.spec.model_spec import ModelSpec

WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5, "mxfp4": 4.25 / 8,
}


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part; ``expert`` is the routed-expert share (quantized apart in some checkpoints)."""

    embedding: int
    attention: int
    mlp: int
    expert: int
    norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.expert + self.norm


def count_params(spec: ModelSpec) -> ParamCount:
    """Parameter count of a decoder from its config (no multi-token-prediction heads)."""
    c = spec.raw_config
    h, L, V = spec.hidden_size, spec.num_layers, spec.vocab_size
    H, Hkv, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    embedding = V * h * (1 if spec.tie_word_embeddings else 2)
    if spec.is_mla:
        attention = L * _mla_params(spec)
    else:
        attention = L * (h * H * d + 2 * h * Hkv * d + H * d * h)
        if c.get("attention_bias") or spec.model_type in ("qwen2", "qwen2_moe"):
            attention += L * (H * d + 2 * Hkv * d) + (L * h if c.get("attention_bias") else 0)
        if spec.model_type.startswith("qwen3") or spec.model_type.startswith("gemma3"):
            attention += L * 2 * d  # q_norm and k_norm
        if spec.model_type == "gpt_oss":
            attention += L * H  # attention sinks
    norms_per_layer = 4 if spec.model_type.startswith("gemma") else 2
    norm = L * norms_per_layer * h + h
    mlp, expert = _mlp_params(spec)
    return ParamCount(embedding=embedding, attention=attention, mlp=mlp, expert=expert, norm=norm)


def _mla_params(spec: ModelSpec) -> int:
    c, h, H = spec.raw_config, spec.hidden_size, spec.num_attention_heads
    q_lora, kv_lora = c.get("q_lora_rank"), spec.kv_lora_rank or 0
    nope, rope, v = int(c.get("qk_nope_head_dim", 128)), int(spec.qk_rope_head_dim or 0), int(c.get("v_head_dim", 128))
    q = (h * q_lora + q_lora + q_lora * H * (nope + rope)) if q_lora else h * H * (nope + rope)
    kv = h * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v)
    return q + kv + H * v * h


def _mlp_params(spec: ModelSpec) -> tuple[int, int]:
    """(dense MLP params, routed-expert params) over all layers; gated MLPs have 3 matrices."""
    c, h, L = spec.raw_config, spec.hidden_size, spec.num_layers
    gated = 3
    if not spec.is_moe:
        return L * gated * h * spec.intermediate_size, 0
    moe_i = spec.moe_intermediate_size or spec.intermediate_size
    dense_layers = int(c.get("first_k_dense_replace", 0))
    moe_layers = L - dense_layers
    router = moe_layers * h * spec.num_experts
    if spec.model_type == "gpt_oss":  # biased experts and router
        router += moe_layers * spec.num_experts
        experts = moe_layers * spec.num_experts * (gated * h * moe_i + 2 * moe_i + h)
    else:
        experts = moe_layers * spec.num_experts * gated * h * moe_i
    shared = moe_layers * int(c.get("n_shared_experts") or 0) * gated * h * moe_i
    dense = dense_layers * gated * h * spec.intermediate_size
    return dense + shared + router, experts


def weights_bytes(spec: ModelSpec, weights_dtype: str | None = None) -> int:
    """Bytes of the weights. With no ``weights_dtype``: the published checkpoint size when
    shipped, else the count at the checkpoint's dtype (fp8/mxfp4 checkpoints: their quantized
    parts at their size). With ``weights_dtype``: every parameter at that size."""
    if weights_dtype is None and spec.weights_bytes_published:
        return spec.weights_bytes_published
    params = count_params(spec)
    if weights_dtype is not None:
        if weights_dtype not in WEIGHT_DTYPE_BYTES:
            raise KVLedgerError(f"unknown weights dtype {weights_dtype!r}; choose one of {', '.join(WEIGHT_DTYPE_BYTES)}")
        return int(params.total * WEIGHT_DTYPE_BYTES[weights_dtype])
    base = WEIGHT_DTYPE_BYTES.get(spec.torch_dtype, 2)
    if spec.quant_method == "fp8":  # block-quantized linear layers; embeddings and norms stay bf16
        return int((params.embedding + params.norm) * base + (params.attention + params.mlp + params.expert) * 1)
    if spec.quant_method == "mxfp4":  # experts in mxfp4, everything else bf16
        return int((params.total - params.expert) * base + params.expert * WEIGHT_DTYPE_BYTES["mxfp4"])
    return int(params.total * base)
