"""The wire dialects harnesses speak: Anthropic Messages, OpenAI Chat, OpenAI Responses.

Each dialect module implements ``api.dialects.dialect.Dialect``; ``common`` holds what they
share, ``sse`` their event framing. ``DIALECTS`` is the one map of route path to dialect:
the model routes are made from it, and an error the edge answers before any route (a
refused key, a body too large) takes the shape of the dialect its path names.
"""

from __future__ import annotations

from collections.abc import Mapping

from api.dialects import anthropic, chat, responses
from api.dialects.dialect import Dialect

DIALECTS: dict[str, Dialect] = {module.NAME: module for module in (anthropic, chat, responses)}
BY_PATH: dict[str, Dialect] = {dialect.PATH: dialect for dialect in DIALECTS.values()}


def dialect_of(path: str, headers: Mapping[str, str]) -> Dialect:
    """The dialect a request speaks, from Anthropic's version header or its path; Chat's
    OpenAI shape when neither says, which both OpenAI SDKs read."""
    if "anthropic-version" in headers:
        return anthropic
    for prefix, dialect in BY_PATH.items():
        if path.startswith(prefix):
            return dialect
    return chat
