"""The engine as an MoE honours vLLM 0.32's ``routed_experts_prompt_start``.

vLLM 0.32 refuses a start outside 0 to the prompt's length (``v1/engine/input_processor.py``,
a 400) and returns the routes of positions ``[start, tokens - 1)``
(``distributed/aux_output_connector``); the engine does the same, on completions and chat,
and logs the start with the ground truth.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy
import pytest

from tests.support.frontend import engine_server
from tokcap_devtools.engine.routing import MoeShape, routes_of

MOE = MoeShape(layers=3, top_k=2, experts=16)
PROMPT = list(range(300, 340))


def routes(choice: dict) -> numpy.ndarray:
    return numpy.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))


@pytest.fixture(scope="module")
def engine() -> str:
    with engine_server(moe=MOE) as url:
        yield url


def complete(engine: str, **fields: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True, **fields}
    return httpx.post(engine + "/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize("start", [0, 16, len(PROMPT)])
def test_the_routes_start_where_asked(engine: str, start: int) -> None:
    reply = complete(engine, routed_experts_prompt_start=start)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    whole = routes_of([*PROMPT, *choice["token_ids"]], MOE)
    assert numpy.array_equal(routes(choice), whole[start:])
    record = httpx.get(engine + "/tokcap/ground_truth").json()[-1]
    assert record["routes_start"] == start


def test_a_start_beyond_the_prompt_is_refused_as_vllm_refuses_it(engine: str) -> None:
    reply = complete(engine, routed_experts_prompt_start=len(PROMPT) + 1)
    assert reply.status_code == 400
    assert "between 0 and the prompt length (40), inclusive" in reply.json()["error"]["message"]
    assert complete(engine, routed_experts_prompt_start=-1).status_code == 400


def test_chat_takes_the_start_too(engine: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "return_token_ids": True,
        "routed_experts_prompt_start": 3,
    }
    reply = httpx.post(engine + "/v1/chat/completions", json=body, timeout=30).json()
    choice = reply["choices"][0]
    whole = routes_of([*reply["prompt_token_ids"], *choice["token_ids"]], MOE)
    assert numpy.array_equal(routes(choice), whole[3:])
