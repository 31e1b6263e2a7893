"""A real HTTP proxy between the front end and the engine that corrupts the engine's reply.

    with corrupting_proxy(engine_url, "nan_logprob") as proxy:
        ... front end with upstream=proxy.url ...
        proxy.mode = "drop_last_id"   # takes effect from the next request
        proxy.delay_s = 2.0           # wait before forwarding each model call
        proxy.mode = None             # forward untouched
        proxy.schedule = itertools.cycle(["nan_logprob", None])  # a mode per model call

``POST /v1/chat/completions`` is forwarded with httpx and its JSON reply rewritten by the
current ``mode`` (one of ``MODES``); a streamed reply is rewritten the same way once its
chunks' ids and log-probs are moved onto its last token chunk (``_stream_view``); every other path (``/v1/models``, ``/version``,
``/tokenize``, ...) passes through untouched. ``delay_s`` (seconds, default 0) is slept before
each model call is forwarded, for fault tests that need a call in flight. Both are plain
attributes, read per request, so a test may change them between calls. Non-finite numbers
are written as the stdlib writes them (``NaN``, ``Infinity``), which is not strict JSON.
``schedule``, when set, gives each model call's mode in turn instead of ``mode``.
``requests`` counts the requests per path, ``corrupted`` the replies rewritten and
``applied`` those per mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response

from tests.support.servers import serve_app

# An id beyond the tokcap engine's vocabulary (4100 ids) and any configured for it in tests.
BEYOND_VOCAB_ID = 1_000_000


def _choice(data: dict[str, Any]) -> dict[str, Any]:
    return data["choices"][0]


def _content(data: dict[str, Any]) -> list[dict[str, Any]]:
    return _choice(data)["logprobs"]["content"]


def _set_last_logprob(value: Any) -> Callable[[dict[str, Any]], None]:
    def corrupt(data: dict[str, Any]) -> None:
        _content(data)[-1]["logprob"] = value

    return corrupt


def _prompt_shift(data: dict[str, Any]) -> None:
    data["prompt_token_ids"] = data["prompt_token_ids"][1:]


def _prompt_truncate(data: dict[str, Any]) -> None:
    ids = data["prompt_token_ids"]
    data["prompt_token_ids"] = ids[: len(ids) // 2]


def _drop_last_id(data: dict[str, Any]) -> None:
    # Both id sources lose the same id, so they still agree; only the usage count can tell.
    choice = _choice(data)
    choice["token_ids"] = choice["token_ids"][:-1]
    del _content(data)[-1]


def _no_token_ids(data: dict[str, Any]) -> None:
    del _choice(data)["token_ids"]


def _no_logprobs(data: dict[str, Any]) -> None:
    _choice(data)["logprobs"] = None


def _no_prompt_ids(data: dict[str, Any]) -> None:
    del data["prompt_token_ids"]


def _empty_generation(data: dict[str, Any]) -> None:
    # The message (text, tool calls) stays as the engine served it.
    _choice(data)["token_ids"] = []
    _choice(data)["logprobs"]["content"] = []


def _id_beyond_vocab(data: dict[str, Any]) -> None:
    _choice(data)["token_ids"][-1] = BEYOND_VOCAB_ID
    _content(data)[-1]["token"] = f"token_id:{BEYOND_VOCAB_ID}"


MODES: dict[str, Callable[[dict[str, Any]], None]] = {
    "prompt_shift": _prompt_shift,
    "prompt_truncate": _prompt_truncate,
    "no_prompt_ids": _no_prompt_ids,
    "drop_last_id": _drop_last_id,
    "nan_logprob": _set_last_logprob(float("nan")),
    "inf_logprob": _set_last_logprob(float("inf")),
    "string_logprob": _set_last_logprob("-0.5"),
    "positive_logprob": _set_last_logprob(0.5),
    "placeholder_logprob": _set_last_logprob(-9999.0),
    "no_token_ids": _no_token_ids,
    "no_logprobs": _no_logprobs,
    "empty_generation": _empty_generation,
    "id_beyond_vocab": _id_beyond_vocab,
}


def _stream_view(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole reply whose fields are the stream's own: its first chunk's prompt ids, and
    the last token chunk's choice, onto which every chunk's ids and log-probs were moved
    (a stream a tool parser held back to its end looks so too). ``MODES`` rewrite it."""
    carrying = [c for c in chunks if c.get("choices") and "token_ids" in c["choices"][0]]
    last = carrying[-1]["choices"][0]
    ids, content = [], []
    for chunk in carrying:
        choice = chunk["choices"][0]
        ids += choice.pop("token_ids") or []
        content += (choice.pop("logprobs") or {}).get("content") or []
    last.update(token_ids=ids, logprobs={"content": content})
    view = {"choices": [last]}
    if "prompt_token_ids" in chunks[0]:
        view["prompt_token_ids"] = chunks[0]["prompt_token_ids"]
    return view


def _sse_chunks(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


class CorruptingProxy:
    """The proxy's app and its knobs; ``url`` is set once it is served."""

    def __init__(self, engine: str, mode: str | None = None, *, delay_s: float = 0.0) -> None:
        self.engine = engine
        self.mode = mode
        self.delay_s = delay_s
        self.schedule: Iterator[str | None] | None = None
        self.url = ""
        self.requests: Counter[str] = Counter()
        self.corrupted = 0
        self.applied: Counter[str] = Counter()
        self.app = self._build_app()

    def corrupt(self, data: dict[str, Any]) -> dict[str, Any]:
        """The reply as the current mode rewrites it (in place); unknown modes fail loudly."""
        mode = next(self.schedule) if self.schedule is not None else self.mode
        if mode is not None:
            if mode not in MODES:
                raise ValueError(f"unknown corruption mode {mode!r}; known: {sorted(MODES)}")
            MODES[mode](data)
            self.corrupted += 1
            self.applied[mode] += 1
        return data

    def _corrupt_stream(self, text: str) -> bytes:
        """A streamed reply rewritten as the current mode rewrites a whole one."""
        chunks = _sse_chunks(text)
        view = self.corrupt(_stream_view(chunks))
        chunks[0].pop("prompt_token_ids", None)
        if "prompt_token_ids" in view:
            chunks[0]["prompt_token_ids"] = view["prompt_token_ids"]
        lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
        return ("".join(lines) + "data: [DONE]\n\n").encode()

    def interleave(self, clean_calls: int, modes: Iterable[str] = MODES) -> None:
        """From now on, each mode in turn on one call, then ``clean_calls`` calls untouched."""
        plan = [step for mode in modes for step in [mode, *[None] * clean_calls]]
        self.schedule = itertools.cycle(plan)

    def _build_app(self) -> FastAPI:
        http = httpx.AsyncClient(base_url=self.engine, timeout=60)

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield
            await http.aclose()

        app = FastAPI(lifespan=lifespan)

        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def forward(path: str, request: Request) -> Response:
            self.requests["/" + path] += 1
            chat = request.method == "POST" and path == "v1/chat/completions"
            if chat and self.delay_s:
                await asyncio.sleep(self.delay_s)
            upstream = await http.request(
                request.method,
                "/" + path,
                content=await request.body(),
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
            content = upstream.content
            kind = upstream.headers.get("content-type", "")
            if chat and upstream.status_code == 200 and kind.startswith("application/json"):
                content = json.dumps(self.corrupt(upstream.json())).encode()
            elif chat and upstream.status_code == 200 and kind.startswith("text/event-stream"):
                content = self._corrupt_stream(upstream.text)
            media_type = upstream.headers.get("content-type")
            return Response(content, status_code=upstream.status_code, media_type=media_type)

        return app


@contextlib.contextmanager
def corrupting_proxy(
    engine: str, mode: str | None = None, *, delay_s: float = 0.0
) -> Iterator[CorruptingProxy]:
    """Serve a ``CorruptingProxy`` to ``engine`` on 127.0.0.1 for the ``with`` block."""
    proxy = CorruptingProxy(engine, mode, delay_s=delay_s)
    with serve_app(proxy.app) as url:
        proxy.url = url
        yield proxy
