"""A pass-through proxy between the front end and a real engine that keeps its replies.

Streams are relayed chunk by chunk as they come (so the front end's relay and keep-alive
see the engine's own timing) and recorded once whole. Each sampling reply becomes one
sampled sequence in the ground truth's shape: the prompt ids, the generated ids and their
log-probs, as the engine sent them (vLLM chat: ``token_ids`` and ``logprobs.content``;
completions: ``token_logprobs``; SGLang chat: ``response_token_ids``; its ``/generate``:
``output_ids`` and ``meta_info.output_token_logprobs``, the prompt being the request's
``input_ids``), and SGLang's routed experts where it sent them (``meta_info``). On its way to SGLang each sampling request gets the scripted-turns processor
(``sglang_turns``), which SGLang takes per request; the front end never sends one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.real_engines.agent_script import SGLANG_PROCESSOR
from tests.support.servers import serve_app

SAMPLING_PATHS = ("v1/chat/completions", "v1/completions", "generate")
READY_PATH = "/recording-proxy/ready"


def _log_probs(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return [entry["logprob"] for entry in logprobs["content"] or []]
    return list(logprobs.get("token_logprobs") or [])


def sampled_sequence(chunks: list[dict[str, Any]], request: dict[str, Any]) -> dict[str, Any]:
    """One reply (a whole body, or a stream's chunks in order) as what was sampled."""
    prompt, ids, log_probs, routes = None, [], [], None
    for chunk in chunks:
        if "output_ids" in chunk:  # SGLang's /generate
            triples = chunk["meta_info"]["output_token_logprobs"]
            prompt, ids = request["input_ids"], chunk["output_ids"]
            log_probs = [triple[0] for triple in triples]
            routes = chunk["meta_info"].get("routed_experts")
        prompt = chunk.get("prompt_token_ids") or prompt
        for choice in chunk.get("choices") or []:
            prompt = choice.get("prompt_token_ids") or prompt
            ids += choice.get("token_ids") or choice.get("response_token_ids") or []
            log_probs += _log_probs(choice)
            routes = (choice.get("meta_info") or {}).get("routed_experts") or routes
    sequence = {"prompt_token_ids": prompt, "token_ids": ids, "logprobs": log_probs}
    return sequence | ({"routed_experts": routes} if routes is not None else {})


def with_processor(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A sampling request to SGLang with the scripted-turns processor added."""
    if path == "generate":
        sampling = {**(body.get("sampling_params") or {}), "custom_params": {}}
        return {**body, "custom_logit_processor": SGLANG_PROCESSOR, "sampling_params": sampling}
    return {**body, "custom_logit_processor": SGLANG_PROCESSOR, "custom_params": {}}


class RecordingProxy:
    """The proxy's app and what it saw: ``sampled`` replies, ``streams`` streamed ones."""

    def __init__(self, engine: str, log: Path | None = None, family: str = "vllm") -> None:
        self.engine = engine
        self.family = family
        self.log = log  # where each sampled sequence is also appended, as a JSON line
        self.sampled: list[dict[str, Any]] = []
        self.streams = 0
        self.paths: list[str] = []
        self.url = ""
        self.app = self._build_app()

    def _record(self, chunks: list[dict[str, Any]], request: dict[str, Any]) -> None:
        sequence = sampled_sequence(chunks, request)
        self.sampled.append(sequence)
        if self.log is not None:
            with self.log.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(sequence) + "\n")

    def _build_app(self) -> FastAPI:
        http = httpx.AsyncClient(base_url=self.engine, timeout=600)

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield
            await http.aclose()

        app = FastAPI(lifespan=lifespan)

        @app.get(READY_PATH)
        async def ready() -> Response:  # the proxy's own: the engine's /health may generate
            return Response(status_code=204)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            self.paths.append("/" + path)
            content = await request.body()
            sent = json.loads(content) if path in SAMPLING_PATHS and content else {}
            if sent and self.family == "sglang":
                sent = with_processor(path, sent)
                content = json.dumps(sent).encode()
            upstream = http.build_request(
                request.method,
                "/" + path,
                params=request.query_params,  # /pause?mode=abort
                content=content,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
            reply = await http.send(upstream, stream=True)
            kind = reply.headers.get("content-type", "")
            sampling = path in SAMPLING_PATHS and reply.status_code == 200
            if sampling and kind.startswith("text/event-stream"):
                self.streams += 1
                return StreamingResponse(self._relay(reply, sent), media_type=kind)
            body = await reply.aread()
            await reply.aclose()
            if sampling:
                self._record([json.loads(body)], sent)
            return Response(body, status_code=reply.status_code, media_type=kind or None)

        return app

    async def _relay(self, reply: httpx.Response, sent: dict[str, Any]) -> AsyncIterator[bytes]:
        """The engine's stream, piece by piece; recorded once it ended, also when the client
        closes the connection right after the last piece (which ends this generator at
        its ``yield``)."""
        chunks, pending = [], b""
        try:
            async for piece in reply.aiter_bytes():
                pending += piece
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: {"):
                        chunks.append(json.loads(line[len(b"data: ") :]))
                yield piece
        finally:
            if chunks:
                self._record(chunks, sent)
            await reply.aclose()


@contextlib.contextmanager
def recording_proxy(engine: str, family: str = "vllm") -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(engine, family=family)
    with serve_app(proxy.app, ready_path=READY_PATH) as url:
        proxy.url = url
        yield proxy


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.real_engines.recording_proxy --engine URL --port P --out FILE
    [--family sglang]``:
    the proxy as a process (the Claude Code test runs it inside its network namespace),
    appending each sampled sequence to ``FILE`` as a JSON line as it completes."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", default="vllm", choices=["vllm", "sglang"])
    args = parser.parse_args(argv)
    proxy = RecordingProxy(args.engine, Path(args.out), family=args.family)
    uvicorn.run(proxy.app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
