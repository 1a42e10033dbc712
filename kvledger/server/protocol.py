"""Request and response bodies of the OpenAI API, as pydantic models.

Requests are validated strictly from the raw JSON bytes: wrong types are not coerced
(``"max_tokens": "5"`` is an error), numbers must be finite (``NaN``, ``Infinity``, ``1e999``
are errors), integer parameters must fit in 64 bits, fields we do not know are rejected by name, and
OpenAI fields we do not implement are accepted only at their no-op values (``n=1``,
``echo=false``, ``logprobs=null``, penalties 0, ...), so a client never gets silently
different behaviour. Extra fields that vLLM accepts (``top_k``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ...) are supported with vLLM's meaning.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvledger.units import INT64_MAX, INT64_MIN
from kvledger.server.errors import APIError


DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat defaults to the context's room)."""


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""An integer parameter: what a 64-bit tensor holds, as in vLLM."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _final_usage_only(cls, v: bool) -> bool:
        if v:
            raise ValueError("'continuous_usage_stats'=True is not supported (usage comes once, at the end)")
        return v




class _SamplingFields(_Strict):
    """Fields shared by completions and chat: sampling, stopping and streaming."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float | None = 1.0

    NO_OPS: ClassVar[dict[str, tuple]] = {
        "n": (1,), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    }
    """Fields accepted only at the values that change nothing, by name."""

    @field_validator("*")
    @classmethod
    def _no_op_only(cls, v: Any, info) -> Any:
        allowed = cls.NO_OPS.get(info.field_name)
        if allowed is not None and v not in allowed:
            raise ValueError(f"'{info.field_name}'={v!r} is not supported (only {' or '.join(map(repr, allowed))})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("'logit_bias' is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for :class:`kvledger.SamplingParams` (OpenAI's defaults filled in)."""
        return dict(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text or token ids; one prompt per request."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1, le=INT64_MAX)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    NO_OPS = {**_SamplingFields.NO_OPS, "echo": (False,), "logprobs": (None,), "best_of": (None, 1), "suffix": (None,)}

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"batches of {len(v)} prompts are not supported; send one prompt per request")
        if v == [] or v == [[]]:
            raise ValueError("the prompt is empty")
        return v

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or as token ids."""
        p = self.prompt
        return p[0] if isinstance(p, list) and p and isinstance(p[0], (str, list)) else p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message; ``content`` is required (OpenAI lets an assistant message omit it only beside
    ``tool_calls``, which this server does not take)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: text messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    NO_OPS = {**_SamplingFields.NO_OPS, "logprobs": (None, False), "top_logprobs": (None,),
              "tool_choice": (None, "none")}

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("'tools' is not supported (no tool calling)")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict | None) -> dict | None:
        if v is not None and v != {"type": "text"}:
            raise ValueError("'response_format' is not supported (only {'type': 'text'})")
        return v

    @model_validator(mode="after")
    def _one_limit(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise PydanticCustomError(
                    "conflicting_fields", "'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({other}) "
                    "disagree; send one ('max_tokens' is the older name)",
                    {"param": "max_completion_tokens", "max_tokens": self.max_tokens,
                     "other": self.max_completion_tokens})
            self.max_tokens = self.max_completion_tokens
        return self

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


# --- parsing -------------------------------------------------------------------------------

_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _field_path(loc: tuple) -> str:
    """``('messages', 0, 'content')`` -> ``messages[0].content``; union member tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or part.startswith(("function-", "literal")) \
                or part[:1].isupper():
            continue
        else:
            out += f".{part}" if out else part
    return out


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """One line naming the offending field, and the top-level field for ``param``."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}", None
    if first["type"] == "model_type" and not first["loc"]:
        return "the request body must be a JSON object", None
    if first["type"] == "conflicting_fields":  # a check across fields: it names them, and its param
        return first["msg"], first["ctx"]["param"]
    path = _field_path(first["loc"])
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "extra_forbidden":
        return f"unsupported parameter '{path}'", param
    if first["type"] == "missing":
        return f"'{path}' is required", param
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    msg = first["msg"].removeprefix("Value error, ")
    if len(same_field) > 1 and param == "prompt":
        msg = "must be a string, a list of token ids, or a one-element list of either"
    shown = repr(first.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"invalid value for '{path}': {msg} (got {shown})", param


def parse_request(model_cls: type[BaseModel], raw: bytes) -> Any:
    """Validate a raw JSON body; any problem is an :class:`APIError` 400 naming the field."""
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as err:
        message, param = validation_message(err)
        raise APIError(400, message, param=param) from None


# --- responses -----------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    """What every choice has; the subclasses add its text, message or delta."""

    index: int = 0
    logprobs: None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    """What every completion response and stream chunk has besides ``object`` and ``choices``."""

    id: str
    created: int
    model: str


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: ChatResponseMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Choice):
    delta: DeltaMessage


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvledger"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
