"""Runs one Claude Code rollout inside a loopback-only network namespace.

Loopback in a new namespace is not the host's, so the engine and the front end are started
here, inside it, next to the CLI (the engine: the tokcap engine, or a real vLLM or SGLang
behind a recording proxy); Redis is reached over its unix socket, which the
filesystem shares across namespaces. The test starts this module with
``unshare -n`` (see ``claude_code.netns_command``) and reads back one JSON summary:
the CLI's stream-json events, the engine's ground truth and the servers' log tails.

    python -m tests.support.claude_code_driver SPEC.json  ->  writes spec["summary"]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.real_engines.recording_proxy import READY_PATH
from tests.support.claude_code import run_claude
from tokcap_devtools.processes import Service, free_port, wait_http

SERVER_START_TIMEOUT_S = 90.0
REAL_ENGINE_START_TIMEOUT_S = 300.0
SAMPLED = "engine_sampled.jsonl"  # what the real engine sampled, as the recording proxy logs it


def _ground_truth(engine_url: str) -> Any:
    try:
        response = httpx.get(engine_url + "/tokcap/ground_truth", timeout=30)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"GET /tokcap/ground_truth failed: {exc}"}


def _start_engine(spec: dict[str, Any], workdir: Path, port: int, servers: list[Service]) -> str:
    """The engine the front end calls: the tokcap engine, or (``spec["real_engine"]``: its
    family, interpreter, module, flags and environment) vLLM or SGLang itself behind a
    recording proxy that logs what it sampled. Returns the front end's upstream."""
    engine_url = f"http://127.0.0.1:{port}"
    real = spec.get("real_engine")
    if real is None:
        args = ["--host", "127.0.0.1", "--port", str(port), *spec["engine_args"]]
        engine = Service(
            "engine", "tokcap_devtools.engine.cli", args, workdir, spec.get("engine_env", {})
        )
        servers.append(engine)
        wait_http(engine_url + "/health", timeout=SERVER_START_TIMEOUT_S, proc=engine.proc)
        return engine_url
    args = ["--host", "127.0.0.1", "--port", str(port), *real["args"]]
    engine = Service("engine", real["module"], args, workdir, real["env"], python=real["python"])
    servers.append(engine)
    wait_http(engine_url + "/health", timeout=REAL_ENGINE_START_TIMEOUT_S, proc=engine.proc)
    recorder_port = free_port()
    recorder_args = ["--engine", engine_url, "--port", str(recorder_port)]
    recorder_args += ["--family", real["family"]]
    recorder_args += ["--out", str(workdir / SAMPLED)]
    recorder = Service("recorder", "tests.real_engines.recording_proxy", recorder_args, workdir)
    servers.append(recorder)
    recorder_url = f"http://127.0.0.1:{recorder_port}"
    wait_http(recorder_url + READY_PATH, timeout=SERVER_START_TIMEOUT_S, proc=recorder.proc)
    return recorder_url


def _clear_ground_truth(spec: dict[str, Any], workdir: Path, engine_url: str) -> None:
    if spec.get("real_engine") is not None:
        (workdir / SAMPLED).unlink(missing_ok=True)
    else:
        httpx.delete(engine_url + "/tokcap/ground_truth", timeout=30).raise_for_status()


def _read_ground_truth(spec: dict[str, Any], workdir: Path, engine_url: str) -> Any:
    if spec.get("real_engine") is None:
        return _ground_truth(engine_url)
    path = workdir / SAMPLED
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    workdir = Path(spec["workdir"])
    home, cwd = workdir / "home", workdir / "cwd"
    home.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"servers": {}}
    servers: list[Service] = []
    started = time.monotonic()
    try:
        engine_port, frontend_port = free_port(), free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        frontend_url = f"http://127.0.0.1:{frontend_port}"
        upstream = _start_engine(spec, workdir, engine_port, servers)
        frontend = Service(
            "frontend",
            "tokcap.commands.serve",
            [
                "--config",
                spec["frontend_config"],
                "--host",
                "127.0.0.1",
                "--port",
                str(frontend_port),
            ],
            workdir,
            {"TOKCAP_UPSTREAM": upstream, **spec.get("frontend_env", {})},
        )
        servers.append(frontend)
        wait_http(frontend_url + "/health", timeout=SERVER_START_TIMEOUT_S, proc=frontend.proc)
        summary["servers_ready_s"] = round(time.monotonic() - started, 2)
        # The front end's start-up probe sampled too; the ground truth is the CLI's calls.
        _clear_ground_truth(spec, workdir, engine_url)

        base_url = f"{frontend_url}/ng-rollout/{spec['rollout_id']}/training-token-capture"
        claude_started = time.monotonic()
        claude = run_claude(
            Path(spec["cli"]),
            spec["prompt"],
            base_url,
            home=home,
            cwd=cwd,
            env_extra=spec.get("env_extra"),
            nonessential_traffic=spec.get("nonessential_traffic", False),
            model=spec["model"],
            timeout=spec.get("claude_timeout", 120.0),
        )
        summary["claude_s"] = round(time.monotonic() - claude_started, 2)
        summary["claude"] = {
            "returncode": claude.returncode,
            "timed_out": claude.timed_out,
            "events": claude.events,
            "stderr": claude.stderr,
        }
        summary["ground_truth"] = _read_ground_truth(spec, workdir, engine_url)
    except Exception as exc:  # reported to the test, which fails with the logs attached
        summary["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for server in reversed(servers):
            server.stop()
            summary["servers"][server.name] = {
                "returncode": server.proc.returncode,
                "log_tail": server.log_tail(),
            }
    summary["total_s"] = round(time.monotonic() - started, 2)
    return summary


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    summary = run(spec)
    Path(spec["summary"]).write_text(json.dumps(summary, indent=1))
    return 0 if "error" not in summary else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
