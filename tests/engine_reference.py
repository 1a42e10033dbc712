"""Reference outputs of transformers' greedy ``generate`` on SmolLM2-135M (float32) for engine tests.

Built once per test session (see the ``engine_reference`` fixture in conftest.py): the GGUF
model is loaded by transformers and run on every prompt alone, past the end-of-sequence token,
keeping its token ids and, for a few prompts, every step's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NEW_TOKENS = 36
#: prompts whose per-step logits are kept (indices into the prompt list)
LOGIT_PROMPTS = (0, 5, 13, 19)

_TEXTS = [
    "The history of the printing press begins in",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the capital of Japan?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left his workshop. Every morning he opened the shutters,",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves the "
    "green pigment chlorophyll and generates oxygen as a byproduct. Explain this to a child:",
    "List three reasons why people learn a second language:\n1.",
    "The mitochondria is",
]
_SHARED_PREFIX = ("<|im_start|>system\nYou are a careful assistant who answers questions about geography, "
                  "history and science in two short sentences, without lists.<|im_end|>\n<|im_start|>user\n")


@dataclass
class Reference:
    prompts: list[list[int]]
    outputs: list[list[int]]
    logits: dict[int, "object"] = field(default_factory=dict)  # prompt index -> [NEW_TOKENS, vocab] tensor
    runner_ups: list[list[int]] = field(default_factory=list)
    """Per prompt and step: the token with the second-largest logit."""
    margins: list[list[float]] = field(default_factory=list)
    """Per prompt and step: the largest logit minus the second largest (how near a tie greedy was)."""


def build_prompts(tokenizer) -> list[list[int]]:
    """20 prompts: 1 token up to well past 2 blocks of 32 and past a 64-token chunk budget; some share a prefix."""
    encoded = [tokenizer.encode(t) for t in _TEXTS]
    long_text = tokenizer.encode(" ".join(_TEXTS[4:6] * 3))
    prompts = [
        encoded[7][:1],          # 1 token
        encoded[7][:2],
        encoded[3],
        encoded[0],
        encoded[1],
        encoded[2],
        long_text[:15],
        long_text[:16],          # exactly one block
        long_text[:17],
        long_text[:31],
        long_text[:32],          # exactly two blocks
        long_text[:33],
        encoded[4],
        encoded[5],
        long_text[:65],          # > 2 blocks of 32, > a 64-token chunk
        long_text[:150],
        long_text[:230],
    ]
    for question in ("Where is the Nile?", "Who built the pyramids?", "Why is the sky blue?"):
        prompts.append(tokenizer.encode(_SHARED_PREFIX + question + "<|im_end|>\n<|im_start|>assistant\n"))
    assert len(prompts) == 20
    return prompts


def build_reference() -> Reference:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvledger.loader.resolve import smollm2_gguf_path

    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run past EOS, like ignore_eos
    prompts = build_prompts(tokenizer)
    ref = Reference(prompts, [])
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            # an explicit mask: the prompt may contain <|im_end|>, which is also the pad id
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=2, output_logits=True, return_dict_in_generate=True)
            ref.outputs.append(out.sequences[0, len(prompt):].tolist())
            logits = torch.cat(out.logits, dim=0).float()
            top2 = logits.topk(2, dim=-1)
            ref.runner_ups.append(top2.indices[:, 1].tolist())
            ref.margins.append((top2.values[:, 0] - top2.values[:, 1]).tolist())
            if i in LOGIT_PROMPTS:
                ref.logits[i] = logits
    del model
    return ref
