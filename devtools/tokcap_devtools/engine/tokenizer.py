"""The engine's tokenizer: a byte-level BPE (shipped or any ``tokenizer.json``) or Qwen3's.

Ids come from `tokenizers` for a ``tokenizer.json`` (by default the shipped
``tokcap_devtools/engine/assets/tokenizer.json``), or, for ``qwen3``, from the real Qwen3 vocabulary that
``api.prompts.vocab`` loads (tiktoken, 151,669 ids). Past encode/decode the engine only
works with each token's raw bytes, so both backends look alike: it decodes token by token
the way a streaming server does, and names two-token splits of a token (a non-canonical
segmentation: the same bytes, different ids) for the ``noncanonical_rate`` knob.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from api import (
    BYTE_TO_CHAR,
    CHAR_TO_BYTE,
    QWEN3,
    VocabTokenizer,
    file_tokenizer,
    qwen3_tokenizer,
)

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_PATH = ASSETS / "tokenizer.json"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"


Encode = Callable[[str], list[int]]
Decode = Callable[[list[int], bool], str]


class EngineTokenizer:
    """A loaded tokenizer with per-token bytes, special-token ids and split tables.

    Build one with :meth:`from_file` or :meth:`from_vocab`; ``name_or_path`` is the file,
    or ``qwen3``.
    """

    def __init__(
        self,
        name_or_path: str,
        *,
        encode: Encode,
        decode: Decode,
        token_bytes: list[bytes],
        added: dict[str, int],
        special_ids: Iterable[int],
    ) -> None:
        self.name_or_path = name_or_path
        self._encode = encode
        self._decode = decode
        self.token_bytes = token_bytes
        self.vocab_size = len(token_bytes)
        self.added = dict(added)
        self.added_ids = set(self.added.values())
        self.special_ids = set(special_ids)
        self.im_start_id = self.added.get(IM_START)
        self.im_end_id = self.added.get(IM_END)
        self.eos_id = self.im_end_id
        self._id_of_bytes = {
            b: i for i, b in enumerate(self.token_bytes) if i not in self.added_ids
        }

    @classmethod
    def from_file(cls, path: str | Path = DEFAULT_TOKENIZER_PATH) -> EngineTokenizer:
        """A byte-level ``tokenizer.json``; encode and decode are the `tokenizers` ones."""
        return cls.from_vocab(file_tokenizer(path))

    @classmethod
    def from_vocab(cls, vocab: VocabTokenizer) -> EngineTokenizer:
        """A vocabulary of ``api.prompts.vocab`` (Qwen3's): its encode (NFC first, as
        Qwen3's tokenizer normalizes) and decode, and every token's bytes read once."""
        return cls(
            str(vocab.name_or_path),
            encode=vocab.encode,
            decode=lambda ids, skip: vocab.decode(ids, skip_special_tokens=skip),
            token_bytes=[vocab.token_bytes(i) for i in range(vocab.vocab_size)],
            added=vocab.added,
            special_ids=vocab.special_ids,
        )

    # -- text <-> ids -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Canonical ids of ``text``; special and added tokens written in it are recognised."""
        return self._encode(text)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._decode(list(ids), skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of an added token, or of a vocabulary token spelled byte-level (``Ġthe``)."""
        if token in self.added:
            return self.added[token]
        try:
            raw = bytes(CHAR_TO_BYTE[ch] for ch in token)
        except KeyError:
            return None
        return self._id_of_bytes.get(raw)

    def token_str(self, token_id: int) -> str:
        """The token as its vocabulary spells it (``convert_ids_to_tokens``: ``Ġthe``)."""
        raw = self.token_bytes[token_id]
        if token_id in self.added_ids:
            return raw.decode("utf-8")
        return "".join(BYTE_TO_CHAR[b] for b in raw)

    def token_text(self, token_id: int) -> str:
        """One token shown alone, as servers show it in logprobs (partial UTF-8 -> U+FFFD)."""
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    def visible_bytes(self, token_id: int) -> bytes:
        """Bytes this token adds to the reply text (special tokens add none)."""
        return b"" if token_id in self.special_ids else self.token_bytes[token_id]

    # -- grammar masks for sampled words -------------------------------------------------
    def _self_encoding(self, pattern: bytes) -> list[int]:
        """Vocabulary tokens matching ``pattern`` that are their own canonical encoding.

        The regex runs first, so only its matches (a sixth of Qwen3's vocabulary) are
        encoded: the whole vocabulary takes well under a second.
        """
        regex = re.compile(pattern)
        return [
            i
            for i, raw in enumerate(self.token_bytes)
            if i not in self.added_ids and regex.fullmatch(raw) and self.encode(raw.decode()) == [i]
        ]

    @functools.cached_property
    def word_ids(self) -> list[int]:
        """Tokens `` word``: any run of them (after a capital word) re-encodes to itself."""
        return self._self_encoding(rb" [a-z]{2,}")

    @functools.cached_property
    def capital_word_ids(self) -> list[int]:
        """Tokens ``Word`` that can open a sentence."""
        return self._self_encoding(rb"[A-Z][a-z]+")

    # -- non-canonical segmentation -----------------------------------------------------
    @functools.cache  # noqa: B019 - one tokenizer per process; the table is small
    def splits(self, token_id: int) -> tuple[tuple[int, int], ...]:
        """Pairs of vocabulary tokens whose bytes concatenate to this token's bytes."""
        if token_id in self.added_ids:
            return ()
        raw = self.token_bytes[token_id]
        pairs = []
        for cut in range(1, len(raw)):
            left = self._id_of_bytes.get(raw[:cut])
            right = self._id_of_bytes.get(raw[cut:])
            if left is not None and right is not None:
                pairs.append((left, right))
        return tuple(pairs)


class StreamDecoder:
    """Incremental detokenizer: feed ids, get the text each one completes (UTF-8 safe)."""

    def __init__(self, tokenizer: EngineTokenizer) -> None:
        self._tokenizer = tokenizer
        self._pending = b""

    def feed(self, token_id: int) -> str:
        self._pending += self._tokenizer.visible_bytes(token_id)
        try:
            text = self._pending.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data":
                text = self._pending.decode("utf-8", errors="replace")
            else:
                text = self._pending[: exc.start].decode("utf-8", errors="replace")
                self._pending = self._pending[exc.start :]
                return text
        self._pending = b""
        return text

    def flush(self) -> str:
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text


@functools.cache
def load_tokenizer(spec: str | None = None) -> EngineTokenizer:
    """``qwen3`` (the real Qwen3 vocabulary), a ``tokenizer.json`` path, or the shipped one."""
    if spec == QWEN3:
        return EngineTokenizer.from_vocab(qwen3_tokenizer())
    return EngineTokenizer.from_file(spec or DEFAULT_TOKENIZER_PATH)


__all__ = [
    "EngineTokenizer",
    "StreamDecoder",
    "load_tokenizer",
    "QWEN3",
    "IM_START",
    "IM_END",
    "END_OF_TEXT",
]
