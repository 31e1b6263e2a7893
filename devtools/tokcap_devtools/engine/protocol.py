"""Request bodies the engine accepts, named and defaulted as vLLM's OpenAI server names them.

Unknown fields are accepted and ignored (vLLM logs and ignores them), so clients written
against vLLM — or the OpenAI SDK with ``extra_body`` — work unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBase):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBase):
    model: str | None = None
    n: int | None = Field(default=1, ge=1, le=64)
    # vLLM bounds it to a torch long (protocol.py: ge=_LONG_INFO.min, le=_LONG_INFO.max).
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: every token
    max_tokens: int | None = Field(default=None, ge=1)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    # vLLM 0.32 (``SamplingParams.routed_experts_prompt_start``, on its chat and completion
    # requests): the first N prompt positions are left out of the returned routes. Read by
    # the vLLM wire only; SGLang has no such field and ignores it.
    routed_experts_prompt_start: int = Field(default=0, ge=0)

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    @property
    def effective_tool_choice(self) -> str | dict:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def prompts(self) -> list[list[int] | str]:
        """The batch of prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TokenizeRequest(OpenAIBase):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[int]
