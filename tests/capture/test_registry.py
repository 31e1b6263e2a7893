"""The process-wide sink and source: installing checks the protocol at startup."""

from __future__ import annotations

import pytest

import capture
from capture.errors import ConfigError
from capture.registry import (
    install_token_sink,
    install_token_source,
    installed_token_sink,
    installed_token_source,
)
from tests.support.sinks_for_config import ListSink, NoMarkIncompleteSink


@pytest.fixture(autouse=True)
def clean_registry():
    sink, source = install_token_sink(None), install_token_source(None)
    yield
    install_token_sink(sink)
    install_token_source(source)


class ReadOnlySource:
    """A source over a fixed set of snapshots; enough to be installed."""

    async def freeze(self, rollout_id):
        return capture.TokenCaptureSnapshot(rollout_id=rollout_id)

    async def drop(self, rollout_id, *, snapshot_id, version):
        return True

    async def close(self):
        return None


def test_nothing_installed_by_default():
    assert installed_token_sink() is None
    assert installed_token_source() is None


def test_install_sink_returns_previous():
    first, second = ListSink("a"), ListSink("b")
    assert install_token_sink(first) is None
    assert installed_token_sink() is first
    assert install_token_sink(second) is first
    assert installed_token_sink() is second
    assert install_token_sink(None) is second
    assert installed_token_sink() is None


def test_install_sink_checks_the_protocol():
    with pytest.raises(
        ConfigError, match="NoMarkIncompleteSink cannot be installed as the token sink"
    ):
        install_token_sink(NoMarkIncompleteSink())
    with pytest.raises(ConfigError, match="no callable put, mark_incomplete, close"):
        install_token_sink(object())
    assert installed_token_sink() is None, "a rejected sink must not be installed"


def test_install_source():
    source = ReadOnlySource()
    assert install_token_source(source) is None
    assert installed_token_source() is source
    assert isinstance(source, capture.TokenSource)


def test_install_source_checks_the_protocol():
    with pytest.raises(ConfigError, match="token source: it has no callable freeze, drop"):
        install_token_source(ListSink())
    assert installed_token_source() is None


def test_public_names():
    assert capture.install_token_sink is install_token_sink
    assert capture.install_token_source is install_token_source


def test_file_store_installs_as_sink_and_source(tmp_path):
    store = capture.FileTokenStore(str(tmp_path / "caps"))
    install_token_sink(store)
    install_token_source(store)
    assert installed_token_sink() is store is installed_token_source()
