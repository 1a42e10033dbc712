"""Read GGUF checkpoints (llama.cpp's format) with the numpy-only ``gguf`` package.

Two jobs, kept apart so that the planner can use the first without torch:

* :func:`config_from_gguf` turns the GGUF metadata into a Hugging Face style ``config.json``
  dict (``num_hidden_layers``, ``num_key_value_heads``, ...). No torch import.
* :func:`load_gguf_state_dict` dequantizes every tensor to float32 numpy arrays with Hugging
  Face parameter names. llama.cpp stores the query and key projections with their rows
  permuted for its interleaved RoPE; they are permuted back here so the model can use the
  ``rotate_half`` RoPE layout of Hugging Face checkpoints. Gemma's norm weights are stored
  as ``1 + weight``; the ``1`` is taken off again (Hugging Face's convention).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvledger.errors import KVLedgerError

#: GGUF architectures that map onto the Llama model code, and the HF architecture each becomes
#: (its ``model_type`` is the GGUF name).
_ARCHES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
#: GGUF architectures whose ``model_type`` differs from the GGUF name (a Gemma-3 GGUF holds the text model).
_MODEL_TYPES = {"gemma3": "gemma3_text"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

#: Gemma's four norms per layer: llama.cpp's ``ffn_norm`` is Gemma's pre-feedforward norm.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _reader(path: str | Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise KVLedgerError(f"cannot read GGUF file {path}: {err}; give a valid .gguf file") from err


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All scalar/string metadata of a GGUF file (token lists left out), keyed as in the file."""
    reader = _reader(path)
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "merges", "token_type", "scores"):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - unknown field layouts are skipped, not fatal
            continue
    return out


def config_from_gguf(path: str | Path) -> dict[str, Any]:
    """A Hugging Face style config dict (``config.json`` keys) from a GGUF file's metadata.

    Sizes are counts (layers, heads, elements), ``rope_theta`` is the RoPE base and
    ``max_position_embeddings`` is in tokens. ``torch_dtype`` is the dtype the weights are
    dequantized to (``float32``).
    """
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHES:
        raise KVLedgerError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: {', '.join(sorted(_ARCHES))}"
        )

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config: dict[str, Any] = {
        "architectures": [_ARCHES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        factor = float(get("rope.scaling.factor", 1.0))
        rope_scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": factor}
        original = get("rope.scaling.original_context_length")
        if original:
            rope_scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = rope_scaling
    if arch == "gemma3":  # the window; layer_types, query scale and local RoPE base are the family's defaults
        config.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                      sliding_window=int(get("attention.sliding_window", 4096)))
    return config


def _unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of a q/k projection ``[n_head*d, in]``."""
    half = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weights.shape))


def load_gguf_state_dict(path: str | Path, config: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file dequantized to float32, under Hugging Face parameter names."""
    import gguf

    config = config or config_from_gguf(path)
    reader = _reader(path)
    permute = config["model_type"] in ("llama", "mistral")
    gemma = config["model_type"].startswith("gemma")
    names = _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        array = gguf.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])  # writable copy
        name = tensor.name
        if gemma and name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + weight
            array -= 1.0
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = array
        elif name == "output_norm.weight":
            out["model.norm.weight"] = array
        elif name == "output.weight":
            out["lm_head.weight"] = array
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in names:
                continue
            if permute and rest == "attn_q.weight":
                array = _unpermute(array, config["num_attention_heads"])
            elif permute and rest == "attn_k.weight":
                array = _unpermute(array, config["num_key_value_heads"])
            out[f"model.layers.{layer}.{names[rest]}"] = array
    return out
