"""The ground-truth log: every sequence the engine sampled, exactly as it sampled it.

Tests and the demo compare what a capture recorded against this. Records are kept in
memory (served at ``GET /tokcap/ground_truth``) and, if a path is given, appended to a
JSONL file as they are made, one line per generated sequence.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path


class GroundTruthLog:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self._records: list[dict] = []
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            self._records.append(record)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(line + "\n")

    def records(self) -> list[dict]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
