"""The product stays apart from its test tools (issue 24).

A front-end or worker install (``pip install tokcap``) carries neither the development
engine nor the demo and local Redis helpers (``devtools/``, the ``tokcap-devtools``
package), nor the libraries only they and ``tokcap report --png`` use; and the development
engine reaches the product only through its public names.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import api
import tokcap

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("api", "capture", "transports", "tokcap")
DEVTOOLS = ("tokcap_devtools",)
# The product's public names the development engine may use: each package's ``__all__``.
PUBLIC = {"api": set(api.__all__), "tokcap": set(tokcap.__all__)}


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Each absolute import of a file: its line, the module, the names taken from it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def test_no_product_module_imports_the_test_tools() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {module}"
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, module, _ in imports(path)
        if module.split(".")[0] in DEVTOOLS
    ]
    assert offenders == []


def test_the_product_distribution_ships_no_test_tool_and_needs_none_of_their_libraries() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {pattern.rstrip("*") for pattern in packages} == set(PRODUCT)
    assert not any((ROOT / name).exists() for name in DEVTOOLS), "test tools live in devtools/"
    needed = " ".join(project["project"]["dependencies"])
    for library in ("jinja2", "anthropic", "matplotlib"):
        assert library not in needed, f"{library} is a dependency of the product"
    assert "matplotlib" in " ".join(project["project"]["optional-dependencies"]["report"])


def test_the_development_engine_uses_only_the_products_public_names() -> None:
    offenders = []
    for path in sorted((ROOT / "devtools" / "tokcap_devtools" / "engine").rglob("*.py")):
        for line, module, names in imports(path):
            top = module.split(".")[0]
            if top not in PRODUCT:
                continue
            private = module != top or not set(names) <= PUBLIC.get(top, set())
            if private:
                offenders.append(f"{path.name}:{line} from {module} import {', '.join(names)}")
    assert offenders == []
