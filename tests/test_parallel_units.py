"""The suite's units of work under pytest-xdist (``tests.support.parallel``)."""

from __future__ import annotations

from tests.support.parallel import UnitsOfWork


def _unit(nodeid: str) -> str:
    scheduler = object.__new__(UnitsOfWork)  # the split reads nothing of the scheduler's state
    return scheduler._split_scope(nodeid)


def test_the_real_engine_tier_is_one_unit_and_other_modules_each_their_own() -> None:
    tier = {
        _unit("tests/real_engines/test_probe.py::test_a_vllm_without_its_tokenizer_is_refused"),
        _unit("tests/real_engines/test_engines.py::test_the_probe[vllm]"),
        _unit("tests/real_engines/test_claude_code.py::test_the_cli[sglang]"),
    }
    assert tier == {"real_engines"}
    assert _unit("tests/api/test_resume.py::test_a[x]") == "tests/api/test_resume.py"
    assert _unit("tests/api/test_resume.py::test_b") == "tests/api/test_resume.py"
    assert _unit("tests/e2e/test_demo.py::test_c") == "tests/e2e/test_demo.py"
