"""The ground-truth log: every sequence the engine sampled, exactly as it sampled it.

Tests and the demo compare what a capture recorded against this. Its log-probs are the ones
the engine returned (the sampled distribution's, or the raw model's with
``logprobs_mode="raw_logprobs"``), whichever wire returned them. Each record is appended,
as one JSON line, to a JSONL file if a path is given, and kept in memory (the latest
``keep`` records, as their JSON text: a 16,000-token prompt costs ~80 kB, not ~600 kB of
Python ints) for ``GET /tokcap/ground_truth``.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

DEFAULT_KEEP = 2000


class GroundTruthLog:
    def __init__(self, path: str | Path | None = None, keep: int = DEFAULT_KEEP) -> None:
        self.path = Path(path) if path else None
        self._lines: deque[str] = deque(maxlen=keep)
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        with self._lock:
            self._lines.append(line)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(line + "\n")

    def json_text(self) -> str:
        """The kept records as one JSON list, without re-serializing them."""
        with self._lock:
            return "[" + ",".join(self._lines) + "]"

    def records(self) -> list[dict]:
        return json.loads(self.json_text())

    def clear(self) -> None:
        """Forget the in-memory records (the JSONL file is left as it is)."""
        with self._lock:
            self._lines.clear()


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
