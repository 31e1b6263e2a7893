"""The model-server front end (``tokcap serve``), and the names it offers other code.

``api``'s public names are the ones below, resolved lazily so that importing one does not
load the server: the real Qwen vocabularies (``api.prompts.vocab``) and the response class
that sends bytes already serialized as JSON. The development engine (``tokcap-devtools``)
uses only these; everything else under ``api`` is the front end's own.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "qwen3_tokenizer": "api.prompts.vocab",
    "file_tokenizer": "api.prompts.vocab",
    "VocabTokenizer": "api.prompts.vocab",
    "QWEN3": "api.prompts.vocab",
    "BYTE_TO_CHAR": "api.prompts.vocab",
    "CHAR_TO_BYTE": "api.prompts.vocab",
    "JSONBytesResponse": "api.jsonbytes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'api' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
