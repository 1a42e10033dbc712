"""The model code for each supported family against transformers, on tiny random checkpoints.

Each family's particulars are exercised: Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm,
untied embeddings, GQA and MHA, RoPE scaling (llama3, linear, yarn, dynamic). The checkpoint is
saved as safetensors with the SmolLM2 tokenizer files, loaded by the engine as an HF
directory, and greedy tokens and per-step logits are compared with transformers ``generate``.
"""

from __future__ import annotations

import shutil

import pytest
import torch

CASES = {
    "llama-rope-llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-rope-linear-mha": ("llama", {"num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-bias-yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}),
}


def _tiny_checkpoint(tmp_path, model_type: str, extra: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvledger.loader.resolve import converted_dir, resolve_model

    base = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
                rope_theta=10000.0, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    base.update(extra)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    smol = converted_dir(resolve_model(None))
    for f in smol.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp_path / f.name)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_transformers(tmp_path, case):
    from kvledger import LLM, SamplingParams

    model_type, extra = CASES[case]
    hf = _tiny_checkpoint(tmp_path, model_type, extra)
    prompts = [[5, 17, 900, 33, 2048, 7, 7, 99, 1234, 40000, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21][:n] for n in (1, 7, 20)]
    new = 24
    llm = LLM(model=str(tmp_path), kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=16)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        expected = ref.sequences[0, len(prompt):].tolist()
        engine.add_request(f"{case}-{i}", prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        tokens, logits = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                logits.append(engine.runner.last_logits[0].clone())
        assert tokens == expected, f"{case}, prompt of {len(prompt)} tokens"
        diff = (torch.stack(logits) - torch.cat(ref.logits).float()).abs().max().item()
        assert diff < 1e-3, f"{case}: logits differ by {diff}"
    batch = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [len(b.outputs[0].token_ids) for b in batch] == [new] * 3


def test_missing_checkpoint_tensors_are_all_named_in_one_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvledger.errors import KVLedgerError
    from kvledger.models.llama import LlamaForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    model = LlamaForCausalLM(config.to_dict())
    model.load_hf_state_dict(state)  # complete: loads
    del state["model.layers.1.self_attn.o_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(KVLedgerError) as err:
        model.load_hf_state_dict(state)
    message = str(err.value)
    assert "lacks 2 tensors" in message and "\n" not in message
    assert "layers.1.self_attn.o_proj.weight" in message and "layers.0.mlp.up_proj.weight" in message


def test_the_last_layer_runs_only_the_rows_whose_logits_are_read(tmp_path):
    """A prefill chunk's logits come from its last position alone, so the last layer's output
    projection and MLP run for those rows only (every row's K and V still reach the cache): the
    rows its MLP sees are the step's logits rows, and the tokens and logits are those of the same
    engine running the whole last layer."""
    from kvledger import LLM, SamplingParams

    _tiny_checkpoint(tmp_path, "llama", {})
    prompts = [[5, 17, 900, 33, 2048, 7, 7, 99, 1234, 40000, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21][:n] for n in (1, 7, 20)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(model=str(tmp_path), kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    model = engine.model
    seen: list[tuple[int, int]] = []  # (rows of the step, rows the last MLP saw)
    step_rows: list[int] = []
    embed = model.embed_tokens.register_forward_hook(lambda m, args, out: step_rows.append(args[0].numel()))
    mlp = model.layers[-1].mlp.register_forward_hook(lambda m, args, out: seen.append((step_rows[-1], args[0].shape[0])))
    try:
        results = {}
        for trims in (True, False):
            model.trims_last_layer = trims
            seen.clear()
            engine.add_request(f"trims-{trims}-a", prompts[2], params)
            engine.add_request(f"trims-{trims}-b", prompts[1], params)
            engine.add_request(f"trims-{trims}-c", prompts[0], params)
            tokens: dict[str, list[int]] = {}
            logits = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.setdefault(out.request_id.split("-")[-1], []).extend(out.new_token_ids)
                logits.append(engine.runner.last_logits.clone())
            results[trims] = (tokens, logits, list(seen))
    finally:
        embed.remove()
        mlp.remove()
    trimmed, whole = results[True], results[False]
    assert any(rows > mlp_rows for rows, mlp_rows in trimmed[2]), "no step ran a prefill chunk"
    assert all(mlp_rows == rows for rows, mlp_rows in whole[2])
    assert trimmed[0] == whole[0]
    for a, b in zip(trimmed[1], whole[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
