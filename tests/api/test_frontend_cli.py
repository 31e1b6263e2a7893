"""``tokcap serve`` and its settings: a Gym-style YAML, environment overrides, real workers.

The command runs as a child process with two uvicorn workers; each builds its own file-store
sink from the same config, and every call any worker serves is captured.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from api.settings import ServerSettings
from capture.config import TokenIdCaptureConfig
from capture.errors import ConfigError
from capture.filestore.store import FileTokenStore
from capture.registry import install_token_sink
from tests.support.frontend import (
    assert_entries_equal_ground_truth,
    engine_server,
    freeze,
    front_end,
    inspect,
)
from tests.support.servers import free_port, run_process

CONFIG = """
model_server:
  upstream: http://127.0.0.1:1
  model: tokcap-engine
  sampling_overrides: {{temperature: 0.5, seed: 11}}
  max_body_bytes: 100000
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      dir: {dir}
"""


def test_settings_from_yaml_with_environment_overrides(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG.format(dir=tmp_path / "captures"))
    settings = ServerSettings.from_document(
        str(path), environ={"TOKCAP_UPSTREAM": "http://127.0.0.1:9"}
    )
    assert settings.upstream == "http://127.0.0.1:9"
    assert settings.model == "tokcap-engine"
    assert settings.sampling_overrides == {"temperature": 0.5, "seed": 11}
    assert settings.max_body_bytes == 100000
    assert settings.capture.enabled and settings.capture.dir == str(tmp_path / "captures")
    env = ServerSettings.from_document(str(path), environ={"TOKCAP_MAX_BODY_BYTES": "512"})
    assert env.max_body_bytes == 512 and env.upstream == "http://127.0.0.1:1"


def test_a_typo_in_the_model_server_block_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sampling_override"):
        ServerSettings.from_document(
            {"model_server": {"sampling_override": {"top_p": 1}}}, environ={}
        )
    with pytest.raises(ConfigError, match="TOKCAP_MAX_BODY_BYTES"):
        ServerSettings.from_document({}, environ={"TOKCAP_MAX_BODY_BYTES": "lots"})


def test_tokcap_serve_with_two_workers_captures_every_call(tmp_path: Path) -> None:
    store_dir = tmp_path / "captures"
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG.format(dir=store_dir))
    port = free_port()
    rollout_id = "cli-workers"
    with engine_server() as engine:
        args = [
            sys.executable,
            "-m",
            "tokcap.cli",
            "serve",
            "--config",
            str(config),
            "--upstream",
            engine,
            "--port",
            str(port),
            "--workers",
            "2",
            "--log-level",
            "warning",
        ]
        with run_process(args, ready_url=f"http://127.0.0.1:{port}/health"):
            # The start-up probe sampled too; the ground truth is the harness's calls.
            httpx.delete(engine + "/tokcap/ground_truth").raise_for_status()
            base = f"http://127.0.0.1:{port}/ng-rollout/{rollout_id}/training-token-capture"
            for number in range(6):
                # A new client per call: new connections, spread over both workers.
                sdk = anthropic.Anthropic(base_url=base, api_key="dummy", max_retries=0)
                reply = sdk.messages.create(
                    model="m",
                    max_tokens=100,
                    messages=[{"role": "user", "content": f"call {number}"}],
                )
                assert reply.content
                sdk.close()
        truth = httpx.get(engine + "/tokcap/ground_truth").json()
    snapshot = freeze(store_dir, rollout_id)
    assert not snapshot.incomplete
    assert_entries_equal_ground_truth(snapshot, truth)
    assert all(
        entry.overridden_sampling_keys == ["seed", "temperature"] for entry in snapshot.entries
    )


def test_tokcap_serve_refuses_a_bad_config_before_starting(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("token_id_capture:\n  enabled: true\n  sink: 'nosuchmodule.x:Sink'\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokcap.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "nosuchmodule" in proc.stderr


def test_tokcap_serve_refuses_sink_kwargs_the_sink_rejects(tmp_path: Path) -> None:
    config = tmp_path / "bad-kwargs.yaml"
    config.write_text(
        "token_id_capture:\n  enabled: true\n  sink: transports.redis:RedisTokenSink\n"
        "  sink_kwargs: {url: 'redis://127.0.0.1:1/0', bogus_option: 1}\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokcap.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bogus_option" in proc.stderr and "Traceback" not in proc.stderr


def test_an_embedding_process_can_install_the_sink(tmp_path: Path) -> None:
    """No store in the config: the front end captures into the process's installed sink."""
    sink = FileTokenStore(tmp_path / "installed")
    previous = install_token_sink(sink)
    try:
        with engine_server() as engine_url:
            settings = ServerSettings(
                upstream=engine_url,
                capture=TokenIdCaptureConfig(enabled=True, rebuild_response=False),
            )
            with front_end(settings) as front_url:
                client = openai.OpenAI(
                    base_url=f"{front_url}/ng-rollout/installed-1/training-token-capture/v1",
                    api_key="dummy",
                    max_retries=0,
                )
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
    finally:
        install_token_sink(previous)
    assert inspect(tmp_path / "installed", "installed-1")["calls"] == 1


def test_serve_raises_the_open_file_limit_and_says_what_it_allows() -> None:
    import resource

    from tokcap.commands.serve import SOCKETS_PER_CALL, SPARE_FILES, open_file_room

    said = open_file_room()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard == resource.RLIM_INFINITY or soft == hard
    assert said.startswith(f"open files: {soft} per worker, ")
    assert f"about {(soft - SPARE_FILES) // SOCKETS_PER_CALL} calls in flight" in said
