"""The front end's rooms keep their doors (issue 32): a dialect never reaches into the
engine room, the engine room never into a dialect or a call, and no room of ``api`` reads
the rebuild's internals (``capture.build``) to learn an entry's fields."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "api"

# room -> module prefixes it must never import
FORBIDDEN = {
    "dialects": ("api.engine", "api.call", "api.edge", "api.state", "api.prompts", "api.app"),
    "engine": ("api.dialects", "api.call", "api.edge", "api.state", "api.prompts", "api.app"),
    "edge": ("api.engine.vllm", "api.engine.sglang", "api.engine.vllm_stream"),
    "call": ("api.engine.vllm", "api.engine.sglang", "api.engine.vllm_stream"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def offenders(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.name}:{line} imports {module}"
        for path in paths
        for line, module in imported_modules(path)
        if any(module == f or module.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_never_imports_what_it_must_not(room: str) -> None:
    paths = sorted((API / room).rglob("*.py"))
    assert paths, f"api/{room} has no modules"
    assert offenders(paths, FORBIDDEN[room]) == []


def test_no_front_end_module_reads_the_rebuilds_internals() -> None:
    assert offenders(sorted(API.rglob("*.py")), ("capture.build",)) == []


def test_the_checks_see_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "relay.py"
    module.write_text("from api.engine.vllm_stream import StreamedChat\nimport capture.build\n")
    assert len(offenders([module], ("api.engine",))) == 2  # the module and the name
    assert offenders([module], ("capture.build",)) != []
    assert offenders([module], ("api.dialects",)) == []


def test_both_engine_families_implement_the_adapter_interface() -> None:
    from api.engine import FAMILIES
    from api.engine.adapter import EngineAdapter

    names = [n for n in dir(EngineAdapter) if not n.startswith("_")]
    names += list(EngineAdapter.__annotations__)
    for family, make in FAMILIES.items():
        adapter = make()
        missing = [name for name in names if not hasattr(adapter, name)]
        assert missing == [], f"{family} lacks {missing}"
        assert adapter.name == family and set(adapter.hints) >= {"ids", "logprobs", "routes", "raw"}


def test_every_dialect_implements_the_dialect_interface() -> None:
    from api.dialects import DIALECTS
    from api.dialects.dialect import Dialect

    names = [n for n in dir(Dialect) if not n.startswith("_")] + list(Dialect.__annotations__)
    for name, module in DIALECTS.items():
        missing = [attr for attr in names if not hasattr(module, attr)]
        assert missing == [], f"{name} lacks {missing}"
        assert module.NAME == name
