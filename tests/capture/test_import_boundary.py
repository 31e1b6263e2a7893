"""capture/ stays free of server imports, so a trainer can import it without the server stack."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import capture

CAPTURE_DIR = Path(capture.__file__).resolve().parent
FORBIDDEN = (
    "fastapi",
    "redis",
    "uvicorn",
    "httpx",
    "starlette",
    "api",
    "transports",
    "engine",
    "tokcap_devtools",
    "tokcap",
)


def capture_modules() -> list[str]:
    """Every module of capture/, its subpackages included, by dotted name."""
    names = []
    for path in CAPTURE_DIR.rglob("*.py"):
        parts = path.relative_to(CAPTURE_DIR.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def is_forbidden(module: str) -> bool:
    return module.split(".")[0] in FORBIDDEN


def modules_loaded_by(script: str) -> list[str]:
    """The modules a fresh interpreter has loaded after ``script``, run from the root of
    the repository: what importing (and using) capture costs a trainer."""
    program = f"import json, sys\n{script}\nprint(json.dumps(sorted(sys.modules)))\n"
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=CAPTURE_DIR.parent,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_all_of_capture_loads_no_server_module():
    loaded = modules_loaded_by(
        f"""
import importlib
import capture
for name in {capture_modules()!r}:
    importlib.import_module(name)
for name in capture.__all__:
    getattr(capture, name)
"""
    )
    assert "capture.records" in loaded  # the check itself ran
    offenders = [name for name in loaded if is_forbidden(name)]
    assert offenders == [], f"importing capture loaded {offenders}"


def test_capture_step_metrics_loads_no_logging_library():
    """The caller logs; importing and running step_metrics pulls in no logger's package."""
    loaded = modules_loaded_by('import capture\ncapture.step_metrics([{"mask_sample": False}])')
    assert "capture.metrics" in loaded  # the check itself ran
    roots = {name.split(".")[0] for name in loaded}
    assert not roots & {"wandb", "tensorboard", "tensorboardX", "mlflow", "torch"}


def test_no_capture_file_imports_server_modules():
    offenders = []
    for path in sorted(CAPTURE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if is_forbidden(n)]
    assert offenders == []


def test_every_public_name_is_declared():
    required = {
        "TokenEntry",
        "TokenCaptureSnapshot",
        "TokenSink",
        "TokenSource",
        "FileTokenStore",
        "TokenIdCaptureConfig",
        "rollout_id_from_run_body",
        "capture_base_url",
        "finalize_rollout_token_capture",
        "retire_rollout_token_capture",
        "run_builder",
        "install_token_source",
        "install_token_sink",
    }
    assert required <= set(capture.__all__)
