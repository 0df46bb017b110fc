"""The registry of named configurations (services/configs.py): the live default runs what the
simulator calls `talaria` but for the declared differences; every name selects one frozen
value, knobs are overridden by name with clear errors, and the older flags are aliases."""

from __future__ import annotations

import dataclasses

import pytest
import structlog

from talaria.services import configs
from talaria.services.instance_agent.engine import TorchEngine
from talaria.services.instance_agent.runner import SNAPSHOT_ON_CHANGE_MIN_S, CallRunner
from talaria.services.router.router_service import RouterService
from talaria.shared.settings import Settings, SettingsError
from talaria.sim import cli as sim_cli
from talaria.sim.matrix import cells, run_config

# Per instance, not per configuration: the deployment decides them (pools, pins).
PER_INSTANCE = {"pool", "pinned_model", "initial_model"}


def _live(tmp_path, **env):
    """The router's policy and the agent's scheduler as the live services build them (the
    router's shell and the agent's runner over a real torch engine)."""
    settings = Settings.of(data_dir=tmp_path, models=("qwen3-tiny",), **env)
    router = RouterService(settings.common, settings.router, structlog.get_logger())
    configuration = configs.selected(settings.common, ablation=settings.agent.ablation)
    sc = configuration.scheduler
    engine = TorchEngine(tmp_path, ["qwen3-tiny"], kv_pages=32, host_kv_pages=64, hkvr=sc.hkvr, staging=sc.staging)
    try:
        agent = CallRunner(settings.common, settings.agent, engine, None, None, None, None, structlog.get_logger())
        return router, agent.core.sched.config
    finally:
        engine.close()


def test_the_live_default_runs_the_simulators_talaria_but_for_the_declared_differences(tmp_path):
    router, live_sched = _live(tmp_path)
    base = next(c for c in cells() if c.name == "base@60%")
    sim, pools, _, _ = run_config(base, "talaria")
    assert (router.core.policy.name, router.core.policy.config) == (sim.policy, sim.policy_config)
    declared = {d.knob: d.sim for d in configs.SIM_DIFFERS}
    for f in dataclasses.fields(live_sched):
        live, simulated = getattr(live_sched, f.name), getattr(sim.scheduler, f.name)
        if f.name in declared:
            assert simulated == declared[f.name], f.name
        elif f.name not in PER_INSTANCE:
            assert live == simulated, f"{f.name}: live {live!r}, simulator {simulated!r} (not declared)"
    # pools: the simulator deploys talaria's online pools; live they are the operator's (configs.LIVE_POOLS)
    assert pools == "online" and sim.hot_pools and router.core.pools is None
    # the agents' reporting: heartbeat and snapshot-on-change pace as live
    assert (sim.heartbeat_s, sim.snapshot_on_change_s) == (Settings().agent.heartbeat_s, SNAPSHOT_ON_CHANGE_MIN_S)


def test_the_older_live_variables_select_the_same_configurations(tmp_path):
    for env, name in (({"policy": "llm-d"}, "llm-d"), ({"ablation": "no-sp"}, "talaria-no-sp"),
                      ({"config": "talaria-paper"}, "talaria-paper")):
        s = Settings.of(data_dir=tmp_path, **env)
        got = configs.selected(s.common, policy=s.router.policy, ablation=s.agent.ablation)
        want = configs.get(name)
        assert (got.policy, got.router, got.scheduler) == (want.policy, want.router, want.scheduler), env
    s = Settings.of(data_dir=tmp_path, lease_timeout_s=0.0, config_set=("gamma=0.8",))
    assert RouterService(s.common, s.router, structlog.get_logger()).core.policy.config == \
        configs.get("talaria", lease_timeout_s=0.0, gamma=0.8).router


@pytest.mark.parametrize("env,variable", [
    ({"config": "nope"}, "TALARIA_CONFIG"), ({"policy": "nope"}, "TALARIA_POLICY"),
    ({"config": "talaria", "policy": "llm-d"}, "TALARIA_POLICY"),
    ({"config_set": ("bogus=1",)}, "TALARIA_CONFIG_SET"), ({"config_set": ("gamma=2",)}, "TALARIA_CONFIG_SET"),
])
def test_a_bad_live_choice_is_a_settings_error_naming_its_variable(tmp_path, env, variable):
    s = Settings.of(data_dir=tmp_path, **env)
    with pytest.raises(SettingsError) as err:
        RouterService(s.common, s.router, structlog.get_logger())
    assert err.value.variable == variable and "\n" not in str(err.value)


def test_every_name_is_one_frozen_value_and_covers_the_ablations_and_peers():
    names = configs.names()
    assert len(names) == len(set(names))
    assert {"talaria", "talaria-paper", "talaria-round-only", "talaria-no-sp", "talaria-forecast-pools"} <= set(names)
    assert set(configs.PEERS) <= set(names) and all(configs.get(p).pools == "per-model" for p in configs.PEERS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        configs.get("talaria").pools = "shared"
    assert not configs.get("talaria-round-only").scheduler.sp and configs.get("talaria").scheduler.sp


def test_knobs_are_overridden_by_name_with_checks():
    cfg = configs.get("talaria", gamma=0.8, lease_charge_s="0.5", sp="off", hot_pools_z=2)
    assert (cfg.router.gamma, cfg.scheduler.gamma, cfg.router.lease_charge_s, cfg.scheduler.sp) == (0.8, 0.8, 0.5, False)
    assert cfg.hot_pools_z == 2.0 and configs.get("talaria") != cfg  # the registry's value is untouched
    one = configs.get("talaria", **{"router.gamma": 0.5})
    assert (one.router.gamma, one.scheduler.gamma) == (0.5, 0.9)
    for bad, says in (({"bogus": 1}, "unknown knob 'bogus'"), ({"gamma": "high"}, "gamma='high': expected a float"),
                      ({"gamma": 2.0}, "gamma"), ({"pools": "lukewarm"}, "pools='lukewarm'"),
                      ({"sp": 3}, "expected a bool"), ({"policy": "nope"}, "policy='nope'")):
        with pytest.raises(configs.ConfigurationError, match=says):
            configs.get("talaria", **bad)
    with pytest.raises(configs.ConfigurationError, match="unknown configuration 'nope'"):
        configs.get("nope")


def test_the_results_label_reads_back_through_one_function():
    cfg = configs.get("talaria", price_rotation_join=False)
    assert configs.label("talaria", {"lease_charge_s": 0.5}) == "talaria[lease_charge_s=0.5]"
    assert configs.from_label("talaria[price_rotation_join=0]") == cfg
    assert configs.from_label("talaria[lease_charge_s=0.5]").router.lease_charge_s == 0.5
    with pytest.raises(configs.ConfigurationError):
        configs.from_label("talaria[lease_charge_s")


def _sim_config(*argv):
    return sim_cli.configuration(sim_cli.build_parser().parse_args(["run", *argv]))[1]


def test_the_simulators_older_flags_are_aliases():
    def same(a, b):
        return (a.policy, a.router, a.scheduler, a.pools) == (b.policy, b.router, b.scheduler, b.pools)

    assert same(_sim_config("--policy", "talaria", "--deploy", "as-deployed", "--pools", "forecast"),
                configs.get("talaria-forecast-pools"))
    assert same(_sim_config("--policy", "dynamo-kv", "--deploy", "as-deployed"), configs.get("dynamo-kv"))
    assert same(_sim_config("--policy", "talaria", "--ablation", "round-only", "--tau", "2"),
                configs.get("talaria-round-only", lease_timeout_s=2.0, pools="shared"))
    assert same(_sim_config("--config", "talaria", "--set", "lease_timeout_s=0"), configs.get("talaria-no-lease"))


def test_a_bad_simulator_knob_is_one_line(capsys):
    assert sim_cli.main(["run", "--config", "talaria", "--set", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown knob 'bogus'") and err.count("\n") == 1


def test_the_matrix_runs_named_configurations_checked_before_any_run():
    from argparse import Namespace

    from talaria.sim.experiments import _extra_configs

    assert _extra_configs(Namespace(configs="talaria-no-sp, talaria,llm-d[lease_timeout_s=2],talaria-no-sp")) == \
        ("talaria-no-sp", "llm-d[lease_timeout_s=2]")
    with pytest.raises(SystemExit, match="--configs: unknown configuration 'nope'"):
        _extra_configs(Namespace(configs="nope"))
