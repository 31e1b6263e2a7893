"""OpenAI Responses: the dialect (``api.dialects.dialect.Dialect``) of Responses clients.

The request side is ``api.dialects.responses_request`` (``to_chat``); here the Responses
object served, its numbered stream of events (replayed whole, or relayed as the engine
samples), and the error shape.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping
from typing import Any

from api.dialects.common import openai_error_body
from api.dialects.responses_request import REQUEST_SCHEMA as REQUEST_SCHEMA
from api.dialects.responses_request import to_chat as to_chat
from api.dialects.sse import event
from api.ids import item_id, new_id
from api.types import Delta, ServedCall

NAME = "responses"
PATH = "/v1/responses"


def reply_head(body: Mapping[str, Any]) -> dict[str, Any]:
    """The reply's identity, fixed before the engine answers (a stream opens with it)."""
    return {
        "id": new_id("resp_"),
        "created_at": int(time.time()),
        "model": body.get("model") if isinstance(body.get("model"), str) else "",
    }


def _response(head: Mapping[str, Any], body: Mapping[str, Any], **state: Any) -> dict[str, Any]:
    """A Responses object of this request, in the given state (status, output, usage...)."""
    return {
        "id": head["id"],
        "object": "response",
        "created_at": head["created_at"],
        "status": "in_progress",
        "incomplete_details": None,
        "error": None,
        "model": head["model"],
        "output": [],
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": None,
        "metadata": {},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": None,
        **state,
    }


def reply(
    captured: ServedCall, body: Mapping[str, Any], head: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The Responses object served to the harness: the captured items, no token arrays."""
    generation = captured.generation
    truncated = generation.finish_reason == "length"
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return _response(
        head or reply_head(body),
        body,
        status="incomplete" if truncated else "completed",
        incomplete_details={"reason": "max_output_tokens"} if truncated else None,
        output=copy.deepcopy(captured.items),
        usage={
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    )


error_body = openai_error_body


def _item_added(item: Mapping[str, Any]) -> dict[str, Any]:
    added = copy.deepcopy(dict(item))
    if item["type"] in ("message", "reasoning"):
        added["content"] = []
    if item["type"] == "function_call":
        added["arguments"] = ""
    if "status" in added:
        added["status"] = "in_progress"
    return added


# An SSE comment: what a stream sends while nothing else is (SDKs skip comment lines).
KEEPALIVE = b": keep-alive\n\n"
_OPENING_EVENTS = 2  # response.created, response.in_progress


def _numbered(emitted: Iterator[tuple[str, dict[str, Any]]], first: int = 0) -> list[bytes]:
    return [
        event(kind, {"type": kind, "sequence_number": first + n, **fields})
        for n, (kind, fields) in enumerate(emitted)
    ]


def _opening(response: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield _emit("response.created", response=response)
    yield _emit("response.in_progress", response=response)


def opening(head: Mapping[str, Any], body: Mapping[str, Any]) -> list[bytes]:
    """What a stream sends before the reply is known: created and in progress."""
    return _numbered(_opening(_response(head, body)))


def stream_error(
    head: Mapping[str, Any], body: Mapping[str, Any], status: int, message: str, sent: int
) -> bytes:
    """``response.failed``, which ends a stream whose reply cannot be served (``sent``: the
    events before it, so its sequence number follows theirs)."""
    code = "invalid_request" if 400 <= status < 500 else "server_error"
    failed = _response(head, body, status="failed", error={"code": code, "message": message})
    return _numbered(iter([_emit("response.failed", response=failed)]), sent)[0]


def events(reply: Mapping[str, Any], body: Mapping[str, Any], opened: bool) -> list[bytes]:
    """The reply's events, numbered from the stream's start; without the opening ones when
    the stream ``opened`` already (they are the same for a reply of this head)."""
    numbered = _numbered(_events(reply))
    return numbered[_OPENING_EVENTS:] if opened else numbered


def _emit(kind: str, /, **fields: Any) -> tuple[str, dict[str, Any]]:
    return kind, fields


def _events(reply: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The events of a finished reply, in order, unnumbered."""
    opening = {
        **copy.deepcopy(dict(reply)),
        "status": "in_progress",
        "incomplete_details": None,
        "output": [],
        "usage": None,
    }
    yield from _opening(opening)
    for index, item in enumerate(reply["output"]):
        yield from _item_events(index, item)
    final = "response.completed" if reply["status"] == "completed" else "response.incomplete"
    yield _emit(final, response=reply)


def _item_events(index: int, item: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """One finished item's events: added, its content whole, done."""
    ids = {"item_id": item["id"], "output_index": index}
    yield _emit("response.output_item.added", output_index=index, item=_item_added(item))
    if item["type"] == "message":
        for part_index, part in enumerate(item["content"]):
            at = {**ids, "content_index": part_index}
            yield _emit("response.content_part.added", **at, part={**part, "text": ""})
            if part["text"]:
                yield _emit("response.output_text.delta", **at, delta=part["text"], logprobs=[])
    elif item["type"] == "reasoning":
        for part_index, part in enumerate(item["content"]):
            at = {**ids, "content_index": part_index}
            yield _emit("response.reasoning_text.delta", **at, delta=part["text"])
    elif item["type"] == "function_call" and item["arguments"]:
        yield _emit("response.function_call_arguments.delta", **ids, delta=item["arguments"])
    yield from _item_done(index, item)


def _item_done(index: int, item: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The events that close an item whose content was sent: each part's done, the item's."""
    ids = {"item_id": item["id"], "output_index": index}
    if item["type"] == "message":
        for part_index, part in enumerate(item["content"]):
            at = {**ids, "content_index": part_index}
            yield _emit("response.output_text.done", **at, text=part["text"], logprobs=[])
            yield _emit("response.content_part.done", **at, part=part)
    elif item["type"] == "reasoning":
        for part_index, part in enumerate(item["content"]):
            at = {**ids, "content_index": part_index}
            yield _emit("response.reasoning_text.done", **at, text=part["text"])
    elif item["type"] == "function_call":
        yield _emit(
            "response.function_call_arguments.done",
            **ids,
            name=item["name"],
            arguments=item["arguments"],
        )
    yield _emit("response.output_item.done", output_index=index, item=item)


def _streamed_item(kind: str, reply_id: str, piece: Mapping[str, Any] | None) -> dict[str, Any]:
    """An output item opened by the stream, its content empty until deltas fill it; named as
    the capture names the item it stores (``item_id``)."""
    if kind == "reasoning":
        content = [{"type": "reasoning_text", "text": ""}]
        return {
            "type": "reasoning",
            "id": item_id("rs_", reply_id),
            "summary": [],
            "content": content,
        }
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": []}
        message_id = item_id("msg_", reply_id)
        return {"type": "message", "id": message_id, "role": "assistant", "content": [part]}
    assert piece is not None
    index = piece["index"]
    return {
        "type": "function_call",
        "id": item_id("fc_", reply_id, index),
        "call_id": str(piece["id"] or item_id("call_", reply_id, index)),
        "name": str(piece["name"] or ""),
        "arguments": "",
    }


class Relay:
    """A reply relayed as the engine samples it: an output item per kind in the order they
    come (reasoning, the message, each tool call), each delta as its item's delta event.

    An item is named when it opens as the capture names it, so ``close`` finds the captured
    items under the ids the stream announced: it closes the last one as captured, sends the
    items the stream did not open, then ``response.completed``. Sequence numbers run on
    from the opening events.
    """

    def __init__(self, head: Mapping[str, Any], body: Mapping[str, Any]) -> None:
        self.reply_id = str(head["id"])
        self.sequence = _OPENING_EVENTS
        self.items: list[dict[str, Any]] = []
        self.kind: str | None = None

    def _numbered(self, emitted: list[tuple[str, dict[str, Any]]]) -> list[bytes]:
        sent = _numbered(iter(emitted), self.sequence)
        self.sequence += len(sent)
        return sent

    def _item(
        self, kind: str, emitted: list[tuple[str, Any]], piece: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The item ``kind`` deltas go to, opened (and the previous one closed) on a change;
        with the fields that place its events."""
        if self.kind != kind:
            if self.items:
                emitted.extend(_item_done(len(self.items) - 1, self.items[-1]))
            item = _streamed_item(kind.split(" ")[0], self.reply_id, piece)
            self.items.append(item)
            self.kind = kind
            index = len(self.items) - 1
            # A copy, emptied: this delta goes on to fill the item before it is sent.
            added = _item_added(item)
            emitted.append(_emit("response.output_item.added", output_index=index, item=added))
            if item["type"] == "message":
                part = {**item["content"][0], "text": ""}
                at = {"item_id": item["id"], "output_index": index, "content_index": 0}
                emitted.append(_emit("response.content_part.added", **at, part=part))
        return self.items[-1], {
            "item_id": self.items[-1]["id"],
            "output_index": len(self.items) - 1,
        }

    def delta(self, delta: Delta) -> list[bytes]:
        emitted: list[tuple[str, Any]] = []
        if delta.reasoning:
            item, at = self._item("reasoning", emitted)
            item["content"][0]["text"] += delta.reasoning
            reasoning = _emit(
                "response.reasoning_text.delta", **at, content_index=0, delta=delta.reasoning
            )
            emitted.append(reasoning)
        if delta.text:
            item, at = self._item("message", emitted)
            item["content"][0]["text"] += delta.text
            text = _emit(
                "response.output_text.delta", **at, content_index=0, delta=delta.text, logprobs=[]
            )
            emitted.append(text)
        for piece in delta.tool_calls:
            item, at = self._item(f"function_call {piece['index']}", emitted, piece)
            item["arguments"] += piece["arguments"]
            if piece["arguments"]:
                arguments = _emit(
                    "response.function_call_arguments.delta", **at, delta=piece["arguments"]
                )
                emitted.append(arguments)
        return self._numbered(emitted)

    def close(self, reply: Mapping[str, Any]) -> list[bytes]:
        """The open item's done (as captured), the items not streamed, the completion."""
        output = reply["output"]
        captured = {item["id"]: item for item in output}
        announced = {item["id"] for item in self.items}
        emitted: list[tuple[str, Any]] = []
        if self.items:
            last = self.items[-1]
            emitted.extend(_item_done(len(self.items) - 1, captured.get(last["id"], last)))
        for index, item in enumerate(output):
            if item["id"] not in announced:
                emitted.extend(_item_events(index, item))
        final = "response.completed" if reply["status"] == "completed" else "response.incomplete"
        emitted.append(_emit(final, response=reply))
        return self._numbered(emitted)
