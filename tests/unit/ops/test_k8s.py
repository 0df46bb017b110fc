"""ops/k8s: the manifests validate against Kubernetes' schemas (offline), the kustomization names
them all, nothing secret is in them, and every Secret they read is one `ops/k8s/secrets.sh` makes,
with a nats.conf that nats-server accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from talaria.embedded import nats_server_binary  # noqa: E402

K8S = Path(__file__).resolve().parents[3] / "ops" / "k8s"
VERSION = "1.30.0"  # the oldest Kubernetes release still supported upstream when this was written


def manifests() -> list[tuple[str, dict]]:
    return [(p.name, doc) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(p.read_text()) if doc]


def walk(node):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


@pytest.mark.parametrize("name,doc", manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_each_manifest_is_valid_kubernetes(name, doc):
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_kustomization_names_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_no_secret_in_the_manifests_and_containers_run_as_non_root():
    for name, doc in manifests():
        for node in walk(doc):
            if isinstance(node, dict) and "name" in node and "value" in node and not node["name"].endswith("_FILE"):
                assert not any(w in node["name"].upper() for w in ("PASSWORD", "KEY", "TOKEN", "SECRET")), (name, node)
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec is not None:
            assert spec.get("securityContext", {}).get("runAsNonRoot") is True, name


@pytest.fixture(scope="module")
def secrets_made(tmp_path_factory):
    """secrets.sh run against a recording kubectl (a test double: no cluster runs here)."""
    tmp = tmp_path_factory.mktemp("k8s")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f"""#!/bin/sh
echo "$*" >> {tmp}/kubectl.log
for a in "$@"; do case $a in --from-file=*) f=${{a#--from-file=}}; f=${{f#*=}}; cp -r "$f" {tmp}/ ;; esac; done
case "$1 $2 $3" in "get namespace"*|"-n talaria get") exit 1;; esac
cat >/dev/null
""")
    (bin_dir / "kubectl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "AGENTS": "3"}
    out = subprocess.run(["bash", str(K8S / "secrets.sh")], env=env, capture_output=True, text=True, check=True)
    return tmp, out.stdout, (tmp / "kubectl.log").read_text()


def test_every_secret_the_manifests_read_is_made_by_the_script(secrets_made):
    tmp, _, log = secrets_made
    made = {line.split("secret generic ")[1].split()[0] for line in log.splitlines() if "secret generic" in line}
    read = {n["secretName"] for _, d in manifests() for n in walk(d) if isinstance(n, dict) and "secretName" in n}
    read |= {n["secretKeyRef"]["name"] for _, d in manifests() for n in walk(d) if isinstance(n, dict) and "secretKeyRef" in n}
    assert read <= made, read - made
    for agent in range(3):  # the agents' StatefulSet pods agent-0.. read agent-<pod>.env
        assert (tmp / "nats-users" / f"agent-agent-{agent}.env").exists()
    for service in ("gateway", "router", "telemetry"):
        assert (tmp / "nats-users" / f"{service}.env").exists()
    for name, doc in manifests():  # each container's `talaria.container --env FILE` is a file the script made
        for node in walk(doc):
            if isinstance(node, dict) and node.get("args", [None])[0] == "talaria.container":
                env_file = node["args"][2].replace("$(TALARIA_INSTANCE_ID)", "agent-0")
                assert (tmp / "nats-users" / Path(env_file).name).exists(), (name, env_file)


def test_the_generated_nats_conf_is_accepted_by_nats_server(secrets_made):
    tmp, stdout, _ = secrets_made
    assert "API key for tenant default (shown once): tk-" in stdout
    conf = (tmp / "nats.conf").read_text()
    assert json.loads(conf)["cluster"]["authorization"]["user"] == "route"  # routes take no stranger
    check = subprocess.run([nats_server_binary(), "-c", str(tmp / "nats.conf"), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
