"""The engine's output is checked before it is captured (issue 8, item 6).

Unit tests of ``read_generation`` for every rule (usage counts, both id sources, log-prob
values, empty generations, the vocabulary), the engine-era decision from ``GET /version``,
and the real servers: the tokcap engine behind a corrupting proxy, the front end in front,
the official Anthropic SDK as the harness. Whatever the corruption, the harness is answered
(or gets an error) and the rebuilt rollout is masked; an uncorrupted path stays unmasked.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI

from api import jsonbytes
from api.engine.client import UpstreamClient
from api.engine.vllm import LOGPROB_PLACEHOLDER
from api.engine.vllm import predates_token_ids as engine_predates_token_ids
from api.engine.vllm import read_chat as read_generation
from api.settings import ServerSettings
from capture.errors import ConfigError
from tests.support.corrupting_proxy import MODES, CorruptingProxy, corrupting_proxy
from tests.support.frontend import (
    BASH_TOOL,
    answer_output,
    assert_entries_equal_ground_truth,
    engine_server,
    file_store_settings,
    finalize,
    freeze,
    front_end,
)
from tests.support.servers import free_port, serve_app
from tokcap_devtools.engine.tokenizer import load_tokenizer

VOCAB = 100
HELLO = [{"role": "user", "content": "hello"}]


def reply(
    prompt: list[Any] | None = None,
    generated: list[int] | None = None,
    log_probs: list[Any] | None = None,
    *,
    content: str | None = "hi",
    usage: bool = True,
    **message: Any,
) -> dict[str, Any]:
    """A vLLM 0.10.2 chat reply (return_token_ids, token_id:N log-probs), consistent."""
    prompt = [1, 2, 3] if prompt is None else prompt
    generated = [7, 8, 2] if generated is None else generated
    log_probs = [-0.5] * len(generated) if log_probs is None else log_probs
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "tool_calls": [], **message},
        "logprobs": {
            "content": [
                {"token": f"token_id:{i}", "logprob": lp, "bytes": []}
                for i, lp in zip(generated, log_probs, strict=True)
            ]
        },
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": list(generated),
    }
    body: dict[str, Any] = {"choices": [choice], "prompt_token_ids": prompt}
    if usage:
        body["usage"] = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(generated),
            "total_tokens": len(prompt) + len(generated),
        }
    return body


def problem_of(response: dict[str, Any], **kwargs: Any) -> str | None:
    generation = read_generation(response, **kwargs)
    if generation.ids_problem is not None:
        # A problem voids all three arrays, so none of them can be captured half-trusted.
        assert generation.prompt_token_ids is None
        assert generation.generation_token_ids is None
        assert generation.generation_log_probs is None
    return generation.ids_problem


# -- the happy path ----------------------------------------------------------------------


def test_a_consistent_reply_is_read_whole() -> None:
    generation = read_generation(reply(log_probs=[-0.25, 0, -1]), vocab_size=VOCAB)
    assert generation.ids_problem is None
    assert generation.prompt_token_ids == [1, 2, 3]
    assert generation.generation_token_ids == [7, 8, 2]
    assert generation.generation_log_probs == [-0.25, 0.0, -1.0]
    assert all(type(value) is float for value in generation.generation_log_probs)


def test_the_last_vocabulary_id_and_a_reply_without_usage_are_accepted() -> None:
    assert problem_of(reply(prompt=[0, VOCAB - 1], generated=[VOCAB - 1]), vocab_size=VOCAB) is None
    assert problem_of(reply(usage=False)) is None


def test_an_empty_generation_that_served_nothing_is_not_a_problem() -> None:
    # Nothing was served, so nothing is missing; the builder sets such a call aside.
    assert problem_of(reply(generated=[], content="")) is None


# -- a. lengths against usage ------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt", [[2, 3], [1, 2], [9, 1, 2, 3]], ids=["shifted", "truncated", "padded"]
)
def test_prompt_ids_that_disagree_with_usage_prompt_tokens(prompt: list[int]) -> None:
    response = reply()
    response["prompt_token_ids"] = prompt
    problem = problem_of(response)
    assert problem is not None and "usage.prompt_tokens=3" in problem
    assert f"returned {len(prompt)} prompt ids" in problem


def test_the_last_id_dropped_with_its_log_prob_disagrees_with_completion_tokens() -> None:
    response = reply()
    choice = response["choices"][0]
    choice["token_ids"].pop()
    choice["logprobs"]["content"].pop()
    problem = problem_of(response)
    assert problem is not None and "usage.completion_tokens=3" in problem


def test_usage_counts_must_be_integers() -> None:
    response = reply()
    response["usage"]["prompt_tokens"] = "3"
    assert "usage.prompt_tokens is '3', not an integer" in problem_of(response)


# -- b. both id sources ------------------------------------------------------------------


def test_token_ids_missing_while_log_prob_ids_are_present() -> None:
    response = reply()
    del response["choices"][0]["token_ids"]
    assert "no token_ids" in problem_of(response)
    response["choices"][0]["token_ids"] = None  # what vLLM writes when it was not asked
    assert "no token_ids" in problem_of(response)


def test_prompt_token_ids_missing_from_a_modern_engine() -> None:
    response = reply()
    del response["prompt_token_ids"]
    problem = problem_of(response)
    assert problem is not None and "no prompt_token_ids" in problem and "/version" in problem


def test_a_legacy_engine_may_lack_both_fields_and_leaves_the_prompt_to_tokenize() -> None:
    response = reply()
    del response["choices"][0]["token_ids"]
    del response["prompt_token_ids"]
    generation = read_generation(response, legacy=True)
    assert generation.ids_problem is None
    assert generation.prompt_token_ids is None  # the client reads them from /tokenize
    assert generation.generation_token_ids == [7, 8, 2]


def test_a_legacy_engine_still_gets_its_fields_checked_when_it_sends_them() -> None:
    response = reply()
    response["choices"][0]["token_ids"] = [7, 8]
    assert "disagree" in problem_of(response, legacy=True)
    response = reply()
    response["prompt_token_ids"] = [1, 2]
    assert "usage.prompt_tokens" in problem_of(response, legacy=True)


def test_disagreeing_sources_and_prompt_shapes() -> None:
    response = reply()
    response["choices"][0]["token_ids"] = [7, 9, 2]
    assert "disagree" in problem_of(response)
    response = reply()
    response["prompt_token_ids"] = "1 2 3"
    assert "not a list" in problem_of(response)
    assert "empty" in problem_of(reply(prompt=[]))


# -- c. log-prob values ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (LOGPROB_PLACEHOLDER, "placeholder -9999.0"),
        (float("nan"), "not finite"),
        (float("inf"), "not finite"),
        (float("-inf"), "not finite"),
        ("-0.5", "not a JSON number"),
        (True, "not a JSON number"),
        (None, "not a JSON number"),
        (0.5, "at most 0"),
        (3, "at most 0"),
    ],
    ids=["placeholder", "nan", "inf", "-inf", "string", "bool", "null", "positive", "int"],
)
def test_a_log_prob_that_is_no_usable_value(value: Any, expected: str) -> None:
    problem = problem_of(reply(log_probs=[-0.5, value, -0.5]))
    assert problem is not None and "log-prob 1 (token_id:8)" in problem and expected in problem


def test_non_finite_literals_parsed_from_the_wire_are_refused() -> None:
    # The front end reads NaN/Infinity with the stdlib fallback; they must not pass as floats.
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        text = (
            jsonbytes.dumps(reply()).decode().replace('"logprob":-0.5', f'"logprob":{literal}', 1)
        )
        assert "not finite" in problem_of(jsonbytes.loads(text)), literal


def test_a_missing_log_prob_value_is_a_problem() -> None:
    response = reply()
    del response["choices"][0]["logprobs"]["content"][0]["logprob"]
    assert "is missing" in problem_of(response)


@pytest.mark.parametrize("token", ["token_id:+7", "token_id:-7", "token_id:\u0667", "7", None])
def test_a_log_prob_token_that_is_not_token_id_n(token: Any) -> None:
    response = reply()
    response["choices"][0]["logprobs"]["content"][0]["token"] = token
    assert "not 'token_id:N'" in problem_of(response)


def test_no_log_probs_at_all() -> None:
    response = reply()
    response["choices"][0]["logprobs"] = None
    assert "no log-probs" in problem_of(response)


# -- d. an empty generation that served something ----------------------------------------


@pytest.mark.parametrize(
    ("message", "served"),
    [
        ({"content": "the answer"}, "text"),
        ({"content": None, "reasoning_content": "thinking"}, "reasoning"),
        (
            {
                "content": None,
                "tool_calls": [{"id": "c", "function": {"name": "Bash", "arguments": "{}"}}],
            },
            "a tool call",
        ),
    ],
    ids=["text", "reasoning", "tool-call"],
)
def test_an_empty_generation_while_something_was_served(message: dict, served: str) -> None:
    response = reply(generated=[], usage=False)
    response["choices"][0]["message"].update(message)
    problem = problem_of(response)
    assert problem is not None and "no generated ids" in problem and served in problem
    # With usage reported it is still named as the empty generation, the clearer reason.
    response["usage"] = {"prompt_tokens": 3, "completion_tokens": 3}
    assert "no generated ids" in problem_of(response)


# -- e. ids are tokens -------------------------------------------------------------------


def test_a_generated_id_at_or_beyond_the_vocabulary() -> None:
    problem = problem_of(reply(generated=[7, VOCAB, 2]), vocab_size=VOCAB)
    assert problem is not None and f"generated id 1 is {VOCAB}" in problem
    assert "model_server.vocab_size" in problem
    assert problem_of(reply(generated=[7, VOCAB, 2])) is None, "no vocabulary, no bound"


@pytest.mark.parametrize(
    ("bad", "expected"),
    [(VOCAB, "not below the vocabulary size"), (-1, "not an integer >= 0"), (True, "True")]
    + [(2.0, "not an integer"), ("2", "not an integer")],
    ids=["beyond", "negative", "bool", "float", "string"],
)
def test_a_prompt_id_that_is_no_token(bad: Any, expected: str) -> None:
    problem = problem_of(reply(prompt=[1, bad, 3]), vocab_size=VOCAB)
    assert problem is not None and "prompt id 1" in problem and expected in problem


# -- the engine's era, from GET /version -------------------------------------------------


@pytest.mark.parametrize(
    ("version", "legacy"),
    [
        ("0.10.1", True),
        ("0.10.1.1", True),
        ("0.9.2", True),
        ("0.10.1.dev12+g1234abc", True),
        ("0.10.2", False),
        ("0.10.2rc1", False),
        ("0.10.2.dev3", False),
        ("0.11.0", False),
        ("1.0", False),
        ("main", False),
        ("", False),
        (None, False),
        (10, False),
    ],
)
def test_engine_predates_token_ids(version: Any, legacy: bool) -> None:
    assert engine_predates_token_ids(version) is legacy


def _version_app(status: int, body: Any) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/version")
    async def version() -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse(body, status_code=status)

    return app


async def _legacy_of(url: str) -> tuple[bool, bool | None]:
    client = UpstreamClient(url)
    try:
        await client.learn()
        legacy = getattr(client.adapter, "legacy", None)
        return bool(legacy), legacy
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("status", "body", "legacy"),
    [
        (200, {"version": "0.10.1"}, True),
        (200, {"version": "0.10.2"}, False),
        (200, {"version": "not-a-version"}, False),
        (200, ["0.10.1"], False),
        (404, {"detail": "Not Found"}, False),
        (500, {"version": "0.10.1"}, False),
    ],
    ids=["old", "modern", "unparseable", "not-an-object", "absent", "error"],
)
def test_the_era_comes_from_one_version_answer(status: int, body: Any, legacy: bool) -> None:
    with serve_app(_version_app(status, body)) as url:
        assert asyncio.run(_legacy_of(url)) == (legacy, legacy)


def test_an_unreachable_engine_is_modern_until_it_answers() -> None:
    assert asyncio.run(_legacy_of(f"http://127.0.0.1:{free_port()}")) == (False, None)


def test_the_tokcap_engine_reports_an_old_vllm_when_it_emulates_one() -> None:
    with engine_server(token_id_fields=False) as old, engine_server() as modern:
        assert httpx.get(old + "/version").json() == {"version": "0.10.1"}
        assert httpx.get(modern + "/version").json() == {"version": "0.12.0"}
        assert asyncio.run(_legacy_of(old))[0] is True
        assert asyncio.run(_legacy_of(modern))[0] is False


def test_vocab_size_setting() -> None:
    document = {"model_server": {"vocab_size": 4100}}
    assert ServerSettings.from_document(document, environ={}).vocab_size == 4100
    assert ServerSettings.from_document({}, environ={}).vocab_size is None
    with pytest.raises(ConfigError, match="vocab_size"):
        ServerSettings.from_document({"model_server": {"vocab_size": 0}}, environ={})
    with pytest.raises(ValueError, match="vocab_size"):
        UpstreamClient("http://127.0.0.1:1", vocab_size=0)


# -- real servers: engine -> corrupting proxy -> front end -> Anthropic SDK --------------

# What the front end's log names for each corruption (the rollout itself says "incomplete").
REASONS = {
    "prompt_shift": "usage.prompt_tokens",
    "prompt_truncate": "usage.prompt_tokens",
    "no_prompt_ids": "no prompt_token_ids",
    "drop_last_id": "usage.completion_tokens",
    "nan_logprob": "not finite",
    "inf_logprob": "not finite",
    "string_logprob": "not a JSON number",
    "positive_logprob": "at most 0",
    "placeholder_logprob": "placeholder -9999.0",
    "no_token_ids": "no token_ids",
    "no_logprobs": "no log-probs",
    "empty_generation": "no generated ids",
    "id_beyond_vocab": "vocabulary size",
}


class Chain:
    """Engine, proxy and front end of this module, and the store they write."""

    def __init__(self, engine: str, proxy: CorruptingProxy, front: str, store_dir: Path):
        self.engine, self.proxy, self.front, self.store_dir = engine, proxy, front, store_dir

    def client(self, rollout_id: str) -> anthropic.Anthropic:
        base = f"{self.front}/ng-rollout/{rollout_id}/training-token-capture"
        return anthropic.Anthropic(base_url=base, api_key="dummy", max_retries=0)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    store_dir = tmp_path_factory.mktemp("corrupted")
    vocab_size = load_tokenizer().vocab_size
    with engine_server() as engine, corrupting_proxy(engine) as proxy:
        settings = file_store_settings(proxy.url, store_dir, vocab_size=vocab_size)
        with front_end(settings) as front:
            yield Chain(engine, proxy, front, store_dir)


def _call(client: anthropic.Anthropic, streamed: bool) -> str | None:
    """One harness call; the text it was answered with, or None for an error reply."""
    kwargs: dict[str, Any] = {
        "model": "m",
        "max_tokens": 200,
        "system": "Be brief.",
        "messages": HELLO,
        "tools": [BASH_TOOL],
    }
    try:
        if streamed:
            with client.messages.stream(**kwargs) as stream:
                message = stream.get_final_message()
        else:
            message = client.messages.create(**kwargs)
    except anthropic.APIStatusError:
        return None
    return "".join(block.text for block in message.content if block.type == "text")


def test_the_corruption_modes_are_all_tested() -> None:
    assert set(REASONS) == set(MODES)


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_corrupted_reply_is_never_an_unmasked_rollout(
    chain: Chain, mode: str, streamed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    rollout_id = f"corrupt-{mode}-{'stream' if streamed else 'create'}"
    chain.proxy.mode = mode
    before = chain.proxy.corrupted
    try:
        with caplog.at_level(logging.WARNING):
            text = _call(chain.client(rollout_id), streamed)
    finally:
        chain.proxy.mode = None
    assert chain.proxy.corrupted == before + 1, "the proxy corrupted the call"
    snapshot = freeze(chain.store_dir, rollout_id)
    # Nothing of the corrupted call was stored: no NaN, no shifted prompt, no stranger id.
    assert snapshot.entries == ()
    _, build = finalize(chain.store_dir, rollout_id, answer_output(text or ""))
    assert build.masked, build.metrics
    if text is not None:  # served: the loss was recorded, and the log says which check
        assert snapshot.incomplete
        assert any("incomplete capture" in r for r in build.metrics["mask_reasons"])
        logged = [r.getMessage() for r in caplog.records if rollout_id in r.getMessage()]
        assert any(REASONS[mode] in line for line in logged), logged


def test_the_uncorrupted_path_delivers_an_unmasked_rollout(chain: Chain) -> None:
    httpx.delete(chain.engine + "/tokcap/ground_truth").raise_for_status()
    rollout_id = "corrupt-none"
    for streamed in (False, True):
        text = _call(chain.client(f"{rollout_id}-{int(streamed)}"), streamed)
        assert text is not None
    truth = httpx.get(chain.engine + "/tokcap/ground_truth").json()
    for index, streamed in enumerate((False, True)):
        rollout = f"{rollout_id}-{int(streamed)}"
        snapshot = freeze(chain.store_dir, rollout)
        assert not snapshot.incomplete
        assert_entries_equal_ground_truth(snapshot, truth[index : index + 1])
        (entry,) = snapshot.entries
        # The harness finally returned what this call served (a text or a tool call).
        _, build = finalize(chain.store_dir, rollout, [dict(item) for item in entry.output_items])
        assert build.ok and not build.masked, build.metrics
    # The engine's era was asked once for all the calls this front end made.
    assert chain.proxy.requests["/version"] == 1


# -- a pooled connection the engine closes as a request goes out ---------------------------


async def test_a_request_the_engine_dropped_unanswered_is_sent_once_more() -> None:
    """A real socket server that reads the first request and hangs up without a reply."""
    body = json.dumps(reply()).encode()
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        seen.append(await reader.readexactly(length))
        if len(seen) > 1:
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = UpstreamClient(f"http://127.0.0.1:{port}", model="m")
    try:
        data = await client.post("/v1/chat/completions", {"model": "m", "messages": []})
    finally:
        await client.close()
        server.close()
    assert data["prompt_token_ids"] == [1, 2, 3]
    assert len(seen) == 2 and seen[0] == seen[1]
