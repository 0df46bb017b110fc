from pathlib import Path

import pytest

from talaria.shared.settings import Settings, SettingsError, async_database_url


def test_defaults_run_without_any_environment():
    s = Settings.from_env({})
    assert s.nats_url is None and s.database_url is None
    assert s.http_port == 8000 and s.policy == "talaria"


def test_environment_is_parsed_into_typed_fields():
    s = Settings.from_env({
        "TALARIA_HTTP_PORT": "9001", "TALARIA_LEASE_TIMEOUT_S": "0.5", "TALARIA_ABLATION": "no-sp",
        "TALARIA_MODELS": "qwen3-tiny, gpt2-tiny", "TALARIA_DATA_DIR": "/tmp/x",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
    })
    assert (s.http_port, s.lease_timeout_s, s.sp, s.hkvr) == (9001, 0.5, False, True)
    assert s.models == ("qwen3-tiny", "gpt2-tiny") and s.data_dir == Path("/tmp/x")
    assert s.otlp_endpoint == "http://collector:4318"


@pytest.mark.parametrize("var,value", [
    ("TALARIA_HTTP_PORT", "eighty"), ("TALARIA_ABLATION", "no-talaria"), ("TALARIA_POOL", "lukewarm"),
    ("TALARIA_DATABASE_URL", "mysql://x/y"), ("TALARIA_NATS_URL", "http://x"),
    ("TALARIA_MODELS", "gpt-5"), ("TALARIA_CALL_TIMEOUT_S", "-1"), ("TALARIA_PROJECTION_INTERVAL_S", "-0.1"),
])
def test_bad_values_name_the_variable(var, value):
    with pytest.raises(SettingsError) as info:
        Settings.from_env({var: value})
    assert info.value.variable == var


@pytest.mark.parametrize("url", ["postgresql://u@h:5/db", "postgres://u@h:5/db", "postgresql+asyncpg://u@h:5/db"])
def test_plain_and_sqlalchemy_postgres_urls_are_accepted(url):
    assert async_database_url(url) == "postgresql+asyncpg://u@h:5/db"


def test_hot_instance_pins_exactly_one_model():
    with pytest.raises(SettingsError):
        Settings.from_env({"TALARIA_POOL": "hot", "TALARIA_MODELS": "qwen3-tiny,gpt2-tiny"})


def test_a_checkpoint_directory_in_models_is_checked_at_start(tmp_path):
    import json

    import pytest

    from talaria.shared.settings import Settings, SettingsError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(SettingsError, match="architectures") as info:
        Settings.from_env({"TALARIA_MODELS": f"qwen3-tiny,mamba={tmp_path}"})
    assert info.value.variable == "TALARIA_MODELS"
