"""The tokcap engine: a small vLLM- or SGLang-compatible model server for tests and demos.

It answers like vLLM's OpenAI-compatible server or like SGLang (token ids, log-probs, SSE
chunks, each in its engine's fields), with a real byte-level BPE tokenizer and a ChatML
template with Hermes tool calls, or Qwen3's vocabulary and chat template, and scripted or
seeded-random policies; knobs reproduce the ways real serving breaks token prefixes.
"""

from __future__ import annotations

from .settings import EngineSettings


def create_app(settings: EngineSettings | None = None):
    """The FastAPI app (imported lazily so tools can load settings without FastAPI)."""
    from .server import create_app as _create_app

    return _create_app(settings)


__all__ = ["EngineSettings", "create_app"]
