"""Request bodies of the OpenAI-compatible API (pydantic).

Unknown top-level fields are ignored, as OpenAI-compatible servers commonly do; fields we accept
but cannot honour (``echo``, penalties, ``logit_bias``, tools...) are rejected with a 400 instead of
being silently dropped. The extensions are ``"h2o"`` (per-request eviction settings) and
``ignore_eos`` (as in vLLM).

Types are strict, as OpenAI's API has them: ``"max_tokens": "3"``, ``"n": true`` or
``"logprobs": true`` on completions are 400s, not coerced (a JSON integer is still a valid
float). Every string must be encodable as UTF-8 (``Text``): a lone surrogate (``"\ud800"``,
valid JSON) is a 400 here rather than a tokenizer crash later. Stop strings are bounded in count
and length (``MAX_STOPS``, ``MAX_STOP_CHARS``): each generated token is checked against each.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from h2okv.serve.api.errors import APIError
from h2okv.serve.eviction import BUDGET_FIELDS

MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256  # far above real stop strings ("\n\n", "</s>"); the per-token check grows with it


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid UTF-8 (a lone surrogate at character {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class H2OSettings(BaseModel):
    """``"h2o": {"recipe": "bounded", "budget": 0.2}`` or ``{"policy": "local", "heavy_ratio": 0.1,
    "recent_ratio": 0.1}`` (or ``heavy``/``recent``; ``budget`` is a fraction of the prompt or a
    slot count, ``recent_share`` of it recent).

    Giving any budget field replaces the server's budget; giving only ``policy`` or ``recipe`` keeps it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    policy: Text | None = None
    recipe: Text | None = None
    # any JSON value: the budget's range depends on the policy, so ``EvictionDefaults.resolve`` judges it and
    # says the range (a type error here would say only "Input should be a valid integer" for "20%")
    budget: Any = None
    recent_share: float | None = None
    heavy: int | None = None
    recent: int | None = None
    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    # the prompt's first tokens after which the prefix store keeps a state (completions; a chat's
    # is its history before the last user message)
    cache_prefix: int | None = None

    def budget_given(self) -> bool:
        return any(getattr(self, name) is not None for name in BUDGET_FIELDS)

    def budget_fields(self) -> dict | None:
        """The budget fields given (the others None), or None when none is."""
        return {name: getattr(self, name) for name in BUDGET_FIELDS} if self.budget_given() else None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text
    max_tokens: int | None = Field(default=None, gt=0)
    # None: the server's default (serve/api/sampling_defaults.py: the model's, else OpenAI's 1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)  # at most the server's --max-n (serving.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)  # what torch.Generator accepts
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: Text | None = None
    # extensions
    h2o: H2OSettings | None = None
    ignore_eos: bool = False  # as in vLLM: generate exactly max_tokens (benchmarks)

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop may hold at most {MAX_STOPS} sequences", param="stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop sequences must not be empty", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop sequences may be at most {MAX_STOP_CHARS} characters long", param="stop")
        return stops

    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; k >= 0: the chosen token's logprob and the k most likely alternatives."""
        raise NotImplementedError

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise APIError(400, f"{param} is not supported", param=param)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
