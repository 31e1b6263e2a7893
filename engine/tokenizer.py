"""The engine's tokenizer: the shipped byte-level BPE plus the byte views the engine needs.

Ids come from `tokenizers` (``engine/assets/tokenizer.json``). On top of encode/decode this
knows each token's raw bytes, so it can decode token by token the way a streaming server
does, and can name two-token splits of a token (a non-canonical segmentation: the same
bytes, different ids) for the ``noncanonical_rate`` knob.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from tokenizers import Tokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_PATH = ASSETS / "tokenizer.json"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"


def _byte_decoder() -> dict[str, int]:
    """The inverse of the GPT-2 byte-to-unicode map used by the ByteLevel pre-tokenizer."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class EngineTokenizer:
    """A loaded tokenizer with per-token bytes, special-token ids and split tables."""

    def __init__(self, path: str | Path = DEFAULT_TOKENIZER_PATH) -> None:
        self.path = Path(path)
        self.hf = Tokenizer.from_file(str(self.path))
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        added = self.hf.get_added_tokens_decoder()
        self.special_ids = {i for i, tok in added.items() if tok.special}
        self.added_ids = set(added)
        self.im_start_id = self.hf.token_to_id(IM_START)
        self.im_end_id = self.hf.token_to_id(IM_END)
        self.eos_id = self.im_end_id
        byte_of = _byte_decoder()
        self.token_bytes: list[bytes] = []
        for token_id in range(self.vocab_size):
            piece = self.hf.id_to_token(token_id)
            if token_id in self.added_ids:
                self.token_bytes.append(piece.encode("utf-8"))
            else:
                self.token_bytes.append(bytes(byte_of[ch] for ch in piece))
        self._id_of_bytes = {
            b: i for i, b in enumerate(self.token_bytes) if i not in self.added_ids
        }

    # -- text <-> ids -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Canonical ids of ``text``; special and added tokens written in it are recognised."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token shown alone, as servers show it in logprobs (partial UTF-8 -> U+FFFD)."""
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    def visible_bytes(self, token_id: int) -> bytes:
        """Bytes this token adds to the reply text (special tokens add none)."""
        return b"" if token_id in self.special_ids else self.token_bytes[token_id]

    # -- grammar masks for sampled words -------------------------------------------------
    def _self_encoding(self, pattern: bytes) -> list[int]:
        """Vocabulary tokens matching ``pattern`` that are their own canonical encoding."""
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
def load_tokenizer(path: str | None = None) -> EngineTokenizer:
    return EngineTokenizer(path or DEFAULT_TOKENIZER_PATH)


__all__ = [
    "EngineTokenizer",
    "StreamDecoder",
    "load_tokenizer",
    "IM_START",
    "IM_END",
    "END_OF_TEXT",
]
