"""The real Claude Code CLI as a test client: install, environment, run, transcript.

The CLI is a ~245 MB native binary shipped inside an npm package, so it is installed once
per machine into a cache directory outside the repo (``TOKCAP_CLAUDE_CACHE``, default
``~/.cache/tokcap/claude-code``) and pinned to the version the fixtures were recorded
with (``TOKCAP_CLAUDE_CODE_VERSION`` overrides it). It runs inside a network namespace
with only loopback, so nothing can leave the machine whatever the CLI tries; the servers
it talks to must therefore run inside the same namespace (see ``claude_code_driver``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = os.environ.get("TOKCAP_CLAUDE_CODE_VERSION", "2.1.197")
NPM_INSTALL_TIMEOUT_S = 900.0

# Without a known model name the CLI inserts mid-conversation ``role: system`` messages.
DEFAULT_MODEL = "claude-sonnet-4-5"


class ClaudeCliUnavailable(RuntimeError):
    """npm could not install the CLI; the message is the reason a test may skip with."""


def cache_dir() -> Path:
    configured = os.environ.get("TOKCAP_CLAUDE_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "tokcap" / "claude-code"


def _cli_version(path: Path) -> str | None:
    """The version the binary prints, or None if it does not run."""
    try:
        proc = subprocess.run(
            [str(path), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env=_base_env(Path("/tmp")),
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip().split(" ", 1)[0] or None


def _candidates(prefix: Path) -> list[Path]:
    """The npm bin link first; then the platform packages' binaries directly.

    The wrapper's postinstall copies the native binary over a placeholder; where npm does
    not run install scripts the placeholder stays, but the platform binary still works.
    """
    modules = prefix / "node_modules" / "@anthropic-ai"
    found = [prefix / "node_modules" / ".bin" / "claude"]
    found += sorted(modules.glob("claude-code-linux-*/claude"))
    return [path for path in found if path.exists()]


def _find_cli(prefix: Path, version: str) -> Path | None:
    for path in _candidates(prefix):
        if _cli_version(path) == version:
            return path
    return None


@contextlib.contextmanager
def _install_lock(prefix: Path) -> Iterator[None]:
    """Serializes installs from concurrent test runs on one machine."""
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_claude_cli(version: str = CLAUDE_CODE_VERSION) -> Path:
    """Path of a working ``claude`` binary, installing it with npm on first use.

    Raises ClaudeCliUnavailable only when npm is missing or cannot install the package.
    """
    prefix = cache_dir()
    found = _find_cli(prefix, version)
    if found:
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise ClaudeCliUnavailable("npm is not installed, so the Claude Code CLI cannot be")
    spec = f"{CLAUDE_CODE_PACKAGE}@{version}"
    with _install_lock(prefix):
        found = _find_cli(prefix, version)
        if found:
            return found
        try:
            proc = subprocess.run(
                [npm, "install", "--prefix", str(prefix), spec, "--no-audit", "--no-fund"],
                capture_output=True,
                text=True,
                timeout=NPM_INSTALL_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise ClaudeCliUnavailable(
                f"npm install {spec} did not finish within {NPM_INSTALL_TIMEOUT_S:.0f}s"
            ) from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ClaudeCliUnavailable(f"npm install {spec} failed: {' | '.join(tail)}")
        found = _find_cli(prefix, version)
    if found is None:
        # npm installed it but no binary runs: that is a real failure, not a skip.
        raise RuntimeError(f"npm installed {spec} into {prefix} but no claude binary runs")
    return found


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: nothing of the caller's (API keys, CLAUDE_* settings) leaks in."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }


def claude_env(
    base_url: str,
    home: Path,
    *,
    nonessential_traffic: bool = False,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of the fixture README; ``nonessential_traffic`` lets the title call in."""
    env = _base_env(home)
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="dummy",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        IS_SANDBOX="1",  # as root, --dangerously-skip-permissions needs it
        CLAUDE_CODE_MAX_RETRIES="1",
    )
    if not nonessential_traffic:
        env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    env.update(extra or {})
    return env


def claude_command(cli: Path, prompt: str, model: str = DEFAULT_MODEL) -> list[str]:
    return [
        str(cli),
        "-p",
        prompt,
        "--output-format",
        "stream-json",
        "--verbose",
        "--dangerously-skip-permissions",
        "--model",
        model,
    ]


@dataclass
class ClaudeRun:
    """One finished CLI run: its exit code, the stream-json events, and stderr."""

    returncode: int
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""
    timed_out: bool = False

    @property
    def result(self) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e.get("type") == "result"), None)


def parse_stream_json(text: str) -> list[dict[str, Any]]:
    """One JSON object per line; anything else the CLI prints is ignored."""
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return events


def run_claude(
    cli: Path,
    prompt: str,
    base_url: str,
    *,
    home: Path,
    cwd: Path,
    env_extra: dict[str, str] | None = None,
    nonessential_traffic: bool = False,
    model: str = DEFAULT_MODEL,
    timeout: float = 120.0,
) -> ClaudeRun:
    """Run the CLI once, here; the caller is already inside the network namespace."""
    env = claude_env(base_url, home, nonessential_traffic=nonessential_traffic, extra=env_extra)
    proc = subprocess.Popen(
        claude_command(cli, prompt, model),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the CLI's own group: its Bash tool children go too
        out, err = proc.communicate()
        timed_out = True
    return ClaudeRun(proc.returncode, parse_stream_json(out), err[-4000:], timed_out)


def netns_command(args: list[str]) -> list[str]:
    """``args`` run in a new network namespace that has only loopback, brought up."""
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "netns", *args]


def netns_problem() -> str | None:
    """Why a loopback-only namespace cannot be made here, or None if it can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare (util-linux) and ip (iproute2) are needed for the network namespace"
    try:
        proc = subprocess.run(
            netns_command(["ip", "-o", "link", "show", "up"]),
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        return "unshare -n did not finish within 30s"
    if proc.returncode != 0:
        return f"unshare -n failed: {proc.stderr.strip()}"
    links = [line.split(":")[1].strip() for line in proc.stdout.splitlines() if ":" in line]
    if links != ["lo"]:
        return f"the new network namespace has more than loopback: {links}"
    return None


# -- transcript -> finished rollout record ---------------------------------------------------


def _assistant_messages(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The main loop's assistant messages (sub-agent messages carry a parent tool id)."""
    return [
        e["message"]
        for e in events
        if e.get("type") == "assistant" and not e.get("parent_tool_use_id")
    ]


def final_answer(events: list[dict[str, Any]]) -> str:
    """The final answer text: the result event's, else the last assistant text."""
    for event in reversed(events):
        if event.get("type") == "result" and isinstance(event.get("result"), str):
            return event["result"]
    for message in reversed(_assistant_messages(events)):
        texts = [b["text"] for b in message.get("content", []) if b.get("type") == "text"]
        if texts:
            return "".join(texts)
    return ""


def transcript_to_record(
    events: list[dict[str, Any]], rollout_id: str, **fields: Any
) -> dict[str, Any]:
    """A finished rollout record as a collector keeps it, from the CLI's stream-json lines.

    ``response.output`` holds the final answer as one Responses message item: that is all
    the harness hands back; the rebuild replaces it with the captured token-bearing items.
    The raw transcript is kept beside it for evidence.
    """
    result = next((e for e in reversed(events) if e.get("type") == "result"), {})
    message = {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": final_answer(events), "annotations": []}],
    }
    record: dict[str, Any] = {
        "_ng_rollout_id": rollout_id,
        "response": {"output": [message]},
        "harness": {
            "name": "claude-code",
            "session_id": result.get("session_id"),
            "num_turns": result.get("num_turns"),
            "is_error": result.get("is_error"),
            "transcript": events,
        },
    }
    record.update(fields)
    return record
