"""Train the engine's byte-level BPE tokenizer from the bundled corpus.

Run once; the result is shipped as ``tokcap_devtools/engine/assets/tokenizer.json`` so every process loads the
same ids. Training is deterministic for a fixed corpus, vocabulary size and `tokenizers`
version, so re-running it reproduces the shipped file.

    python -m tokcap_devtools.engine.train_tokenizer            # train from tokcap_devtools/engine/assets/corpus.txt
    python -m tokcap_devtools.engine.train_tokenizer --rebuild-corpus   # regenerate the corpus first
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS / "corpus.txt"
TOKENIZER_PATH = ASSETS / "tokenizer.json"
VOCAB_SIZE = 4096

# Special tokens frame the chat; they never come out of ordinary text.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens: the model writes them as text, so they survive decoding.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# Modules whose docstrings make the corpus: plain English prose plus code vocabulary.
CORPUS_MODULES = [
    "json",
    "textwrap",
    "argparse",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "subprocess",
    "shutil",
    "os",
    "re",
    "string",
    "datetime",
    "logging",
    "unittest",
    "http.client",
    "urllib.parse",
    "csv",
    "random",
    "statistics",
    "fractions",
    "decimal",
    "tempfile",
    "glob",
    "fnmatch",
    "zipfile",
    "tarfile",
    "dataclasses",
    "enum",
    "typing",
]


def build_corpus() -> str:
    """Docstrings of a fixed list of stdlib modules, plus tool-call shaped JSON lines."""
    parts: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc and getattr(obj, "__module__", name) == name:
                parts.append(doc)
    parts.append(
        '{"name": "Bash", "arguments": {"command": "ls -la", "description": "List files"}}\n'
        '{"name": "Read", "arguments": {"file_path": "/tmp/notes.txt"}}\n'
        "The command printed hello. Let me check the files in the current directory.\n"
    )
    return "\n\n".join(parts)


def train(corpus: str, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in ADDED_TOKENS])
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild-corpus", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    if args.rebuild_corpus or not CORPUS_PATH.exists():
        CORPUS_PATH.write_text(build_corpus(), encoding="utf-8")
    tokenizer = train(CORPUS_PATH.read_text(encoding="utf-8"), args.vocab_size)
    tokenizer.save(str(TOKENIZER_PATH))
    print(f"wrote {TOKENIZER_PATH} ({tokenizer.get_vocab_size()} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
