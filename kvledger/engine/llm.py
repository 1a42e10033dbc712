"""``LLM``: offline generation over the engine, with vLLM's call shapes.

    from kvledger import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from kvledger.config import EngineConfig
from kvledger.engine.limits import check_before_loading
from kvledger.engine.llm_engine import LLMEngine
from kvledger.engine.outputs import KVLedger, RequestOutput
from kvledger.engine.sampling_params import SamplingParams
from kvledger.errors import KVLedgerError

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """A model with its engine. ``engine_args`` are :class:`EngineConfig` fields (vLLM names)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        check_before_loading(config)  # the model's name, --max-model-len and a user-sized pool, in a second
        self.llm_engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def ledger(self) -> KVLedger:
        return self.llm_engine.ledger()

    def _to_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.llm_engine.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self._to_ids(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise KVLedgerError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished :class:`RequestOutput` per prompt, in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise KVLedgerError(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one per prompt")
        order: list[str] = []
        engine = self.llm_engine
        try:
            for prompt, sp in zip(prompts, params):
                ids, text = self._to_ids(prompt)
                request_id = str(next(self._ids))
                engine.add_request(request_id, ids, sp, prompt=text)
                order.append(request_id)
        except KVLedgerError:
            for request_id in order:
                engine.abort_request(request_id)
            raise
        return self._run(order, use_tqdm)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", unit="req", disable=not use_tqdm or len(order) < 2,
                   dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in order:
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[r] for r in order]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the checkpoint's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.llm_engine.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
            ids = self.llm_engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
