"""The README's snippets run as written, its metrics tables list every key emitted, and no
command line in it carries a secret.

Each Python block is executed up to its ``asyncio.run``; the in-process rebuild snippet then
runs against the test Redis on a captured rollout and closes its source.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from api.edge.metrics import FrontEndMetrics
from capture.summary import SUMMARY_KEYS
from tests.support.rebuild import finished_record, populate

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.DOTALL)


def _defined(block: str, environ: dict[str, str], monkeypatch) -> dict[str, Any]:
    """The names a block defines, run without its final ``asyncio.run`` line."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    runnable = "\n".join(line for line in block.splitlines() if not line.startswith("asyncio.run"))
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(runnable, str(README), "exec"), namespace)
    return namespace


def test_every_python_block_imports_and_defines_what_it_uses(monkeypatch) -> None:
    environ = {
        "TOKCAP_REDIS_URL": "redis://127.0.0.1:1/0",
        "TOKCAP_AUTH_SECRET": "s" * 32,
    }
    blocks = _blocks("python")
    assert len(blocks) >= 3
    for block in blocks:
        _defined(block, environ, monkeypatch)
        if "async def" in block or "await " in block:
            # Top-level await does not run as written: a block that awaits runs its loop.
            assert re.search(r"^(# [a-z]+ = )?asyncio\.run\(", block, re.MULTILINE), block


async def test_the_in_process_rebuild_snippet_runs_and_closes_its_source(
    redis_url: str, monkeypatch
) -> None:
    (block,) = [b for b in _blocks("python") if "RedisTokenSource" in b]
    await populate(redis_url, "tokcap", ["readme-snippet-1"], turns=2)
    namespace = _defined(block, {"TOKCAP_REDIS_URL": redis_url}, monkeypatch)
    closed = []
    source_type = namespace["RedisTokenSource"]

    class Watched(source_type):  # type: ignore[misc, valid-type]
        async def close(self) -> None:
            closed.append(True)
            await super().close()

    namespace["RedisTokenSource"] = Watched
    built = await namespace["rebuild"](finished_record("readme-snippet-1"))
    assert built.status == "ok" and closed == [True]


def test_the_metrics_tables_list_every_key() -> None:
    text = README.read_text()
    table = text[text.index("## Metrics reference") : text.index("## Commands")]
    for key in SUMMARY_KEYS:
        assert f"`{key}`" in table, f"{key} is emitted but not in the README's metrics table"
    exposition = FrontEndMetrics().exposition()[0].decode()
    families = set(re.findall(r"^# TYPE (\S+) (\S+)", exposition, re.MULTILINE))
    for name, kind in families:
        if name.endswith("_created"):  # the time a counter began, beside each counter
            continue
        shown = f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
        assert f"`{shown}`" in table, f"/metrics serves {shown}, the README does not list it"


@pytest.mark.parametrize("language", ["bash", "yaml"])
def test_no_secret_on_a_command_line(language: str) -> None:
    for block in _blocks(language):
        assert not re.search(r"--url\s+\"?\$", block), block
        assert "--requirepass" not in block, block  # a password in redis-server's cmdline
