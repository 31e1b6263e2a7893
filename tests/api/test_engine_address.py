"""``tokcap engine`` says where it listens: one line on stderr at start, so a user knows what
to give ``tokcap serve --upstream`` although the engine logs only warnings by default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokcap_devtools.processes import free_port, stop_process, wait_http


def test_the_engine_prints_its_address(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "engine.log"
    with open(log, "wb") as output:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokcap.cli", "engine", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=output,
            start_new_session=True,
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=60, proc=proc)
        finally:
            stop_process(proc)
    first = log.read_text().splitlines()[0]
    assert first.startswith(f"tokcap engine: http://127.0.0.1:{port} (vllm wire"), first
