"""A deterministic pseudo-model: a full next-token distribution per position, cheaply.

The policy decides what to say; this decides how likely each emitted token was, so every
generated token carries a real log-probability under a proper distribution over the whole
vocabulary: the one sampled from, after temperature, top-k and top-p (vLLM's
``processed_logprobs``), or the model's own before them (``raw_logprobs``). Where the policy
leaves words free (the random policy's text), :meth:`PseudoModel.sample` draws them from
the model under a grammar mask, with the request's seed (over arrays: a mask of tens of
thousands of words in about a millisecond, so a stream's other requests are not held up).

The logits at one position are a fixed vector of ``V`` values (drawn once from a seeded
Gaussian and sorted) laid onto the vocabulary by a permutation chosen by a hash of
(context tail, position, seed); the planned token is lifted above the best of them by a
hashed margin, so it is always the top token and always inside any top-k or top-p cut. Because
a permutation does not change the multiset of logits, the normaliser comes from prefix
sums computed once per temperature: each step costs a hash and a binary search, not ``V``
exponentials.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from dataclasses import dataclass

import numpy

CONTEXT_TAIL = 4
LOGIT_SCALE = 2.0
MIN_MARGIN, MAX_MARGIN = 0.5, 4.5
FLOOR = -9999.0  # vLLM clamps -inf log-probs to this value


@dataclass(frozen=True)
class Step:
    """One position: the emitted token's log-prob and the best alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-prob), best first


class PseudoModel:
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        rng = random.Random(seed)
        self._base = sorted((rng.gauss(0.0, LOGIT_SCALE) for _ in range(vocab_size)), reverse=True)
        self._base_array = numpy.asarray(self._base)
        self._allowed: dict[int, tuple[list[int], numpy.ndarray]] = {}
        multiplier = 1_000_003
        while math.gcd(multiplier, vocab_size) != 1:
            multiplier += 2
        self._mul = multiplier
        self._mul_inv = pow(multiplier, -1, vocab_size)
        self._prefix: dict[float, list[float]] = {}

    # Rank r of token t at a position with offset h: r = (t * mul + h) mod V.
    def _rank(self, token_id: int, offset: int) -> int:
        return (token_id * self._mul + offset) % self.vocab_size

    def _token(self, rank: int, offset: int) -> int:
        return ((rank - offset) * self._mul_inv) % self.vocab_size

    def _prefix_sums(self, temperature: float) -> list[float]:
        """P[k] = sum of exp((base[j] - base[0]) / T) for j < k; every term is <= 1."""
        sums = self._prefix.get(temperature)
        if sums is None:
            top = self._base[0]
            sums = [0.0]
            for value in self._base:
                sums.append(sums[-1] + math.exp((value - top) / temperature))
            if len(self._prefix) > 32:
                self._prefix.clear()
            self._prefix[temperature] = sums
        return sums

    def _position_hash(self, context: list[int], seed: int) -> tuple[int, int]:
        """(permutation offset, 64-bit fraction) for this context tail and position."""
        tail = context[-CONTEXT_TAIL:]
        digest = hashlib.blake2b(
            struct.pack(f"<{len(tail) + 2}q", len(context), seed, *tail), digest_size=16
        ).digest()
        offset, fraction = struct.unpack("<QQ", digest)
        return offset % self.vocab_size, fraction

    def sample(
        self,
        context: list[int],
        allowed: list[int],
        rng: random.Random,
        *,
        temperature: float,
        top_p: float,
        top_k: int = 0,
        top_logprobs: int = 0,
        seed: int = 0,
        raw: bool = False,
    ) -> Step:
        """Draw a token from the model restricted to ``allowed`` (a grammar mask).

        The logits are the unlifted permuted ones; tokens outside ``allowed`` are masked out
        as constrained decoding masks them. Temperature, top-k and top-p apply to what is
        left and the draw uses ``rng``. The log-prob reported is the drawn token's under
        exactly that distribution, or with ``raw`` under the masked model before them.
        """
        offset, _ = self._position_hash(context, seed)
        greedy = temperature <= 0
        temp = 1.0 if greedy else temperature
        tokens = self._tokens(allowed)
        values = self._base_array[(tokens * self._mul + offset) % self.vocab_size]
        order = numpy.argsort(-values, kind="stable")  # best first
        tokens, values = tokens[order], values[order]
        best = values[0]
        weights = numpy.exp((values - best) / temp)
        kept = 1 if greedy else _kept_count(weights, top_p, top_k)
        cumulative = numpy.cumsum(weights[:kept])
        mass = float(cumulative[-1])
        index = 0 if greedy else _draw(cumulative, mass, rng)
        if raw:  # at temperature 1 these are the very weights, so both modes agree exactly
            plain = weights if temp == 1.0 else numpy.exp(values - best)
            # Summed as the kept mass is (in order), so both modes agree to the last bit.
            reported = numpy.log(plain / float(numpy.cumsum(plain)[-1]))
        else:
            reported = numpy.full(len(weights), FLOOR)
            reported[:kept] = numpy.log(weights[:kept] / mass)
        logprob = float(reported[index])
        top: list[tuple[int, float]] = []
        if top_logprobs > 0:
            top.append((int(tokens[index]), logprob))
            for rank in range(len(tokens)):
                if len(top) >= top_logprobs:
                    break
                if rank != index:
                    top.append((int(tokens[rank]), max(float(reported[rank]), FLOOR)))
        return Step(int(tokens[index]), max(logprob, FLOOR), tuple(top))

    def _tokens(self, allowed: list[int]) -> numpy.ndarray:
        """``allowed`` as an array, kept for the lists the engine passes every step."""
        held = self._allowed.get(id(allowed))
        if held is None or held[0] is not allowed:
            held = self._allowed[id(allowed)] = (allowed, numpy.asarray(allowed, dtype=numpy.int64))
        return held[1]

    def step(
        self,
        context: list[int],
        token_id: int,
        *,
        temperature: float,
        top_p: float,
        top_k: int = 0,
        top_logprobs: int = 0,
        seed: int = 0,
        raw: bool = False,
    ) -> Step:
        """Log-prob of ``token_id`` following ``context`` (prompt + generated so far), under
        temperature, top-k and top-p, or with ``raw`` under the model before them."""
        offset, fraction = self._position_hash(context, seed)
        margin = MIN_MARGIN + (MAX_MARGIN - MIN_MARGIN) * (fraction / 2**64)
        temp, nucleus, keep = _warp(temperature, top_p, top_k, raw)
        removed = self._rank(token_id, offset)  # the planned token's slot leaves the pool
        pool = _Pool(
            sums=self._prefix_sums(temp),
            removed=removed,
            removed_mass=math.exp((self._base[removed] - self._base[0]) / temp),
            lift=math.exp(-margin / temp),  # others relative to the planned token's weight 1
        )
        cut = self.vocab_size
        if 0 < keep < self.vocab_size:
            cut = pool.top_k_cut(keep)
        if nucleus < 1.0:
            cut = pool.nucleus_cut(nucleus, cut)
        log_norm = math.log(pool.kept_mass(cut))
        logprob = -log_norm
        top: list[tuple[int, float]] = []
        if top_logprobs > 0:
            top.append((token_id, logprob))
            base0 = self._base[0]
            rank = 0
            while len(top) < top_logprobs and rank < self.vocab_size:
                if rank != removed:
                    alt = FLOOR
                    if rank < cut:
                        alt = (self._base[rank] - base0 - margin) / temp - log_norm
                    top.append((self._token(rank, offset), max(alt, FLOOR)))
                rank += 1
        return Step(token_id, max(logprob, FLOOR), tuple(top))


def _warp(temperature: float, top_p: float, top_k: int, raw: bool) -> tuple[float, float, int]:
    """The (temperature, top-p, top-k) a step's log-probs are taken under.

    Raw log-probs, and greedy decoding, report the model's own distribution, as vLLM's
    ``raw_logprobs`` does; otherwise the one sampled from (``processed_logprobs``).
    """
    if raw or temperature <= 0:
        return 1.0, 1.0, 0
    return temperature, (top_p if 0 < top_p < 1 else 1.0), max(top_k, 0)


def _kept_count(weights: numpy.ndarray, top_p: float, top_k: int) -> int:
    """How many of the weights sorted best first a sampler keeps: the top k, then the
    smallest head holding ``top_p`` of their mass (vLLM's order: top-k, then top-p)."""
    kept = top_k if 0 < top_k < len(weights) else len(weights)
    if 0 < top_p < 1:
        cumulative = numpy.cumsum(weights[:kept])
        reached = int(numpy.searchsorted(cumulative, top_p * cumulative[-1], side="left"))
        return min(reached + 1, kept)
    return kept


def _draw(cumulative: numpy.ndarray, mass: float, rng: random.Random) -> int:
    """The index a uniform draw below ``mass`` falls at, in the kept weights' running sums."""
    index = int(numpy.searchsorted(cumulative, rng.random() * mass, side="right"))
    return min(index, len(cumulative) - 1)


@dataclass(frozen=True)
class _Pool:
    """One position's distribution at one temperature, in prefix sums: the planned token
    (weight 1) above the permuted pool of every other token (weights scaled by ``lift``)."""

    sums: list[float]
    removed: int
    removed_mass: float
    lift: float

    def kept_mass(self, k: int) -> float:
        """Mass of the planned token plus pool ranks < k (without its old slot)."""
        mass = self.sums[k] - (self.removed_mass if self.removed < k else 0.0)
        return 1.0 + self.lift * max(mass, 0.0)

    def top_k_cut(self, k: int) -> int:
        """The pool rank cut that keeps k tokens: the planned one and the k - 1 best others."""
        return k - 1 if self.removed >= k - 1 else k

    def nucleus_cut(self, top_p: float, limit: int) -> int:
        """The smallest cut (at most ``limit``) whose kept mass reaches ``top_p`` of it."""
        target = top_p * self.kept_mass(limit)
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi) // 2
            if self.kept_mass(mid) >= target:
                hi = mid
            else:
                lo = mid + 1
        return lo


__all__ = ["PseudoModel", "Step"]
