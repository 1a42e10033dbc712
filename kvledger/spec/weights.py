"""Weight bytes of a model, as vLLM loads them: from the config, the checkpoint's quantization,
vLLM's ``--dtype`` and its runtime ``--quantization``.

The parameter count follows the architecture's tensors (embeddings, attention projections,
MLP or experts, norms, biases); MoE experts all count: every expert is resident though a token
uses only a few. Each part is then sized as vLLM stores it:

* unquantized parts at the model dtype: ``--dtype`` if given (``float32`` doubles a bf16
  checkpoint), else the config's ``torch_dtype`` (a float32 checkpoint is served in bfloat16,
  as vLLM's ``auto`` does);
* ``quantization_config`` of the checkpoint: ``fp8`` (linear layers 1 byte, block scales),
  ``mxfp4`` (experts at 4.25 bits: 4-bit values plus one 8-bit scale per 32), ``awq`` /
  ``gptq`` (``bits`` per weight plus a float16 scale and a packed zero per group),
  ``compressed-tensors`` (each config group's ``num_bits``; ``ignore`` modules, typically
  ``lm_head``, stay unquantized). Embeddings and norms are never quantized;
* vLLM's runtime ``--quantization fp8`` casts every linear layer of an unquantized checkpoint
  to 1 byte (one float32 scale per output channel); embeddings, ``lm_head`` and norms stay in
  the model dtype.

When the checkpoint's ``model.safetensors.index.json`` is shipped, its ``total_size`` (the
tensor bytes) is the truth for the checkpoint as stored; every part is scaled by
``total_size / computed`` so the split across ranks and stages keeps that total. Where vLLM
holds more than the checkpoint, the planner names the device: mxfp4 experts are re-laid out
for the MoE kernel vLLM picks on that card (``mxfp4_moe_backend``, ``mxfp4_expert_bytes``:
padded sizes, swizzled copies, float32 biases), 6% above the checkpoint for gpt-oss-20b on an
H100. Without a device the count is the checkpoint's. vLLM also holds, on every rank, its
rotary cos/sin table (``rope_cache_bytes``), which no checkpoint stores: 32 MiB for Llama 3.1's 131,072 positions,
2.5 GiB for Llama 4's 10,485,760. The per-rank weights the planner subtracts include it (as
vLLM's "Model loading took" does); ``total`` (the checkpoint) does not. Sizes are parameters
(counts) or bytes as named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.errors import KVLedgerError
from kvledger.spec.dtypes import DTYPE_ALIASES
from kvledger.spec.model_spec import ModelSpec

WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5, "mxfp4": 4.25 / 8,
}
"""``--weights-dtype``: every parameter at this size (a what-if, not a checkpoint)."""
MODEL_DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""vLLM's ``--dtype`` values and their bytes per element (``auto`` is the config's)."""
RUNTIME_QUANTIZATIONS: tuple[str, ...] = ("fp8",)
"""vLLM ``--quantization`` methods that quantize an unquantized checkpoint at load time."""
CHECKPOINT_QUANT_METHODS: tuple[str, ...] = ("fp8", "mxfp4", "awq", "gptq", "compressed-tensors")
"""``quantization_config.quant_method`` values whose bytes are counted."""
UNGATED_MLP_TYPES: tuple[str, ...] = ("phi", "gpt2", "gpt_neox", "gpt_bigcode", "starcoder2", "falcon", "opt")
"""Architectures (``model_type``) whose MLP is two biased matrices (up, down) around a GELU,
not the three of a gated (SwiGLU/GeGLU) MLP; their attention projections are biased too."""
FLOAT32_ROPE_TYPES: tuple[str, ...] = ("gpt_oss",)
"""Architectures whose vLLM model file asks ``get_rope`` for a float32 cos/sin table."""
ONE_SHARED_EXPERT_TYPES: tuple[str, ...] = ("llama4_text",)
"""MoE architectures with one always-on shared expert of ``intermediate_size`` that the config
does not name (Llama 4's ``shared_expert`` beside its routed experts)."""


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part. ``embedding`` is the input table and ``lm_head`` the output
    projection (0 when tied); ``expert`` is the routed-expert share (quantized apart in some
    checkpoints); ``attention`` and ``mlp`` are the linear layers of all decoder layers."""

    embedding: int
    lm_head: int
    attention: int
    mlp: int
    expert: int
    norm: int
    vision: int = 0
    """A multimodal checkpoint's vision tower and projector (no KV cache; resident on the first stage)."""

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.expert + self.norm + self.vision

    @property
    def linear(self) -> int:
        """The decoder layers' linear weights: what weight quantization shrinks."""
        return self.attention + self.mlp + self.expert


def count_params(spec: ModelSpec) -> ParamCount:
    """Parameter count of a decoder from its config (no multi-token-prediction heads), plus the
    vision tower of a multimodal config (``vision_params``)."""
    c = spec.raw_config
    h, L, V = spec.hidden_size, spec.num_layers, spec.vocab_size
    H, Hkv, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
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
        if spec.model_type in UNGATED_MLP_TYPES:
            attention += L * (H * d + 2 * Hkv * d + h)  # q, k, v and output biases
    norms_per_layer = 4 if spec.model_type.startswith("gemma") else 2
    norm = L * norms_per_layer * h + h
    mlp, expert = _mlp_params(spec)
    lm_head = 0 if spec.tie_word_embeddings else V * h + (V if spec.model_type in UNGATED_MLP_TYPES else 0)
    return ParamCount(embedding=V * h, lm_head=lm_head, attention=attention,
                      mlp=mlp, expert=expert, norm=norm, vision=vision_params(spec))


def vision_params(spec: ModelSpec) -> int:
    """Parameters of a ViT vision tower described by ``vision_config`` (SigLIP-style: biased
    attention and MLP, two layer norms per layer, a patch convolution, learned positions, a
    final norm) and of the linear projector into the text model's width; 0 without one."""
    v = spec.config.get("vision_config")
    if not isinstance(v, dict) or not all(v.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers")):
        return 0
    h, i, layers = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"])
    patch, image, channels = int(v.get("patch_size") or 14), int(v.get("image_size") or 224), int(v.get("num_channels") or 3)
    per_layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
    stem = channels * patch * patch * h + h + (image // patch) ** 2 * h + 2 * h
    projector = h * spec.hidden_size + h
    return layers * per_layer + stem + projector


def _mla_params(spec: ModelSpec) -> int:
    c, h, H = spec.raw_config, spec.hidden_size, spec.num_attention_heads
    q_lora, kv_lora = c.get("q_lora_rank"), spec.kv_lora_rank or 0
    nope, rope, v = int(c.get("qk_nope_head_dim", 128)), int(spec.qk_rope_head_dim or 0), int(c.get("v_head_dim", 128))
    q = (h * q_lora + q_lora + q_lora * H * (nope + rope)) if q_lora else h * H * (nope + rope)
    kv = h * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v)
    return q + kv + H * v * h


def _mlp_params(spec: ModelSpec) -> tuple[int, int]:
    """(dense MLP params, routed-expert params) over all layers; gated MLPs have 3 matrices,
    the ungated ones of ``UNGATED_MLP_TYPES`` 2 and their biases."""
    c, h, L = spec.raw_config, spec.hidden_size, spec.num_layers
    gated = 3
    if not spec.is_moe:
        if spec.model_type in UNGATED_MLP_TYPES:
            return L * (2 * h * spec.intermediate_size + spec.intermediate_size + h), 0
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
    shared_i = int(c.get("shared_expert_intermediate_size") or 0) or int(c.get("n_shared_experts") or 0) * moe_i
    if spec.model_type in ONE_SHARED_EXPERT_TYPES:
        shared_i = moe_i
    shared = moe_layers * gated * h * shared_i
    dense = dense_layers * gated * h * spec.intermediate_size
    return dense + shared + router, experts


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the weights by where they live. ``layers`` is every decoder layer together
    (split evenly over pipeline stages and tensor-parallel ranks); ``embedding`` sits on the
    first stage, ``lm_head`` (a copy of the embedding when tied and split over stages) and the
    final norm on the last. Bytes."""

    embedding: int
    lm_head: int
    layers: int
    final_norm: int
    dtype: str
    """The dtype of the unquantized parts."""
    quantization: str | None
    """What quantized the linear layers: the checkpoint's ``quant_method``, ``fp8`` at run time, or None."""
    experts: int = 0
    """Bytes of the routed experts (part of ``layers``): what a decode step reads only in part."""
    vision: int = 0
    """Bytes of a vision tower (part of ``embedding``): not read by a text decode step."""
    rope_cache: int = 0
    """Bytes of vLLM's rotary cos/sin table (``rope_cache_bytes``): no checkpoint tensor, so not
    in ``total``, but a buffer every rank allocates while loading."""

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.layers + self.final_norm

    def per_rank(self, num_layers: int, stage_layers: int, tensor_parallel_size: int = 1,
                 first_stage: bool = True, last_stage: bool = True, rope_cache: bool = True) -> int:
        """Bytes on one rank of a stage holding ``stage_layers`` of ``num_layers`` layers. vLLM
        shards the vocabulary of the embedding and of ``lm_head`` over TP ranks, as it does the
        linear layers; norms are small and counted once per stage. ``rope_cache``: add the rotary
        table every rank holds (what vLLM's "Model loading took" counts beside the tensors)."""
        part = self.layers * stage_layers / num_layers
        if first_stage:
            part += self.embedding
        if last_stage:
            part += self.lm_head + self.final_norm
        return math.ceil(part / tensor_parallel_size) + (self.rope_cache if rope_cache else 0)


def rope_cache_bytes(spec: ModelSpec, element_bytes: int) -> int:
    """vLLM's rotary table: ``cos`` and ``sin`` for every position up to the config's
    ``max_position_embeddings`` (times a YaRN ``factor`` over its original length), ``rotary_dim``
    values per position (``head_dim x partial_rotary_factor``; ``qk_rope_head_dim`` for MLA), in
    the model dtype, one per rank and shared by the layers (a second one for Gemma 3's local
    layers, which rotate with their own base). It is what Llama 4's 10M-position context costs:
    10,485,760 x 128 x 2 B = 2.5 GiB on every rank. Bytes."""
    c = spec.raw_config
    rotary_dim = int(spec.qk_rope_head_dim) if spec.is_mla else int(spec.head_dim * float(c.get("partial_rotary_factor") or 1))
    positions = int(c.get("max_position_embeddings") or 0)
    scaling = c.get("rope_scaling") if isinstance(c.get("rope_scaling"), dict) else {}
    if (scaling.get("rope_type") or scaling.get("type")) == "yarn" and scaling.get("original_max_position_embeddings"):
        positions = int(scaling["original_max_position_embeddings"] * float(scaling.get("factor") or 1))
    tables = 2 if c.get("rope_local_base_freq") else 1
    return tables * positions * rotary_dim * element_bytes


MXFP4_BLOCK = 32
"""Elements sharing one 8-bit (e8m0) scale in an mxfp4 tensor."""
MXFP4_BACKENDS: tuple[str, ...] = ("checkpoint", "triton", "marlin", "flashinfer_trtllm")
"""How mxfp4 experts are held: as the checkpoint stores them, or as one of vLLM 0.19's MoE
kernels lays them out (``mxfp4_expert_bytes``)."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def mxfp4_moe_backend(compute_capability: str | None) -> str:
    """The MoE kernel vLLM 0.19 picks for an mxfp4 checkpoint on an NVIDIA card of this compute
    capability (``select_mxfp4_moe_backend``, no environment overrides): its priority list is
    FlashInfer TRT-LLM (SM 10.x only), then Triton with the bundled ``triton_kernels`` (SM 9.0 up
    to 10.x), then Marlin (everything else, SM 8.x and 12.x included). ``"checkpoint"`` when no
    card is named (or on AMD, whose CK and Triton layouts are not modelled)."""
    if not compute_capability:
        return "checkpoint"
    major = int(str(compute_capability).split(".")[0])
    if major == 10:
        return "flashinfer_trtllm"
    if major == 9:
        return "triton"
    return "marlin"


def mxfp4_expert_bytes(spec: ModelSpec, tensor_parallel_size: int = 1, backend: str = "checkpoint",
                       hopper_value_align: int = 64) -> int:
    """Bytes of the routed experts of every MoE layer on one tensor-parallel rank, as vLLM 0.19's
    mxfp4 method holds them after loading. Per expert it creates ``w13`` (2 x I x H/2 bytes: two
    4-bit values a byte), ``w2`` (H x I/2), their e8m0 scales (one byte per 32 values) and, for
    gpt-oss, bfloat16 biases (2 x I and H), with I the intermediate size per rank and H the
    hidden size, both first rounded up for the kernel; then converts them for it:

    * ``triton`` (Hopper): I rounded up to 64. The values are swizzled into a new tensor whose two
      byte dimensions are padded to multiples of 64 (the loaded one is freed); the scales are
      swizzled into a copy padded to 256 rows of the output dimension (and an even count along
      the reduction) while the loaded scale parameters stay allocated; the biases become float32;
    * ``marlin``: I rounded up to 128 and H to 256; values repacked and scales permuted at the
      same sizes, biases in bfloat16;
    * ``flashinfer_trtllm`` (Blackwell): I and H rounded up to 256; values and scales shuffled at
      the same sizes, biases float32;
    * ``checkpoint``: the stored tensors, 4.25 bits per parameter (biases included).

    These are vLLM 0.19's rules, with the ``triton_kernels`` it bundles. ``hopper_value_align``
    is that library's padding of the swizzled values: 64 in the copy vLLM 0.19 bundles; 1 for the
    earlier Hopper layout (vLLM 0.14), which pads only to whole swizzle tiles (16 rows of 32
    bytes): vLLM 0.14.1 printed 64.38 GiB for gpt-oss-120b on an H100
    (github.com/vllm-project/vllm/issues/33155), this count with 1 gives 64.33. Later releases
    free the loaded scales once swizzled (vLLM 0.32's mxfp4 method says so) and take the layout
    from a separately installed ``triton_kernels``.

    On gpt-oss-20b (24 layers of 32 experts, H = I = 2,880) at TP 1 that is 10,155,870,720 bytes
    stored and 11,010,539,520 on an H100 (Triton). Bytes."""
    if backend not in MXFP4_BACKENDS:
        raise KVLedgerError(f"unknown mxfp4 layout {backend!r}; choose one of {', '.join(MXFP4_BACKENDS)}")
    moe_layers = spec.num_layers - int(spec.raw_config.get("first_k_dense_replace", 0))
    experts, hidden = spec.num_experts, spec.hidden_size
    moe_i = spec.moe_intermediate_size or spec.intermediate_size
    biased = spec.model_type == "gpt_oss"
    if backend == "checkpoint":
        per_expert_params = 3 * hidden * moe_i + (2 * moe_i + hidden if biased else 0)
        return int(moe_layers * experts * per_expert_params * WEIGHT_DTYPE_BYTES["mxfp4"] / tensor_parallel_size)
    i = moe_i // tensor_parallel_size
    h = hidden
    if backend == "triton":
        i = _round_up(i, 64)
    elif backend == "marlin":
        i, h = _round_up(i, 128), _round_up(h, 256)
    else:
        i, h = _round_up(i, 256), _round_up(h, 256)
    scales = 2 * i * (h // MXFP4_BLOCK) + h * (i // MXFP4_BLOCK)
    bias_elements = (2 * i + h) if biased else 0
    if backend == "triton":
        k_align, n_align = max(hopper_value_align, 32), max(hopper_value_align, 16)
        values = (_round_up(h // 2, k_align) * _round_up(2 * i, n_align)      # w13, reduction over H
                  + _round_up(i // 2, k_align) * _round_up(h, n_align))       # w2, reduction over I
        swizzled = (_round_up(2 * i, 256) * _round_up(h // MXFP4_BLOCK, 2)
                    + _round_up(h, 256) * _round_up(i // MXFP4_BLOCK, 2))
        per_expert = values + scales + swizzled + 4 * bias_elements
    else:
        values = 2 * i * h // 2 + h * i // 2
        per_expert = values + scales + (2 if backend == "marlin" else 4) * bias_elements
    return moe_layers * experts * per_expert


def checkpoint_dtype(spec: ModelSpec) -> str:
    """The dtype the checkpoint's tensors are stored in: the config's ``torch_dtype``."""
    name = DTYPE_ALIASES.get(spec.torch_dtype.lower(), spec.torch_dtype.lower())
    return name if name in MODEL_DTYPES else "bfloat16"


def model_dtype(spec: ModelSpec, dtype: str | None = None) -> str:
    """vLLM's ``--dtype`` resolved: ``auto`` (or None) is the checkpoint's dtype, except that vLLM
    serves a float32 checkpoint in bfloat16 unless ``--dtype float32`` is given."""
    name = DTYPE_ALIASES.get((dtype or "auto").lower(), (dtype or "auto").lower())
    if name == "auto":
        stored = checkpoint_dtype(spec)
        return "bfloat16" if stored == "float32" else stored
    if name not in MODEL_DTYPES:
        raise KVLedgerError(f"unknown --dtype {dtype!r}; choose auto, {', '.join(MODEL_DTYPES)}")
    return name


def weight_bytes_breakdown(spec: ModelSpec, weights_dtype: str | None = None, *, dtype: str | None = None,
                           quantization: str | None = None, tensor_parallel_size: int = 1,
                           compute_capability: str | None = None) -> WeightBytes:
    """The weights of ``spec`` by part, sized as vLLM loads them (see the module docstring).
    ``weights_dtype`` (a what-if) sizes every parameter alike and overrides the rest.
    ``compute_capability`` (the card's SM, e.g. ``"9.0"``) and ``tensor_parallel_size`` size mxfp4
    experts as vLLM's MoE kernel holds them on one rank of that card (``mxfp4_expert_bytes``);
    ``experts`` and ``layers`` are then every rank's bytes together. Without a card, the
    checkpoint's."""
    params = count_params(spec)
    unq = model_dtype(spec, dtype)
    s = MODEL_DTYPES[unq]
    layer_norms = params.norm - spec.hidden_size
    embedding = params.embedding + params.vision  # both on the first stage, never quantized here
    if weights_dtype is not None:
        if weights_dtype not in WEIGHT_DTYPE_BYTES:
            raise KVLedgerError(f"unknown weights dtype {weights_dtype!r}; choose one of {', '.join(WEIGHT_DTYPE_BYTES)}")
        w = WEIGHT_DTYPE_BYTES[weights_dtype]
        return WeightBytes(embedding=int(embedding * w), lm_head=int(params.lm_head * w),
                           layers=int((params.linear + layer_norms) * w), final_norm=int(spec.hidden_size * w),
                           dtype=weights_dtype, quantization=None, experts=int(params.expert * w),
                           vision=int(params.vision * w))
    if quantization is not None and quantization not in RUNTIME_QUANTIZATIONS:
        raise KVLedgerError(f"unknown --quantization {quantization!r}; the planner counts: {', '.join(RUNTIME_QUANTIZATIONS)}")
    method = spec.quant_method
    if quantization and method:
        raise KVLedgerError(f"{spec.name} is already quantized ({method}); vLLM refuses --quantization {quantization} "
                            "on a quantized checkpoint: drop the flag")
    head_s = s
    if quantization == "fp8":  # one float32 scale per output channel of each linear layer
        linear = params.linear + 4 * _linear_rows(spec)
        kind = "fp8"
    elif method is None:
        linear = params.linear * s
        kind = None
    else:
        linear, head_quantized = _checkpoint_linear_bytes(spec, params, s)
        kind = method
        if head_quantized:
            head_s = _quant_bits(spec) / 8
    expert_share = params.expert / params.linear if params.linear else 0.0
    layout = mxfp4_moe_backend(compute_capability) if method == "mxfp4" else "checkpoint"
    if method == "mxfp4" and layout != "checkpoint":  # re-laid out for the card's MoE kernel
        experts = mxfp4_expert_bytes(spec, tensor_parallel_size, layout) * tensor_parallel_size
        linear += experts - params.expert * WEIGHT_DTYPE_BYTES["mxfp4"]
    elif method == "mxfp4":  # the experts alone are 4-bit
        experts = params.expert * WEIGHT_DTYPE_BYTES["mxfp4"]
    else:
        experts = linear * expert_share
    # vLLM builds a few models' rotary table in float32 whatever the model dtype (gpt-oss)
    rope_s = 4 if spec.model_type in FLOAT32_ROPE_TYPES else s
    computed = WeightBytes(embedding=embedding * s, lm_head=int(params.lm_head * head_s),
                           layers=int(linear + layer_norms * s), final_norm=spec.hidden_size * s,
                           dtype=unq, quantization=kind, experts=int(experts), vision=params.vision * s,
                           rope_cache=rope_cache_bytes(spec, rope_s))
    published = spec.weights_bytes_published
    if not published:
        return computed
    # The index's total_size is the checkpoint as stored: scale the count so the parts add up to
    # it (at the checkpoint's own dtype), then to the dtype and quantization vLLM loads.
    ckpt = checkpoint_dtype(spec)
    same = unq == ckpt and not quantization and layout == "checkpoint"
    stored = computed if same else weight_bytes_breakdown(spec, dtype=ckpt)
    factor = published / stored.total
    return WeightBytes(embedding=round(computed.embedding * factor), lm_head=round(computed.lm_head * factor),
                       layers=round(computed.layers * factor), final_norm=round(computed.final_norm * factor),
                       dtype=unq, quantization=kind, experts=round(computed.experts * factor),
                       vision=round(computed.vision * factor), rope_cache=computed.rope_cache)


def _linear_rows(spec: ModelSpec) -> int:
    """Output channels of the decoder layers' linear weights (rows of every matrix): the
    number of per-channel scales a runtime fp8 cast keeps."""
    params = count_params(spec)
    return params.linear // spec.hidden_size


def _quant_bits(spec: ModelSpec) -> float:
    """Bits per quantized weight in the checkpoint's ``quantization_config``."""
    q = _quant_config(spec)
    if q.get("bits"):
        return float(q["bits"])
    for group in (q.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits"):
            return float(weights["num_bits"])
    return 8.0


def _quant_config(spec: ModelSpec) -> dict:
    q = spec.raw_config.get("quantization_config") or spec.config.get("quantization_config") or {}
    return q if isinstance(q, dict) else {}


def _checkpoint_linear_bytes(spec: ModelSpec, params: ParamCount, s: int) -> tuple[float, bool]:
    """(bytes of the decoder's linear layers, whether ``lm_head`` is quantized too) for a
    quantized checkpoint, by its ``quant_method``."""
    method = spec.quant_method
    q = _quant_config(spec)
    if method == "fp8":  # block-quantized linear layers, float32 scales per 128 x 128 block
        block = q.get("weight_block_size") or [128, 128]
        return params.linear * (1 + 4 / (block[0] * block[1])), False
    if method == "mxfp4":  # experts in mxfp4, everything else in the model dtype
        return params.expert * WEIGHT_DTYPE_BYTES["mxfp4"] + (params.attention + params.mlp) * s, False
    if method in ("awq", "gptq"):
        bits = float(q.get("bits", 4))
        group = int(q.get("group_size") or 128)
        group = group if group > 0 else spec.hidden_size
        per_group = 2 + bits / 8  # a float16 scale and a packed zero point per group
        experts_too = 1 if spec.is_moe else 0
        quantized = params.attention + params.mlp + experts_too * params.expert
        rest = params.expert * (1 - experts_too) * s
        return quantized * (bits / 8 + per_group / group) + rest, False
    if method == "compressed-tensors":
        bits = _quant_bits(spec)
        group = None
        for g in (q.get("config_groups") or {}).values():
            w = g.get("weights") or {}
            group = w.get("group_size") or group
        scales = 2 / group if group else 4 / spec.hidden_size  # float16 per group, or float32 per channel
        ignore = [str(x) for x in (q.get("ignore") or [])]
        head_quantized = params.lm_head > 0 and not any("lm_head" in x for x in ignore)
        kept = params.attention * _ignored_attention_share(spec, ignore)  # stays in the model dtype
        return (params.linear - kept) * (bits / 8 + scales) + kept * s, head_quantized
    raise KVLedgerError(f"{spec.name}: quantization_config quant_method {method!r} is not counted; the planner "
                        f"knows {', '.join(CHECKPOINT_QUANT_METHODS)}; give --weights-dtype for an estimate")


def _ignored_attention_share(spec: ModelSpec, ignore: list[str]) -> float:
    """The share of the decoder's attention projections a compressed-tensors ``ignore`` list keeps
    unquantized: each text layer's ``self_attn.{q,k,v,o}_proj`` named in it (RedHatAI's Llama-4
    FP8-dynamic lists all 48 x 4), or all of them for a ``re:`` pattern naming ``self_attn``;
    vision-tower entries do not count."""
    if any(x.startswith("re:") and "self_attn" in x and "vision" not in x for x in ignore):
        return 1.0
    names = [x for x in ignore if "vision" not in x and x.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
             and "self_attn" in x]
    return min(1.0, len(names) / (4 * spec.num_layers)) if spec.num_layers else 0.0


def weights_bytes(spec: ModelSpec, weights_dtype: str | None = None, *, dtype: str | None = None,
                  quantization: str | None = None) -> int:
    """Bytes of all the weights (every rank together); see ``weight_bytes_breakdown``."""
    return weight_bytes_breakdown(spec, weights_dtype, dtype=dtype, quantization=quantization).total
