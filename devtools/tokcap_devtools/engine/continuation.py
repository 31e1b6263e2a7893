"""A model continues its own text: a prompt that ends inside a reply the engine sampled.

A front end that resumes a call a weight update cut sends the call's prompt with the ids
sampled so far appended (tokcap's ``api.call.resume``). A real model then goes on with what
it was saying; the scripted policy, reading the prompt as a conversation, would start a new
reply instead, so a call cut at every update would never end. ``SampledReplies`` keeps the
replies the engine sampled, by prompt, and answers such a prompt with the rest of the reply
it extends: the same ids and log-probs, as the same model at the same positions would
sample them (the pseudo-model's weights are the same across versions).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .generation import Generation

# Replies kept (the oldest are forgotten), and how many of a prompt's last ids key it.
KEPT = 2048
TAIL = 64

Key = tuple[int, tuple[int, ...]]


def _key(ids: list[int], length: int) -> Key:
    return length, tuple(ids[max(0, length - TAIL) : length])


class SampledReplies:
    """The replies an engine sampled, each under its prompt, for the prompts that extend one."""

    def __init__(self) -> None:
        self._replies: OrderedDict[Key, tuple[list[int], Generation]] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # prompt lengths held: where a prompt may split
        self._lock = threading.Lock()

    def remember(self, prompt_ids: list[int], generation: Generation) -> None:
        key = _key(prompt_ids, len(prompt_ids))
        with self._lock:
            if key not in self._replies:
                self._lengths[key[0]] += 1
            self._replies[key] = (list(prompt_ids), generation)
            self._replies.move_to_end(key)
            while len(self._replies) > KEPT:
                (length, _), _ = self._replies.popitem(last=False)
                self._lengths[length] -= 1
                if not self._lengths[length]:
                    del self._lengths[length]

    def rest_of(self, prompt_ids: list[int]) -> Generation | None:
        """The rest of the reply ``prompt_ids`` ends inside (its prompt, then some of its
        first ids), or None when it extends none."""
        with self._lock:
            lengths = [length for length in self._lengths if length < len(prompt_ids)]
            found = [self._replies.get(_key(prompt_ids, length)) for length in lengths]
        for held in found:
            if held is None:
                continue
            prompt, reply = held
            sampled = prompt_ids[len(prompt) :]
            if (
                prompt_ids[: len(prompt)] == prompt
                and len(sampled) < len(reply.token_ids)
                and reply.token_ids[: len(sampled)] == sampled
            ):
                return reply.after(len(sampled))
        return None
