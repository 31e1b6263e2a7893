"""One generation: policy reply -> planned token ids -> scored, stopped, parsed sequence.

The engine encodes the policy's text canonically and appends ``<|im_end|>``; where the
policy leaves words free (random policy) the pseudo-model samples them with the request's
seed, from a vocabulary mask under which any run of words re-encodes to itself. With the
``noncanonical_rate`` knob some planned tokens are replaced by two vocabulary tokens with
the same bytes. Every emitted token gets its log-prob from the pseudo-model at its true
position. Stop strings, ``max_tokens`` and the end token end the sequence the way vLLM ends it: the
token that completes a stop string is kept in the ids, the stop string is cut from the text.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field, replace

from .chat_template import ChatTemplate, chat_template
from .ground_truth import GroundTruthLog
from .pacing import Pace
from .policies import Conversation, Policy, Reply, make_policy, reply_text
from .sampler import PseudoModel, Step
from .settings import EngineSettings
from .template import COMPACT_SEPARATORS, TEMPLATE_SEPARATORS
from .tokenizer import EngineTokenizer, StreamDecoder, load_tokenizer
from .tool_parser import ParsedReply, parse_reply

# Placeholders in a plan: the model samples an opening word / a following word there.
SAMPLE_FIRST, SAMPLE_WORD = -1, -2
_MARK = "\x00sampled\x00"
_PROBE = "A"


class ContextLengthError(ValueError):
    """The request does not fit the model's context; each wire words it as its engine does.

    ``requested`` is the completion budget asked for, or None when the prompt alone leaves
    no room (both engines word that case apart).
    """

    def __init__(self, limit: int, prompt_tokens: int, requested: int | None) -> None:
        self.limit = limit
        self.prompt_tokens = prompt_tokens
        self.requested = requested
        wanted = "" if requested is None else f" plus {requested} to generate"
        super().__init__(f"{prompt_tokens} prompt tokens{wanted} exceed the context of {limit}")


class ScriptedError(Exception):
    """The script asked for an HTTP error instead of a reply (failure tests)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: every token
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0


@dataclass
class Generation:
    index: int
    token_ids: list[int]
    steps: list[Step]
    deltas: list[str]  # visible text each token added (stop string already cut)
    text: str
    finish_reason: str  # "stop" | "length" | "tool_calls"
    stop_reason: str | int | None
    parsed: ParsedReply = field(default_factory=ParsedReply)
    weight_version: str = ""  # the engine's weight version when it sampled this

    @property
    def logprobs(self) -> list[float]:
        return [step.logprob for step in self.steps]


class Engine:
    """Owns the tokenizer, pseudo-model, policy and ground-truth log of one server."""

    def __init__(self, settings: EngineSettings, tokenizer: EngineTokenizer | None = None):
        self.settings = settings
        self.tokenizer = tokenizer or load_tokenizer(settings.tokenizer_path)
        self.template: ChatTemplate = chat_template(
            self.tokenizer, think_strip=settings.think_strip
        )
        self.model = PseudoModel(self.tokenizer.vocab_size, seed=0)
        self.policy: Policy = make_policy(settings.policy, settings.script_path)
        self.ground_truth = GroundTruthLog(settings.ground_truth_path)
        self.pace = Pace(settings.first_token_s, settings.token_s)
        # Changed by a weight update (SGLang's /update_weight_version); every sequence is
        # stamped with the version when it was sampled, and the ground truth records it.
        self.weight_version = settings.weight_version
        self._calls = itertools.count()
        self._lock = threading.Lock()

    # -- prompts ------------------------------------------------------------------------
    def chat_prompt_ids(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The prompt ids of a conversation, rendered by the template of the vocabulary."""
        return self.template.render_ids(messages, tools, add_generation_prompt)

    def check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        """The effective max_tokens (all the room left when None), or ContextLengthError."""
        limit = self.settings.max_model_len
        room = limit - prompt_len
        if room <= 0:
            raise ContextLengthError(limit, prompt_len, None)
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthError(limit, prompt_len, max_tokens)
        return room if max_tokens is None else max_tokens

    # -- generation ---------------------------------------------------------------------
    def _base_seed(self, seed: int | None) -> int:
        if seed is not None:
            return seed
        with self._lock:
            return self.settings.seed * 1_000_003 + next(self._calls)

    def _forced(
        self, reply: Reply, conversation: Conversation, tool_choice: str | dict | None
    ) -> Reply:
        names = conversation.tool_names
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            kept = tuple(c for c in reply.tool_calls if c[0] == name)
            return Reply(reply.think, "", kept or ((name, {}),)) if name else reply
        if tool_choice == "required" and names and not reply.tool_calls:
            return Reply(reply.think, "", ((names[0], {}),))
        return reply

    def _encode_before_word(self, text: str) -> list[int]:
        """Ids of ``text`` as they come out when a word follows it (trailing blanks split
        differently at the end of a string than before a letter)."""
        if not text:
            return []
        probe = self.tokenizer.encode(_PROBE)
        ids = self.tokenizer.encode(text + _PROBE)
        if ids[-len(probe) :] == probe:
            return ids[: -len(probe)]
        return self.tokenizer.encode(text)

    def plan(self, reply: Reply, rng: random.Random) -> list[int]:
        """Planned ids, with SAMPLE_* placeholders where the model draws a word."""
        separators = COMPACT_SEPARATORS if self.settings.json_reserialize else TEMPLATE_SEPARATORS
        if reply.sampled_words:
            marked = replace(reply, text=_MARK, sampled_words=0)
            head, tail = reply_text(marked, separators).split(_MARK)
            ids = (
                self._encode_before_word(head)
                + [SAMPLE_FIRST]
                + [SAMPLE_WORD] * (reply.sampled_words - 1)
                + self.tokenizer.encode("." + tail)
            )
        else:
            ids = self.tokenizer.encode(reply_text(reply, separators))
        rate = self.settings.noncanonical_rate
        if rate > 0:
            split_ids: list[int] = []
            for token_id in ids:
                pairs = self.tokenizer.splits(token_id) if token_id >= 0 else ()
                if pairs and rng.random() < rate:
                    split_ids.extend(rng.choice(pairs))
                else:
                    split_ids.append(token_id)
            ids = split_ids
        return ids + [self.tokenizer.eos_id]

    def generate(
        self,
        prompt_ids: list[int],
        conversation: Conversation,
        params: SamplingParams,
        *,
        n: int = 1,
        tool_choice: str | dict | None = None,
        parse_tools: bool = False,
        request_id: str = "",
    ) -> list[Generation]:
        max_tokens = self.check_length(len(prompt_ids), params.max_tokens)
        base_seed = self._base_seed(params.seed)
        score_seed = params.seed if params.seed is not None else 0
        rngs = [random.Random(f"{base_seed}:{index}") for index in range(n)]
        replies = [
            self._forced(self.policy.reply(conversation, rng), conversation, tool_choice)
            for rng in rngs
        ]
        for reply in replies:
            if reply.error is not None:
                raise ScriptedError(*reply.error)
        results = []
        for index, (reply, rng) in enumerate(zip(replies, rngs, strict=True)):
            planned = self.plan(reply, rng)
            gen = self._run(prompt_ids, planned, params, max_tokens, score_seed, index, rng)
            gen.parsed = parse_reply(gen.text, parse_tools=parse_tools)
            if gen.parsed.tool_calls:
                gen.finish_reason = "tool_calls"
            gen.weight_version = self.weight_version
            results.append(gen)
            self._record(request_id, prompt_ids, gen)
        return results

    def _run(
        self,
        prompt_ids: list[int],
        planned: list[int],
        params: SamplingParams,
        max_tokens: int,
        score_seed: int,
        index: int,
        rng: random.Random,
    ) -> Generation:
        context = list(prompt_ids)
        decoder = StreamDecoder(self.tokenizer)
        warp = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "top_logprobs": params.top_logprobs,
            "seed": score_seed,
            "raw": self.settings.logprobs_mode == "raw_logprobs",
        }
        ids: list[int] = []
        steps: list[Step] = []
        deltas: list[str] = []
        text = ""
        finish, stop_reason = "length", None
        for planned_id in planned:
            if len(ids) >= max_tokens:
                break
            if planned_id >= 0:
                step = self.model.step(context, planned_id, **warp)
            else:
                allowed = (
                    self.tokenizer.capital_word_ids
                    if planned_id == SAMPLE_FIRST
                    else self.tokenizer.word_ids
                )
                step = self.model.sample(context, allowed, rng, **warp)
            token_id = step.token_id
            ids.append(token_id)
            steps.append(step)
            context.append(token_id)
            if token_id == self.tokenizer.eos_id:
                deltas.append(decoder.flush())
                text += deltas[-1]
                finish = "stop"
                break
            delta = decoder.feed(token_id)
            searched_from = len(text)
            text += delta
            hit = self._find_stop(text, searched_from, params.stop)
            if hit is not None:
                cut, stop_reason = hit
                delta = delta[: max(0, cut - searched_from)]
                text = text[:cut]
                deltas.append(delta)
                finish = "stop"
                break
            deltas.append(delta)
        return Generation(index, ids, steps, deltas, text, finish, stop_reason)

    @staticmethod
    def _find_stop(text: str, new_from: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
        best = None
        for stop in stops:
            if not stop:
                continue
            at = text.find(stop, max(0, new_from - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _record(self, request_id: str, prompt_ids: list[int], gen: Generation) -> None:
        self.ground_truth.append(
            {
                "request_id": request_id,
                "choice_index": gen.index,
                "model": self.settings.model,
                "prompt_token_ids": list(prompt_ids),
                "token_ids": list(gen.token_ids),
                "logprobs": gen.logprobs,
                "text": gen.text,
                "reasoning": gen.parsed.reasoning,
                "content": gen.parsed.content,
                "tool_calls": [call.as_openai() for call in gen.parsed.tool_calls],
                "finish_reason": gen.finish_reason,
                "weight_version": gen.weight_version,
                "created": time.time(),
            }
        )
