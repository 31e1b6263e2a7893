"""A vLLM chat stream, read as it arrives: what each chunk adds, and the whole it adds up to.

Followed: vLLM's ``chat_completion_stream_generator`` (``serving_chat.py``) with
``return_token_ids``: the first chunk carries the top-level ``prompt_token_ids``; each later
chunk its choice's ``delta`` (``content``, ``reasoning_content``, ``tool_calls`` pieces),
``logprobs.content`` and the ``token_ids`` it adds, the last one ``finish_reason`` and
``stop_reason``; with ``stream_options.include_usage`` a final chunk the usage. A chunk may
carry ids and no text (a tool-call parser holds text back). Before vLLM 0.12 such chunks
were dropped whole, ids and all (vLLM PR #29074), so the front end relays only from 0.12 on
(``RELAY_SINCE``), and the engine's own count (``usage.completion_tokens``) still decides:
the accumulated stream is checked exactly as a whole reply is (``vllm.read_chat``).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.engine.http import sse_chunk
from api.ids import new_id
from api.types import Delta

# The first vLLM release whose chat stream carries the ids of every chunk.
RELAY_SINCE = (0, 12, 0)


@dataclass
class StreamedChat:
    """The chunks of one stream so far, in the shape of vLLM's whole reply."""

    model: str = ""
    prompt_token_ids: Any = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[Any] | None = None  # None until a chunk carries them
    logprobs: list[Any] | None = None
    finish_reason: Any = None
    stop_reason: Any = None
    usage: Any = None
    problem: str | None = None  # a chunk that broke the shape: the ids cannot be trusted

    def add(self, chunk: Any) -> Delta:
        """Take one chunk; what it adds for the harness (empty when nothing)."""
        if not isinstance(chunk, Mapping):
            self.problem = self.problem or "a stream chunk is not a JSON object"
            return Delta()
        self.model = self.model or str(chunk.get("model") or "")
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = _packed(chunk["prompt_token_ids"])
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return Delta()
        choice = choices[0]
        if not isinstance(choice, Mapping) or len(choices) > 1:
            self.problem = self.problem or "a stream chunk holds other than one choice"
            return Delta()
        self._ids(choice)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
        delta = choice.get("delta") if isinstance(choice.get("delta"), Mapping) else {}
        reasoning = _text(delta.get("reasoning_content") or delta.get("reasoning"))
        text = _text(delta.get("content"))
        self.reasoning.append(reasoning)
        self.text.append(text)
        pieces = (self._call_piece(piece) for piece in delta.get("tool_calls") or ())
        return Delta(reasoning, text, tuple(piece for piece in pieces if piece))

    def _ids(self, choice: Mapping[str, Any]) -> None:
        ids = choice.get("token_ids")
        if ids is not None:
            if isinstance(ids, list):
                self.token_ids = self.token_ids if self.token_ids is not None else []
                self.token_ids.extend(ids)
            else:
                self.problem = self.problem or "a chunk's token_ids is not a list"
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
        if isinstance(content, list):
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(content)

    def _call_piece(self, piece: Any) -> dict[str, Any]:
        """Fold one tool-call piece into its call; the piece, with the call's id on its
        first (made here when the engine names none, so what is relayed is what is kept)."""
        if not isinstance(piece, Mapping) or not isinstance(piece.get("index", 0), int):
            self.problem = self.problem or "a tool-call piece is not an indexed object"
            return {}
        index = piece.get("index", 0)
        function = piece.get("function") if isinstance(piece.get("function"), Mapping) else {}
        call = self.calls.get(index)
        first = call is None
        if call is None:
            call = self.calls[index] = {
                "id": str(piece.get("id") or new_id("call_")),
                "type": "function",
                "function": {"name": "", "arguments": ""},
            }
        name = function.get("name")
        if isinstance(name, str) and name:
            call["function"]["name"] += name
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else ""
        call["function"]["arguments"] += arguments
        return {
            "index": index,
            "id": call["id"] if first else None,
            "name": call["function"]["name"] if first else None,
            "arguments": arguments,
        }

    def unfinished(self) -> str | None:
        """Why the whole stream cannot be trusted (``finished``), or None."""
        return finished(self)

    def response(self) -> dict[str, Any]:
        """What the stream added up to, as vLLM's whole chat reply (its usage as reported;
        a stream that reported none has ``problem`` set by ``finish``)."""
        calls = [self.calls[index] for index in sorted(self.calls)]
        text = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if any(self.reasoning):
            message["reasoning_content"] = "".join(self.reasoning)
        if calls:
            message["tool_calls"] = calls
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": self.logprobs} if self.logprobs is not None else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "token_ids": self.token_ids,
        }
        prompt = self.prompt_token_ids
        return {
            "model": self.model,
            "prompt_token_ids": prompt.tolist() if isinstance(prompt, array) else prompt,
            "choices": [choice],
            "usage": self.usage,
        }


def finished(stream: StreamedChat) -> str | None:
    """Why the whole stream cannot be trusted, or None: without its usage chunk the ids
    cannot be counted against what the engine generated."""
    if stream.problem is not None:
        return stream.problem
    if not isinstance(stream.usage, Mapping):
        return "the stream ended without its usage chunk: its ids cannot be counted"
    return None


def _packed(ids: Any) -> Any:
    """Prompt ids held as 4 bytes each while the generation streams (a 100k-token prompt:
    400 KB, not 3.6 MB of int objects); what does not pack stays as sent, for the checks."""
    if not isinstance(ids, list) or list(map(type, ids)).count(int) != len(ids):
        return ids  # booleans or anything else are the checks' to refuse, as sent
    try:
        return array("I", ids)
    except OverflowError:  # negative, or beyond uint32
        return ids


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


@dataclass
class StreamedCompletion:
    """The chunks of one token-in stream (``/v1/completions``) so far, in the shape of the
    whole reply ``vllm.read_tokens`` checks.

    Followed: vLLM 0.32's ``completion_stream_generator`` (``serving_completion.py``) with
    ``return_token_ids``: a choice's first chunk carries its ``prompt_token_ids``, every
    chunk the ``token_ids`` and ``logprobs`` it adds, the last ``finish_reason`` and
    ``stop_reason``; with ``stream_options.include_usage`` a final chunk the usage.
    """

    prompt_token_ids: Any = None
    text: list[str] = field(default_factory=list)
    token_ids: list[Any] = field(default_factory=list)
    tokens: list[Any] = field(default_factory=list)
    token_logprobs: list[Any] = field(default_factory=list)
    finish_reason: Any = None
    stop_reason: Any = None
    usage: Any = None
    problem: str | None = None

    def add(self, data: str) -> None:
        """Take one chunk (a broken one sets ``problem``: the ids cannot be trusted)."""
        chunk = sse_chunk(data)
        if not isinstance(chunk, Mapping):
            self.problem = self.problem or "a stream chunk is not a JSON object"
            return
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        if not isinstance(choice, Mapping) or len(choices) > 1:
            self.problem = self.problem or "a stream chunk holds other than one choice"
            return
        if choice.get("prompt_token_ids") is not None:
            self.prompt_token_ids = choice["prompt_token_ids"]
        self.text.append(_text(choice.get("text")))
        self._ids(choice.get("token_ids"), choice.get("logprobs"))
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def _ids(self, ids: Any, logprobs: Any) -> None:
        """A chunk's ids and their log-probs (a chunk that adds no id may carry none)."""
        if not isinstance(ids, list):
            self.problem = self.problem or "a stream chunk carries no token_ids"
            return
        if not ids and logprobs is None:
            return
        if not isinstance(logprobs, Mapping):
            self.problem = self.problem or "a stream chunk's ids carry no log-probs"
            return
        tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
        if not isinstance(tokens, list) or not isinstance(values, list):
            self.problem = self.problem or "a stream chunk's log-probs are not lists"
            return
        self.token_ids.extend(ids)
        self.tokens.extend(tokens)
        self.token_logprobs.extend(values)

    def sampled(self) -> list[Any]:
        """The ids sampled so far (as the engine sent them: the checks come at the end)."""
        return self.token_ids

    def unfinished(self) -> str | None:
        if self.problem is not None:
            return self.problem
        if not isinstance(self.usage, Mapping):
            return "the stream ended without its usage chunk: its ids cannot be counted"
        return None

    def response(self) -> dict[str, Any]:
        """What the stream added up to, as vLLM's whole completions reply."""
        choice = {
            "index": 0,
            "text": "".join(self.text),
            "logprobs": {"tokens": self.tokens, "token_logprobs": self.token_logprobs},
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
        }
        return {"choices": [choice], "usage": self.usage}
