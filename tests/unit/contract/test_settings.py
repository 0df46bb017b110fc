from pathlib import Path

import pytest

from talaria.shared.settings import Settings, SettingsError, async_database_url


def test_defaults_run_without_any_environment():
    s = Settings.from_env({})
    assert s.common.nats_url is None and s.common.database_url is None
    assert s.gateway.http_port == 8000 and (s.common.config, s.router.policy) == ("", "")  # configs.py: talaria


def test_environment_is_parsed_into_typed_fields():
    s = Settings.from_env({
        "TALARIA_HTTP_PORT": "9001", "TALARIA_LEASE_TIMEOUT_S": "0.5", "TALARIA_ABLATION": "no-sp",
        "TALARIA_MODELS": "qwen3-tiny, gpt2-tiny", "TALARIA_DATA_DIR": "/tmp/x",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
    })
    assert (s.gateway.http_port, s.router.lease_timeout_s, s.agent.ablation) == (9001, 0.5, "no-sp")
    assert s.common.models == ("qwen3-tiny", "gpt2-tiny") and s.common.data_dir == Path("/tmp/x")
    assert s.common.otlp_endpoint == "http://collector:4318"


@pytest.mark.parametrize("var,value", [
    ("TALARIA_HTTP_PORT", "eighty"), ("TALARIA_ABLATION", "no-talaria"), ("TALARIA_POOL", "lukewarm"),
    ("TALARIA_DATABASE_URL", "mysql://x/y"), ("TALARIA_NATS_URL", "http://x"),
    ("TALARIA_MODELS", "gpt-5"), ("TALARIA_CALL_TIMEOUT_S", "-1"), ("TALARIA_PROJECTION_INTERVAL_S", "-0.1"),
    ("TALARIA_DTYPE", "float8"),
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


def test_each_variable_belongs_to_one_part_and_each_service_gets_common_and_its_own():
    from dataclasses import fields

    from talaria.shared.settings import PARTS, env_var

    names = [f.name for cls in PARTS.values() for f in fields(cls)]
    assert len(names) == len(set(names))  # TALARIA_<NAME> names one field of one part
    s = Settings.from_env({"TALARIA_HTTP_PORT": "9001", "TALARIA_POLICY": "round-robin", "TALARIA_POOL": "hot",
                           "TALARIA_MODELS": "gpt2-tiny", "TALARIA_SESSION_IDLE_S": "5",
                           "TALARIA_DATABASE_ADMIN_URL": "postgresql://a@h/db"})
    assert (s.gateway.http_port, s.router.policy, s.agent.pool, s.telemetry.session_idle_s) == (9001, "round-robin", "hot", 5.0)
    assert s.common.models == ("gpt2-tiny",) and s.cli.database_admin_url == "postgresql://a@h/db"
    assert env_var("otlp_endpoint") == "OTEL_EXPORTER_OTLP_ENDPOINT" and env_var("http_port") == "TALARIA_HTTP_PORT"
    with pytest.raises(TypeError, match="no setting named"):
        s.with_(http_prot=1)


def test_the_deployment_is_a_value_two_can_live_in_one_process():
    from talaria.shared.subjects import Deployment

    blue = Settings.from_env({"TALARIA_DEPLOYMENT": "blue"}).common.deployment
    default = Settings.from_env({}).common.deployment
    assert (blue.api_call, blue.events_stream) == ("blue.api.call", "BLUE_EVENTS")
    assert (default.api_call, default.events_stream) == ("talaria.api.call", "TALARIA_EVENTS")
    assert Settings.of(deployment="green").common.deployment == Deployment("green")
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"TALARIA_DEPLOYMENT": "Blue!"})
    assert info.value.variable == "TALARIA_DEPLOYMENT" and "lowercase letters" in info.value.expected


def _checkpoint_dir(path: Path, hidden: int = 64) -> Path:
    """A Hugging Face directory's config.json: enough for settings to read it as a catalogue entry."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 1024, "vocab_size": 300}))
    return path


def _settings(models: str) -> Settings:
    return Settings.from_env({"TALARIA_MODELS": models})  # the directories are this test's: they must read


def test_reading_settings_changes_nothing_global(tmp_path):
    """A checkpoint among the models is read and checked, and is in the catalogue value the
    settings give (`common.catalogue()`), never in a module's state."""
    import talaria.shared.catalog as catalog

    module_before = dict(vars(catalog))
    builtins_before = dict(catalog.BUILTIN_MODELS)
    s = _settings(f"qwen3-tiny,mine={_checkpoint_dir(tmp_path)}")
    catalogue = s.common.catalogue()
    assert vars(catalog) == module_before and dict(catalog.BUILTIN_MODELS) == builtins_before
    assert "mine" in catalogue and "mine" not in catalog.BUILTIN_MODELS
    assert [spec.name for spec in s.common.checkpoints()] == ["mine"]
    assert set(catalogue) == {*catalog.BUILTIN_MODELS, "mine"}
    with pytest.raises(AttributeError, match="immutable"):
        catalogue._by_name = {}
    with pytest.raises(TypeError):
        catalogue["other"] = catalogue["mine"]  # type: ignore[index]


def test_two_deployments_in_one_process_do_not_see_each_others_checkpoints(tmp_path):
    """Each service builds its catalogue from its own settings: a second deployment's checkpoint
    (or its own directory for the same name) is not seen by the first's gateway or engine."""
    import pickle

    from talaria.services.gateway.prepare import RequestError, prepare
    from talaria.services.instance_agent.engine import TorchEngine
    from talaria.services.instance_agent.engine.engine_errors import UnknownModel
    from talaria.shared.messages import CallRequest, ChatMessage

    blue = _settings(f"qwen3-tiny,mine={_checkpoint_dir(tmp_path / 'blue', 64)}").common.catalogue()
    green = _settings(f"qwen3-tiny,mine={_checkpoint_dir(tmp_path / 'green', 128)},"
                      f"theirs={_checkpoint_dir(tmp_path / 'theirs')}").common.catalogue()
    assert (blue["mine"].hidden, green["mine"].hidden) == (64, 128)
    assert "theirs" in green and "theirs" not in blue
    assert pickle.loads(pickle.dumps(green)) == green  # as the gateway's parser process gets it
    with pytest.raises(RequestError) as info:  # blue's gateway
        prepare(blue, CallRequest(model="theirs", messages=[ChatMessage("user", "hi")]), "s", "chat")
    assert info.value.reply.code == "model_not_found"
    with pytest.raises(UnknownModel) as refused:  # blue's engine
        TorchEngine(tmp_path / "data", ["theirs"], catalogue=blue)
    assert "theirs" in str(refused.value) and "mine" in str(refused.value)
