"""The token_id_capture config block: placement, interpolation, validation, sink factory, opt-in."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from capture.config import (
    TokenIdCaptureConfig,
    agent_opted_in,
    load_capture_config,
    load_document,
)
from capture.errors import ConfigError
from tests.support import sinks_for_config

HELPERS = "tests.support.sinks_for_config"


def write_yaml(tmp_path: Path, text: str, name: str = "gym.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- where the block lives -------------------------------------------------------------


def test_block_under_env_nemo_gym(tmp_path):
    path = write_yaml(
        tmp_path,
        f"""
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      dir: {tmp_path}/captures
      max_mask_fraction: 0.25
""",
    )
    config = load_capture_config(path)
    assert config.enabled is True
    assert config.dir == f"{tmp_path}/captures"
    assert config.max_mask_fraction == 0.25
    assert config.rebuild_response is True
    assert config.all_agents is False


def test_block_at_top_level_and_path_given_as_str(tmp_path):
    path = write_yaml(tmp_path, "token_id_capture:\n  enabled: true\n  dir: /var/tmp/caps\n")
    config = load_capture_config(str(path))
    assert config.enabled and config.dir == "/var/tmp/caps"


def test_no_block_means_capture_off():
    config = load_capture_config("upstream: http://127.0.0.1:9/v1\n")
    assert config == TokenIdCaptureConfig()
    assert config.enabled is False
    assert config.build_sink() is None


def test_block_in_both_places_is_an_error():
    text = """
token_id_capture: {enabled: false}
env: {nemo_gym: {token_id_capture: {enabled: true, dir: /tmp/x}}}
"""
    with pytest.raises(ConfigError, match="both at env.nemo_gym.token_id_capture"):
        load_capture_config(text)


def test_block_that_is_not_a_mapping():
    with pytest.raises(ConfigError, match="token_id_capture must be a mapping"):
        load_capture_config("token_id_capture: true\n")


def test_sources_mapping_dictconfig_and_yaml_text_agree(tmp_path):
    block = {"token_id_capture": {"enabled": True, "dir": "/tmp/caps", "all_agents": True}}
    from_mapping = load_capture_config(block)
    from_dictconfig = load_capture_config(OmegaConf.create(block))
    from_text = load_capture_config(
        "token_id_capture: {enabled: true, dir: /tmp/caps, all_agents: true}"
    )
    from_file = load_capture_config(
        write_yaml(tmp_path, OmegaConf.to_yaml(OmegaConf.create(block)))
    )
    assert from_mapping == from_dictconfig == from_text == from_file
    assert from_mapping.all_agents is True


def test_missing_file_and_bad_yaml_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_capture_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="cannot load config"):
        load_capture_config("token_id_capture: [\n  enabled: true\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_document("- a\n- b\n")


# --- interpolation ------------------------------------------------------------------------


def test_env_interpolation(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKCAP_TEST_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("TOKCAP_TEST_ENABLED", "true")
    monkeypatch.delenv("TOKCAP_TEST_UNSET", raising=False)
    path = write_yaml(
        tmp_path,
        """
env:
  nemo_gym:
    token_id_capture:
      enabled: ${oc.env:TOKCAP_TEST_ENABLED}
      dir: ${oc.env:TOKCAP_TEST_DIR}
      sink_kwargs:
        label: ${oc.env:TOKCAP_TEST_UNSET,fallback}
      max_mask_fraction: ${oc.env:TOKCAP_TEST_UNSET,0.5}
""",
    )
    config = load_capture_config(path)
    assert config.enabled is True
    assert config.dir == str(tmp_path / "from-env")
    assert config.sink_kwargs == {"label": "fallback"}
    assert config.max_mask_fraction == 0.5


def test_missing_env_variable_names_it(monkeypatch):
    monkeypatch.delenv("TOKCAP_TEST_NOPE", raising=False)
    with pytest.raises(ConfigError, match="TOKCAP_TEST_NOPE"):
        load_capture_config("token_id_capture:\n  dir: ${oc.env:TOKCAP_TEST_NOPE}\n")


def test_select_and_references_to_other_keys(tmp_path):
    path = write_yaml(
        tmp_path,
        """
paths:
  root: /data/run7
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      dir: ${paths.root}/captures
      sink_kwargs:
        present: ${oc.select:paths.root,/nowhere}
        absent: ${oc.select:paths.missing,/default}
""",
    )
    config = load_capture_config(path)
    assert config.dir == "/data/run7/captures"
    assert config.sink_kwargs == {"present": "/data/run7", "absent": "/default"}


def test_load_document_resolves_the_other_settings(monkeypatch):
    monkeypatch.setenv("TOKCAP_TEST_UPSTREAM", "http://127.0.0.1:8011/v1")
    document = load_document(
        """
upstream: ${oc.env:TOKCAP_TEST_UPSTREAM}
sampling_overrides: {temperature: 1.0, top_p: 1.0}
token_id_capture: {enabled: false}
"""
    )
    assert type(document) is dict
    assert document["upstream"] == "http://127.0.0.1:8011/v1"
    assert document["sampling_overrides"] == {"temperature": 1.0, "top_p": 1.0}


# --- validation ---------------------------------------------------------------------------


def test_unknown_key_is_named():
    with pytest.raises(ConfigError) as raised:
        load_capture_config(
            "env: {nemo_gym: {token_id_capture: {enabled: true, dir: /x, dri: /y}}}"
        )
    message = str(raised.value)
    assert "env.nemo_gym.token_id_capture.dri" in message
    assert "unknown key" in message


def test_unknown_key_rejected_while_disabled():
    with pytest.raises(ConfigError, match=r"token_id_capture\.all_agent\b"):
        load_capture_config({"token_id_capture": {"enabled": False, "all_agent": True}})


def test_disabled_block_keeps_other_settings_valid_and_checked():
    config = load_capture_config(
        {
            "token_id_capture": {
                "enabled": False,
                "sink": f"{HELPERS}:ListSink",
                "sink_kwargs": {"label": "kept"},
                "all_agents": True,
                "max_mask_fraction": 0.1,
            }
        }
    )
    assert config.enabled is False
    assert config.sink == f"{HELPERS}:ListSink"
    assert config.sink_kwargs == {"label": "kept"}
    assert config.build_sink() is None
    with pytest.raises(ConfigError, match="relative"):
        load_capture_config({"token_id_capture": {"enabled": False, "dir": "captures"}})
    with pytest.raises(ConfigError, match="max_mask_fraction"):
        load_capture_config({"token_id_capture": {"enabled": False, "max_mask_fraction": 1.5}})


def test_enabled_needs_a_store_unless_no_rebuild():
    with pytest.raises(ConfigError, match="neither 'dir' nor 'sink'"):
        load_capture_config({"token_id_capture": {"enabled": True}})
    config = load_capture_config({"token_id_capture": {"enabled": True, "rebuild_response": False}})
    assert config.enabled and not config.rebuild_response
    assert config.build_sink() is None


def test_relative_dir_rejected_and_named():
    with pytest.raises(ConfigError) as raised:
        load_capture_config({"token_id_capture": {"enabled": True, "dir": "./captures"}})
    assert "token_id_capture.dir" in str(raised.value)
    assert "relative" in str(raised.value)


@pytest.mark.parametrize("fraction", [-0.01, 1.01])
def test_max_mask_fraction_range(fraction):
    with pytest.raises(ConfigError, match="max_mask_fraction"):
        load_capture_config({"token_id_capture": {"max_mask_fraction": fraction}})


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0, None])
def test_max_mask_fraction_accepted(fraction):
    config = load_capture_config({"token_id_capture": {"max_mask_fraction": fraction}})
    assert config.max_mask_fraction == fraction


def test_empty_strings_from_optional_env_mean_unset(monkeypatch):
    monkeypatch.delenv("TOKCAP_TEST_UNSET", raising=False)
    config = load_capture_config(
        'token_id_capture: {dir: "${oc.env:TOKCAP_TEST_UNSET,\'\'}", sink: ""}\n'
    )
    assert config.dir is None and config.sink is None


# --- sink factory -------------------------------------------------------------------------


def enabled_with(sink: str, **extra) -> TokenIdCaptureConfig:
    return load_capture_config({"token_id_capture": {"enabled": True, "sink": sink, **extra}})


def test_sink_built_from_module_class_with_kwargs():
    config = enabled_with(f"{HELPERS}:ListSink", sink_kwargs={"label": "redis-a", "capacity": 3})
    assert config.sink_class() is sinks_for_config.ListSink
    sink = config.build_sink()
    assert isinstance(sink, sinks_for_config.ListSink)
    assert (sink.label, sink.capacity) == ("redis-a", 3)


def test_sink_factory_function_and_nested_attribute():
    sink = enabled_with(f"{HELPERS}:make_list_sink", sink_kwargs={"label": "fn"}).build_sink()
    assert isinstance(sink, sinks_for_config.ListSink) and sink.label == "fn"
    nested = enabled_with(f"{HELPERS}:Namespace.InnerSink").build_sink()
    assert isinstance(nested, sinks_for_config.ListSink)


def test_sink_and_dir_warns_and_sink_wins(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tokcap.config"):
        config = enabled_with(f"{HELPERS}:ListSink", dir=str(tmp_path / "caps"))
    assert any("sink" in r.getMessage() and "dir" in r.getMessage() for r in caplog.records)
    assert isinstance(config.build_sink(), sinks_for_config.ListSink)
    assert not (tmp_path / "caps").exists()


def test_sink_path_config_from_yaml_with_env_kwargs(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKCAP_TEST_URL", "redis://127.0.0.1:1/0")
    path = write_yaml(
        tmp_path,
        f"""
env:
  nemo_gym:
    token_id_capture:
      enabled: true
      sink: {HELPERS}:NeedsUrlSink
      sink_kwargs: {{url: "${{oc.env:TOKCAP_TEST_URL}}"}}
""",
    )
    sink = load_capture_config(path).build_sink()
    assert isinstance(sink, sinks_for_config.NeedsUrlSink)
    assert sink.label == "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("tests.support.sinks_for_config.ListSink", "one colon"),
        ("tests.support.sinks_for_config:List:Sink", "one colon"),
        (":ListSink", "empty module path"),
        ("tests.support.sinks_for_config:", "empty class name"),
        ("tests/sinks_for_config:ListSink", "not a valid"),
        ("tests.sinks for config:ListSink", "not a valid"),
    ],
)
def test_malformed_sink_path(path, problem):
    with pytest.raises(ConfigError) as raised:
        enabled_with(path)
    assert "token_id_capture.sink" in str(raised.value)
    assert problem in str(raised.value)


def test_malformed_sink_path_rejected_while_disabled():
    with pytest.raises(ConfigError, match="one colon"):
        load_capture_config({"token_id_capture": {"sink": "no_colon_here"}})


def test_module_not_importable():
    config = enabled_with("tests.no_such_sink_module:Sink")
    with pytest.raises(ConfigError, match="cannot import module 'tests.no_such_sink_module'"):
        config.build_sink()


def test_attribute_missing():
    with pytest.raises(ConfigError, match="has no attribute 'NoSuchSink'"):
        enabled_with(f"{HELPERS}:NoSuchSink").build_sink()
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        enabled_with(f"{HELPERS}:Namespace.Missing").build_sink()


def test_attribute_not_callable():
    with pytest.raises(ConfigError, match="not a class"):
        enabled_with(f"{HELPERS}:NOT_CALLABLE").build_sink()


def test_factory_rejecting_kwargs_names_them_not_their_values():
    config = enabled_with(
        f"{HELPERS}:NeedsUrlSink", sink_kwargs={"url": "redis://x", "password": "hunter2"}
    )
    with pytest.raises(ConfigError) as raised:
        config.build_sink()
    message = str(raised.value)
    assert "rejects sink_kwargs (password, url)" in message
    assert "hunter2" not in message


def test_factory_missing_required_kwargs():
    with pytest.raises(ConfigError, match=r"rejects sink_kwargs \(none\)"):
        enabled_with(f"{HELPERS}:NeedsUrlSink").build_sink()


def test_factory_failing_to_start_is_a_config_error():
    with pytest.raises(ConfigError, match="failed to start.*cannot reach the store"):
        enabled_with(f"{HELPERS}:FailingStartSink").build_sink()


@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("NoMarkIncompleteSink", "mark_incomplete"),
        ("PutNotCallableSink", "put"),
        ("make_object_without_close", "close"),
    ],
)
def test_object_without_sink_methods(name, missing):
    with pytest.raises(ConfigError) as raised:
        enabled_with(f"{HELPERS}:{name}").build_sink()
    assert "not a token sink" in str(raised.value)
    assert f"no callable {missing}" in str(raised.value)


def test_dir_builds_the_file_store(tmp_path):
    from capture.filestore.store import FileTokenStore

    config = load_capture_config(
        {"token_id_capture": {"enabled": True, "dir": str(tmp_path / "captures")}}
    )
    store = config.build_sink()
    assert isinstance(store, FileTokenStore)


# --- agent opt-in -------------------------------------------------------------------------

AGENTS = """
env:
  nemo_gym:
    token_id_capture:
      enabled: {enabled}
      dir: /tmp/tokcap-test-caps
      all_agents: {all_agents}
responses_api_agents:
  claude_code_agent:
    token_id_capture: true
  nested_agent:
    responses_api_agents_impl:
      entrypoint: app.py
      token_id_capture: true
  plain_agent:
    entrypoint: app.py
  declined_agent:
    token_id_capture: false
"""


def test_agent_flag_opts_in():
    document = AGENTS.format(enabled="true", all_agents="false")
    assert agent_opted_in(document, "claude_code_agent") is True
    assert agent_opted_in(document, "nested_agent") is True
    assert agent_opted_in(document, "plain_agent") is False
    assert agent_opted_in(document, "declined_agent") is False
    assert agent_opted_in(document, "unknown_agent") is False


def test_all_agents_overrides_agent_flags():
    document = load_document(AGENTS.format(enabled="true", all_agents="true"))
    for name in ("claude_code_agent", "plain_agent", "declined_agent", "unknown_agent"):
        assert agent_opted_in(document, name) is True


@pytest.mark.parametrize("all_agents", ["true", "false"])
def test_nothing_opts_in_while_disabled(all_agents):
    document = AGENTS.format(enabled="false", all_agents=all_agents)
    for name in ("claude_code_agent", "nested_agent", "plain_agent"):
        assert agent_opted_in(document, name) is False


def test_agent_flag_must_be_boolean():
    document = {
        "token_id_capture": {"enabled": True, "dir": "/tmp/x"},
        "responses_api_agents": {"a": {"token_id_capture": "yes please"}},
    }
    with pytest.raises(ConfigError, match=r"responses_api_agents\.a\.token_id_capture"):
        agent_opted_in(document, "a")
