"""Config: precedence (defaults < TOML < env < overrides) and fix-it messages for bad values."""

from pathlib import Path

import pytest

from assistant.config import AssistantConfig, int8_residual_linears
from assistant.errors import ConfigError


def test_defaults_are_valid_and_data_dir_derives_paths():
    config = AssistantConfig.load(env={})
    assert config.engine.model == "qwen2.5-coder-0.5b"
    assert config.resolved_models_dir == Path("data/models")
    assert config.store_url.startswith("sqlite:///") and config.store_url.endswith("data/assistant.db")


def test_precedence_toml_then_env_then_overrides(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('data_dir = "/srv/a"\n[engine]\nnum_threads = 1\nmax_new_tokens = 64\n[server]\nport = 9000\n')
    env = {"ASSISTANT_ENGINE_NUM_THREADS": "2", "ASSISTANT_MODELS_DIR": "/shared/models"}
    config = AssistantConfig.load(toml, env=env, overrides={"server.port": 9100})
    assert config.data_dir == Path("/srv/a")
    assert config.engine.max_new_tokens == 64  # from TOML
    assert config.engine.num_threads == 2  # env beats TOML
    assert config.server.port == 9100  # override beats all
    assert config.resolved_models_dir == Path("/shared/models")


def test_unknown_model_lists_available_ones():
    with pytest.raises(ConfigError) as e:
        AssistantConfig.load(env={"ASSISTANT_ENGINE_MODEL": "gpt-5"})
    message = str(e.value)
    assert "gpt-5" in message and "qwen2.5-coder-0.5b" in message and "large" in message
    assert "path" in message  # tells how to use a local model instead


def test_bad_number_names_the_setting():
    with pytest.raises(ConfigError, match=r"server.port='eighty' is not a valid int"):
        AssistantConfig.load(env={"ASSISTANT_SERVER_PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"between 1 and 65535"):
        AssistantConfig.load(env={"ASSISTANT_SERVER_PORT": "70000"})


def test_int8_residual_names_the_linears():
    for good, names in (("down", ("down",)), ("qkv, down", ("qkv", "down")), ("all", ("qkv", "o", "gate_up", "down")),
                        ("", ())):
        assert AssistantConfig.load(overrides={"engine.int8_residual": good}).engine.int8_residual == good
        assert int8_residual_linears(good) == names
    with pytest.raises(ConfigError, match=r"engine.int8_residual='down,mlp' is not valid.*qkv, o, gate_up, down"):
        AssistantConfig.load(overrides={"engine.int8_residual": "down,mlp"})


def test_int8_outliers_is_a_channel_count():
    assert AssistantConfig.load(env={}).engine.int8_outliers == 16
    assert AssistantConfig.load(overrides={"engine.int8_outliers": 0}).engine.int8_outliers == 0
    for bad in (-1, 33):
        with pytest.raises(ConfigError, match=r"engine.int8_outliers=.* must be 0 to 32 \(0 = the residual pass\)"):
            AssistantConfig.load(overrides={"engine.int8_outliers": bad})


def test_unknown_setting_lists_known_ones(tmp_path):
    toml = tmp_path / "b.toml"
    toml.write_text("[engine]\nmodle = 'small'\n")
    with pytest.raises(ConfigError, match=r"Unknown setting engine.'modle'.*model"):
        AssistantConfig.load(toml, env={})


def test_missing_and_broken_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        AssistantConfig.load(tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        AssistantConfig.load(bad, env={})


def test_local_model_path_is_accepted(tmp_path):
    config = AssistantConfig.load(env={"ASSISTANT_ENGINE_MODEL": str(tmp_path)})
    assert config.engine.model == str(tmp_path)


def test_unknown_large_model_says_how_to_turn_routing_off():
    with pytest.raises(ConfigError, match=r"engine.large_model.*\"\" to serve every turn"):
        AssistantConfig.load(env={"ASSISTANT_ENGINE_LARGE_MODEL": "huge"})
    assert AssistantConfig.load(env={"ASSISTANT_ENGINE_LARGE_MODEL": "large"}).engine.large_model == "large"
