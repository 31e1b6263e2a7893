"""The start-up probe: one short call that proves the engine returns what capture needs.

``tokcap serve`` runs it before the server accepts traffic. It refuses (``EngineRefused``,
exit 2) an engine that returns no token ids or no log-probs, and one that returns raw
log-probs (before temperature) while ``sampling_overrides`` samples at another temperature:
the trainer's importance ratios would then compare against a distribution that was never
sampled from. Raw log-probs are told apart with two one-token calls on the same prompt, at
temperature 1 and at the override's: the alternatives' log-probs at the first position
differ only if the engine applies the temperature to them. With ``routed_experts`` on it refuses an engine that returns no
routes, or routes of another shape than ``model_server.moe``. It warns, naming them, about the
sampling keys an engine's generation config may set (vLLM ``--generation-config auto``,
SGLang ``--sampling-defaults model``) that ``sampling_overrides`` does not pin. With faithful
prompts it also makes one token-in call, and refuses an engine that does not take it or
whose vocabulary is not the renderer's tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.engine.client import UpstreamClient
from api.engine.generation import UpstreamError
from capture.errors import ConfigError

PROBE_MESSAGES = [{"role": "user", "content": "Reply with one word: ready."}]
# Sampling keys an engine's generation config may set when a request leaves them out.
CONFIG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
ALTERNATIVES = 5
SAME = 1e-6  # log-probs this close are the same value


class TokenInPrompts(Protocol):
    """What the token-in probe needs of the faithful prompts (``api.prompts.faithful``)."""

    vocab: Any

    async def build(self, chat_request: Mapping[str, Any]) -> Any: ...


class EngineRefused(ConfigError):
    """The engine cannot give exact training ids as configured; the message says what to change."""


@dataclass
class EngineReport:
    """What the probe found, for the start-up banner."""

    family: str
    where: str
    max_model_len: int | None
    warnings: list[str] = field(default_factory=list)
    model: str | None = None  # the engine's first served model, as it answered

    def banner(self) -> str:
        length = self.max_model_len or "unknown"
        return f"engine {self.family} at {self.where} (max_model_len {length})"


def _refusal(problem: str, hints: Mapping[str, str]) -> str:
    """The refusal message of an ids problem, with the setting that fixes it."""
    about_ids = "token_ids" in problem or "prompt" in problem
    kind = "logprobs" if "log-prob" in problem and not about_ids else "ids"
    if "routed_experts" in problem or "model_server.moe" in problem:
        kind = "routes"
    return f"the engine's reply cannot be captured ({problem}): {hints[kind]}"


def unpinned_keys(overrides: Mapping[str, Any]) -> list[str]:
    return [key for key in CONFIG_SAMPLING_KEYS if key not in overrides]


async def _alternatives(client: UpstreamClient, temperature: float) -> dict[str, float]:
    """The first position's top alternatives (token -> log-prob) at ``temperature``."""
    adapter = client.adapter
    model = await client.model_name(None)
    request = {"messages": PROBE_MESSAGES, "max_tokens": 1}
    body, _ = adapter.chat_body(request, model, client.sampling_overrides)
    body.update(temperature=temperature, top_logprobs=ALTERNATIVES, seed=0)
    response = await client.post(adapter.chat_path, body)
    choices = response.get("choices") or [{}]
    content = (choices[0].get("logprobs") or {}).get("content") or [{}]
    tops = content[0].get("top_logprobs") or []
    return {
        str(top.get("token")): float(top["logprob"])
        for top in tops
        if isinstance(top, Mapping) and isinstance(top.get("logprob"), (int, float))
    }


async def logprobs_are_raw(client: UpstreamClient, temperature: float) -> bool | None:
    """Whether the engine's log-probs ignore ``temperature``; None when it cannot be told."""
    at_one = await _alternatives(client, 1.0)
    at_t = await _alternatives(client, temperature)
    common = set(at_one) & set(at_t)
    if not common:
        return None
    return all(abs(at_one[token] - at_t[token]) < SAME for token in common)


async def probe_engine(client: UpstreamClient) -> EngineReport:
    """Probe the engine behind ``client``; EngineRefused says what to change."""
    generation = await client.chat({"messages": PROBE_MESSAGES, "max_tokens": 8})
    family = client.engine  # learned by the call
    hints = client.adapter.hints
    if generation.ids_problem is not None:
        raise EngineRefused(_refusal(generation.ids_problem, hints))
    temperature = client.sampling_overrides.get("temperature")
    if isinstance(temperature, (int, float)) and temperature > 0 and abs(temperature - 1) > SAME:
        if await logprobs_are_raw(client, float(temperature)):
            raise EngineRefused(
                f"the engine returns log-probs before temperature, but sampling_overrides "
                f"samples at temperature {temperature}: {hints['raw']}"
            )
    report = EngineReport(family, client.where, client.max_model_len, model=client.served_model)
    unpinned = unpinned_keys(client.sampling_overrides)
    if unpinned:
        report.warnings.append(
            f"sampling_overrides does not pin {', '.join(unpinned)}: the engine's generation "
            "config (vLLM --generation-config auto, SGLang --sampling-defaults model) may set "
            "them, and the trainer would not know the distribution sampled from; pin them "
            "(e.g. top_k: -1, min_p: 0.0, repetition_penalty: 1.0)"
        )
    return report


def _visible(text: str, vocab: Any) -> str:
    """Text without the vocabulary's added tokens, which engines show or hide by setting."""
    for token in vocab.added:
        text = text.replace(token, "")
    return text


async def probe_token_in(client: UpstreamClient, prompts: TokenInPrompts) -> None:
    """Faithful prompts: the engine takes a token-id prompt and shares the renderer's
    vocabulary (the text it decodes from the ids it sampled is the renderer's decoding)."""
    prompt = await prompts.build({"messages": PROBE_MESSAGES, "max_tokens": 8})
    generation = await client.complete_ids(prompt.ids, prompt.sampling)
    if generation.ids_problem is not None:
        problem = _refusal(generation.ids_problem, client.adapter.hints)
        raise EngineRefused(problem + " (token-in call)")
    ids = generation.generation_token_ids or []
    ours = _visible(prompts.vocab.decode(ids, skip_special_tokens=False), prompts.vocab)
    theirs = _visible(generation.text, prompts.vocab)
    if ours.strip() != theirs.strip():
        raise EngineRefused(
            f"the engine decodes its sampled ids as {theirs[:60]!r}, model_server.renderer."
            f"tokenizer as {ours[:60]!r}: the renderer's tokenizer is not the engine's; "
            "point renderer.tokenizer at the served model's tokenizer"
        )


async def probe_client(client: UpstreamClient, prompts: TokenInPrompts | None) -> EngineReport:
    """Probe the engine behind ``client`` (and token-in, with faithful ``prompts``).

    An engine that cannot be reached is not refused (it may still be starting): the report
    says the probe was skipped, and every call is checked on its own anyway. The client is
    closed after.
    """
    try:
        report = await probe_engine(client)
        if prompts is not None:
            await probe_token_in(client, prompts)
        return report
    except UpstreamError as exc:
        if exc.status == 401:
            raise EngineRefused(
                "the engine answered 401 Unauthorized: set model_server.upstream_api_key "
                "(for example ${oc.env:TOKCAP_UPSTREAM_API_KEY}) to the key it was started with"
            ) from exc
        if "unreachable" in exc.message:
            report = EngineReport(client.engine, client.where, None)
            report.warnings.append(f"probe skipped: {exc.message}")
            return report
        raise EngineRefused(f"the probe call failed: {exc.message}{_failure_hint(exc)}") from exc
    finally:
        await client.close()


def _failure_hint(exc: UpstreamError) -> str:
    """What an engine error on the probe's plain chat call usually means. vLLM 0.32 started
    with ``--skip-tokenizer-init`` answers a chat call with a bare 500 (it can neither render
    the messages nor detokenize), so the front end could not read a reply from it."""
    if exc.status < 500:
        return ""
    return (
        " (an engine that cannot answer a plain chat call cannot serve the harness: a vLLM "
        "started with --skip-tokenizer-init does this; start it with its tokenizer)"
    )


def odd_engine(first: EngineReport, other: EngineReport) -> str | None:
    """Why ``other`` cannot serve beside ``first`` in one pool (family, model, context
    window), or None; an engine the probe could not reach is judged at its first call."""
    if any(w.startswith("probe skipped") for w in (*first.warnings, *other.warnings)):
        return None
    for what, mine, theirs in (
        ("engine family", first.family, other.family),
        ("model", first.model, other.model),
        ("max_model_len", first.max_model_len, other.max_model_len),
    ):
        if mine != theirs:
            return f"engine {other.where} serves {what} {theirs!r}, {first.where} {mine!r}"
    return None


async def probe_pool(clients: list[UpstreamClient], prompts: TokenInPrompts | None) -> EngineReport:
    """Probe every engine of a pool (each client closed after); all must agree on family,
    model and context window (and, with faithful prompts, each takes the renderer's ids),
    or ``EngineRefused`` names the odd one. One report for the pool."""
    reports = [await probe_client(client, prompts) for client in clients]
    first = reports[0]
    for report in reports[1:]:
        problem = odd_engine(first, report)
        if problem is not None:
            raise EngineRefused(f"the pool's engines differ: {problem}")
    if len(reports) == 1:
        return first
    warnings = list(dict.fromkeys(w for report in reports for w in report.warnings))
    where = ", ".join(report.where for report in reports)
    return EngineReport(first.family, where, first.max_model_len, warnings, first.model)
