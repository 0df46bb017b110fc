"""`talaria up --role`: which parts a host starts, and the clear errors of a host that cannot join."""

from __future__ import annotations

import pytest

from talaria.cli import main
from talaria.roles import ROLES, HostPlan, RoleError, credentials_env, parse_roles


def test_all_is_every_role_and_subsets_combine():
    assert parse_roles("all") == frozenset(ROLES)
    assert parse_roles("control, gateway") == {"control", "gateway"}
    assert HostPlan(parse_roles("all")).everything


@pytest.mark.parametrize("text", ["", "router", "control,bogus", "all,agent"])
def test_unknown_roles_are_one_clear_error(text):
    with pytest.raises(RoleError, match="expected all, or a comma-separated subset"):
        parse_roles(text)


def test_only_the_control_role_owns_the_database_and_only_agent_hosts_start_agents():
    control, agent = HostPlan(frozenset({"control", "gateway"})), HostPlan(frozenset({"agent"}))
    assert control.database and control.api_keys and control.agents(2) == 0
    assert not agent.database and not agent.api_keys and agent.agents(2) == 2


def test_a_partial_host_must_be_told_where_nats_is(tmp_path):
    with pytest.raises(RoleError, match="give the cluster's NATS URL"):
        HostPlan(frozenset({"agent"})).check("", 1, None)
    HostPlan(frozenset(ROLES)).check("", 2, None)  # all: embeds its own
    with pytest.raises(RoleError, match="not a directory"):
        HostPlan(frozenset({"agent"})).check("nats://10.0.0.1:4222", 1, tmp_path / "missing")


def test_credentials_come_from_the_nats_config_env_files(tmp_path):
    (tmp_path / "agent-a1-0.env").write_text("TALARIA_NATS_USER=talaria-agent-a1-0\nTALARIA_NATS_PASSWORD=s3\n")
    assert credentials_env(tmp_path, "agent-a1-0") == {"TALARIA_NATS_USER": "talaria-agent-a1-0",
                                                       "TALARIA_NATS_PASSWORD": "s3"}
    with pytest.raises(RoleError, match="must name every agent id"):
        credentials_env(tmp_path, "agent-a2-0")
    (tmp_path / "router.env").write_text("garbage\n")
    with pytest.raises(RoleError, match="router.env:1: not KEY=VALUE"):
        credentials_env(tmp_path, "router")


def test_up_refuses_a_partial_role_without_nats_before_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TALARIA_NATS_URL", raising=False)
    assert main(["up", "--role", "agent", "--data-dir", str(tmp_path / "d")]) == 2
    assert "give the cluster's NATS URL" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
