"""A deterministic pseudo-model: a full next-token distribution per position, cheaply.

The policy decides what to say; this decides how likely each emitted token was, so every
generated token carries a real log-probability under a proper distribution over the whole
vocabulary, with temperature and top-p applied the way a sampler applies them. Where the
policy leaves words free (the random policy's text), :meth:`PseudoModel.sample` draws them
from the model under a grammar mask, with the request's seed.

The logits at one position are a fixed vector of ``V`` values (drawn once from a seeded
Gaussian and sorted) laid onto the vocabulary by a permutation chosen by a hash of
(context tail, position, seed); the planned token is lifted above the best of them by a
hashed margin, so it is always the top token and always inside any top-p nucleus. Because
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
        seed: int = 0,
    ) -> Step:
        """Draw a token from the model restricted to ``allowed`` (a grammar mask).

        The logits are the unlifted permuted ones; tokens outside ``allowed`` are masked out
        as constrained decoding masks them. Temperature and top-p apply to what is left and
        the draw uses ``rng``; the log-prob reported is the drawn token's under exactly the
        distribution it was drawn from.
        """
        offset, _ = self._position_hash(context, seed)
        greedy = temperature <= 0
        temp = 1.0 if greedy else temperature
        logits = [(self._base[self._rank(t, offset)], t) for t in allowed]
        best = max(value for value, _ in logits)
        weights = sorted(((math.exp((v - best) / temp), t) for v, t in logits), reverse=True)
        kept = weights
        if not greedy and 0 < top_p < 1:
            target = top_p * sum(w for w, _ in weights)
            cumulative = 0.0
            for cut, (weight, _) in enumerate(weights, start=1):
                cumulative += weight
                if cumulative >= target:
                    kept = weights[:cut]
                    break
        mass = sum(w for w, _ in kept)
        chosen = kept[0][1]
        if not greedy:
            draw = rng.random() * mass
            for weight, token in kept:
                draw -= weight
                chosen = token
                if draw < 0:
                    break
        in_nucleus = {t: math.log(w / mass) for w, t in kept}
        logprob = in_nucleus[chosen]
        top: list[tuple[int, float]] = []
        if top_k > 0:
            top.append((chosen, logprob))
            for _, token in weights:
                if len(top) >= top_k:
                    break
                if token != chosen:
                    top.append((token, max(in_nucleus.get(token, FLOOR), FLOOR)))
        return Step(chosen, max(logprob, FLOOR), tuple(top))

    def step(
        self,
        context: list[int],
        token_id: int,
        *,
        temperature: float,
        top_p: float,
        top_k: int = 0,
        seed: int = 0,
    ) -> Step:
        """Log-prob of ``token_id`` following ``context`` (prompt + generated so far)."""
        offset, fraction = self._position_hash(context, seed)
        margin = MIN_MARGIN + (MAX_MARGIN - MIN_MARGIN) * (fraction / 2**64)
        # Greedy decoding reports the unscaled distribution, as servers do.
        temp = temperature if temperature > 0 else 1.0
        nucleus = top_p if temperature > 0 and 0 < top_p < 1 else 1.0

        sums = self._prefix_sums(temp)
        base0 = self._base[0]
        removed = self._rank(token_id, offset)  # the planned token's slot leaves the pool
        removed_mass = math.exp((self._base[removed] - base0) / temp)
        lift = math.exp(-margin / temp)  # others relative to the planned token's weight 1

        def kept_mass(k: int) -> float:
            """Mass of the planned token plus ranks < k (without its old slot)."""
            mass = sums[k] - (removed_mass if removed < k else 0.0)
            return 1.0 + lift * max(mass, 0.0)

        total = kept_mass(self.vocab_size)
        if nucleus < 1.0:
            target = nucleus * total
            lo, hi = 0, self.vocab_size
            while lo < hi:
                mid = (lo + hi) // 2
                if kept_mass(mid) >= target:
                    hi = mid
                else:
                    lo = mid + 1
            cut = lo
        else:
            cut = self.vocab_size
        log_norm = math.log(kept_mass(cut))
        logprob = -log_norm

        top: list[tuple[int, float]] = []
        if top_k > 0:
            top.append((token_id, logprob))
            rank = 0
            while len(top) < top_k and rank < self.vocab_size:
                if rank != removed:
                    if rank < cut:
                        alt = (self._base[rank] - base0 - margin) / temp - log_norm
                    else:
                        alt = FLOOR
                    top.append((self._token(rank, offset), max(alt, FLOOR)))
                rank += 1
        return Step(token_id, max(logprob, FLOOR), tuple(top))


__all__ = ["PseudoModel", "Step"]
