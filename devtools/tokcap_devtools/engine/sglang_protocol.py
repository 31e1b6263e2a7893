"""Request bodies of SGLang 0.5.23's routes that differ from vLLM's.

Chat completions take SGLang's id and meta-info flags on top of the OpenAI fields
(``python/sglang/srt/entrypoints/openai/protocol.py``, ``ChatCompletionRequest``); the
native ``/generate`` takes a prompt as text or ids and a ``sampling_params`` dict with
SGLang's own names and defaults (``managers/io_struct.py`` ``GenerateReqInput``,
``sampling/sampling_params.py``). Unknown fields are ignored, as SGLang ignores them.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from .protocol import ChatCompletionRequest, OpenAIBase

# SGLang refuses these with ``stream: true`` (serving_chat.py, 0.5.23): ids come whole only.
STREAM_REFUSED_FLAGS = ("return_token_ids", "return_prompt_token_ids", "return_meta_info")


class SGLangChatRequest(ChatCompletionRequest):
    model: str | None = "default"
    return_prompt_token_ids: bool | None = False
    return_meta_info: bool | None = False
    return_routed_experts: bool = False

    @property
    def stream_refused_flag(self) -> str | None:
        """The first id flag set on a streamed request (SGLang answers it with a 400)."""
        if not self.stream:
            return None
        return next((flag for flag in STREAM_REFUSED_FLAGS if getattr(self, flag)), None)


class GenerateSamplingParams(OpenAIBase):
    max_new_tokens: int | None = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 (or 1 << 30): every token
    stop: str | list[str] | None = None
    skip_special_tokens: bool = True
    sampling_seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class GenerateRequest(OpenAIBase):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    stream: bool = False
    rid: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Either text or input_ids should be provided.")
        return self
