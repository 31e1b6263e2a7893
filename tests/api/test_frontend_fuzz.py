"""Schema fuzzing of the front end: schemathesis against its own OpenAPI finds no 5xx.

Bodies are generated from the request schemas the dialect endpoints publish (and, in the
negative mode, bodies that break them), sent to the real front end (capture path, real engine behind it). Any request the front end cannot
translate must come back as a 4xx in the dialect's format, never a server error.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.support.frontend import both_servers

OPERATIONS = ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/responses"]
MAX_EXAMPLES = 25


# Prompt modes: the engine renders (text), or the front end does with a renderer (faithful).
PROMPT_MODES = {
    "text": ({}, {}),
    "faithful": (
        {"tokenizer_path": "qwen3"},
        {"prompts": "faithful", "renderer": {"tokenizer": "qwen3"}},
    ),
}


@pytest.fixture(scope="module", params=sorted(PROMPT_MODES))
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    engine, front = PROMPT_MODES[request.param]
    # The schema is read from /openapi.json, served only with docs on.
    with both_servers(
        tmp_path_factory.mktemp("captures"), engine=engine, docs=True, **front
    ) as running:
        yield running


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("path", OPERATIONS)
def test_generated_requests_never_get_a_server_error(
    servers, path: str, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(servers.front + "/openapi.json")
    operation = schema[path]["POST"]
    base = servers.base("fuzz-1")
    seen: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        response = case.call(base_url=base, timeout=30)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
        error = response.json().get("error") if response.status_code >= 400 else None
        if error is not None:
            assert error.get("message"), response.text

    check()
    if mode is GenerationMode.POSITIVE:
        # Valid requests were among them: the fuzzing reached the upstream and the capture.
        assert 200 in seen, sorted(seen)
