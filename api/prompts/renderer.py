"""The renderer faithful prompts are built with: a ``renderers`` renderer on a local tokenizer.

``model_server.renderer`` names it (``name``: a renderer of the ``renderers`` package such
as ``qwen3``; ``tokenizer``: ``qwen3`` or a local tokenizer file or directory) and says how
much earlier thinking a continued prompt keeps (``thinking_retention``). Faithful mode
defaults to ``all``: a prompt extends the ids the policy sampled across user turns too, so
the policy sees its own earlier thinking where the chat template would have dropped it.
``tool_cycle`` and ``template`` are ``renderers``' narrower choices (re-render at each user
query, or always); each re-render starts a new chain.
"""

from __future__ import annotations

from typing import Any

from renderers import create_renderer
from renderers.configs import config_from_name

from api.prompts.vocab import VocabTokenizer, load_vocab
from capture.errors import ConfigError

RETENTIONS = ("all", "tool_cycle", "template")


def build_renderer(name: str, tokenizer: str, thinking_retention: str = "all") -> Any:
    """A renderer of the ``renderers`` package; ConfigError naming what is wrong."""
    return load_renderer(name, tokenizer, thinking_retention)[0]


def load_renderer(
    name: str, tokenizer: str, thinking_retention: str = "all"
) -> tuple[Any, VocabTokenizer]:
    """The renderer and the tokenizer it renders with (the start-up probe decodes with it)."""
    if thinking_retention not in RETENTIONS:
        raise ConfigError(
            f"model_server.renderer.thinking_retention must be one of {', '.join(RETENTIONS)}, "
            f"not {thinking_retention!r}"
        )
    try:
        vocab = load_vocab(tokenizer)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model_server.renderer.tokenizer {tokenizer!r}: {exc}") from None
    try:
        config = config_from_name(name)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"model_server.renderer.name {name!r} is unknown: {exc}") from None
    if config is None:
        raise ConfigError("model_server.renderer.name must name a renderer, not 'auto'")
    config = config.model_copy(update={"thinking_retention": thinking_retention})
    try:
        renderer = create_renderer(vocab, config)
    except (AssertionError, KeyError, ValueError) as exc:  # a vocabulary without its tokens
        raise ConfigError(
            f"renderer {name!r} cannot render with tokenizer {tokenizer!r}: {exc}"
        ) from None
    return renderer, vocab
