"""Closed by default (issue 14): what a stranger who reaches a port can read.

The front end's OpenAPI pages (``/docs``, ``/redoc``, ``/openapi.json``) only with
``model_server.docs`` (``TOKCAP_DOCS=1``); the engine's every-sampled-id route
``/tokcap/ground_truth`` only with ``--ground-truth``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.settings import ServerSettings
from capture.errors import ConfigError
from tests.support.servers import serve_app
from tokcap_devtools.engine.cli import add_arguments, settings_from_args
from tokcap_devtools.engine.server import create_app as create_engine_app
from tokcap_devtools.engine.settings import EngineSettings

PAGES = ("/docs", "/redoc", "/openapi.json")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_openapi_pages_are_closed_by_default_and_open_with_docs() -> None:
    with serve_app(create_app(ServerSettings(upstream="http://127.0.0.1:1"))) as front:
        assert [httpx.get(front + page).status_code for page in PAGES] == [404, 404, 404]
    with serve_app(create_app(ServerSettings(upstream="http://127.0.0.1:1", docs=True))) as front:
        assert [httpx.get(front + page).status_code for page in PAGES] == [200, 200, 200]
        assert "/v1/messages" in httpx.get(front + "/openapi.json").json()["paths"]


def test_docs_setting_from_yaml_and_environment() -> None:
    assert ServerSettings.from_document({}, environ={}).docs is False
    assert ServerSettings.from_document({"model_server": {"docs": True}}, environ={}).docs
    assert ServerSettings.from_document({}, environ={"TOKCAP_DOCS": "1"}).docs
    assert not ServerSettings.from_document(
        {"model_server": {"docs": True}}, environ={"TOKCAP_DOCS": "0"}
    ).docs
    with pytest.raises(ConfigError, match="TOKCAP_DOCS"):
        ServerSettings.from_document({}, environ={"TOKCAP_DOCS": "maybe"})


def test_engine_ground_truth_route_only_with_the_flag() -> None:
    with serve_app(create_engine_app(EngineSettings())) as engine:
        assert httpx.post(engine + "/v1/chat/completions", json=CHAT).status_code == 200
        assert httpx.get(engine + "/tokcap/ground_truth").status_code == 404
        assert httpx.delete(engine + "/tokcap/ground_truth").status_code in (404, 405)
    with serve_app(create_engine_app(EngineSettings(ground_truth=True))) as engine:
        httpx.post(engine + "/v1/chat/completions", json=CHAT).raise_for_status()
        assert len(httpx.get(engine + "/tokcap/ground_truth").json()) == 1
        assert httpx.delete(engine + "/tokcap/ground_truth").status_code == 204


def test_engine_ground_truth_flag_takes_an_optional_path(tmp_path: Path) -> None:
    def parsed(*argv: str) -> EngineSettings:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return settings_from_args(parser.parse_args(list(argv)))

    off = parsed()
    assert not off.ground_truth and off.ground_truth_path is None
    served = parsed("--ground-truth", "--seed", "3")
    assert served.ground_truth and served.ground_truth_path is None and served.seed == 3
    logged = parsed("--ground-truth", str(tmp_path / "truth.jsonl"))
    assert logged.ground_truth and logged.ground_truth_path == str(tmp_path / "truth.jsonl")


def test_tokcap_serve_docs_flag_turns_the_pages_on_for_its_workers() -> None:
    import argparse

    from api.settings import settings_from_environment
    from tokcap.commands.serve import add_arguments, worker_environment

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "TOKCAP_DOCS" not in worker_environment(parser.parse_args([]))
    variables = worker_environment(parser.parse_args(["--docs"]))
    assert variables["TOKCAP_DOCS"] == "1"
    assert settings_from_environment(variables).docs is True
    assert settings_from_environment({}).docs is False
