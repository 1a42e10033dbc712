"""What the engine tests share: one ``generate`` read back as token ids and the last step's logits."""

from __future__ import annotations

import torch


def tokens_and_last_logits(llm, prompts: list[list[int]], params) -> tuple[list[list[int]], torch.Tensor]:
    """Each prompt's output token ids from one ``llm.generate``, and a copy of the logits of the
    engine's latest step (``[samplers, vocab]``, :attr:`ModelRunner.last_logits`)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.runner.last_logits.clone()
