"""deploy/k8s/: every manifest is valid against the Kubernetes API schemas (kubernetes-validate, which bundles
them: no cluster, no network), and the manifests agree with each other, with the server's settings and with the
image (ports, probe paths, ADAPTLM_* names and values, the user, the balancer's configuration)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from server.settings import Settings
from tests.deploy.test_image import DOCKERFILE, instructions

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest minor release the manifests promise to work on
NAMESPACE = "adaptlm"


def kustomization() -> dict[str, Any]:
    return dict(yaml.safe_load((K8S / "kustomization.yaml").read_text()))


def resources() -> list[dict[str, Any]]:
    return [doc for name in kustomization()["resources"] for doc in yaml.safe_load_all((K8S / name).read_text())
            if doc]


def find(kind: str, name: str) -> dict[str, Any]:
    [found] = [r for r in resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert kustomization()["namespace"] == NAMESPACE
    assert all(r["metadata"].get("namespace", NAMESPACE) == NAMESPACE for r in resources() if r["kind"] != "Namespace")


@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_manifest_is_valid(name: str) -> None:
    for doc in yaml.safe_load_all((K8S / name).read_text()):
        # strict: a misspelt or misplaced field is an error, not ignored
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_bad_manifest() -> None:
    bad = find("Deployment", "adaptlm")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_settings_are_the_servers() -> None:
    deployment = find("Deployment", "adaptlm")
    server = container(deployment, "adaptlm")
    [config_ref] = server["envFrom"]
    config = find("ConfigMap", config_ref["configMapRef"]["name"])["data"]
    env = {**config, **{e["name"]: e["value"] for e in server["env"]}}
    assert all(name.startswith("ADAPTLM_") for name in env), "settings are ADAPTLM_* variables only"
    fields = set(Settings.model_fields)
    assert {name.removeprefix("ADAPTLM_").lower() for name in env} <= fields
    settings = Settings(**{name.removeprefix("ADAPTLM_").lower(): value for name, value in env.items()})
    # the session store is the Redis Service of redis.yaml, in this namespace, on its port
    redis = find("Service", "redis")
    url = str(settings.session_store)
    assert url.startswith(f"redis://{redis['metadata']['name']}.{NAMESPACE}.svc.cluster.local:")
    assert url.split(":")[2].split("/")[0] == str(redis["spec"]["ports"][0]["port"])
    http_port = [p for p in server["ports"] if p["name"] == "http"][0]["containerPort"]
    assert http_port == settings.port


def test_probes_ports_and_user_match_the_server_and_image() -> None:
    deployment = find("Deployment", "adaptlm")
    server = container(deployment, "adaptlm")
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # The server binds its port only after loading the model: until then the liveness probe's connection is refused,
    # so a startup probe must hold it off for longer than a load takes (or a slow load restarts the pod forever).
    startup = server["startupProbe"]
    assert startup["httpGet"] == {"path": "/healthz", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    assert "command" not in server and "args" not in server, "the image's command: one `adaptlm serve`"
    assert server["image"] == "adaptlm" and kustomization()["images"][0]["name"] == "adaptlm"
    [user] = [i.args for i in instructions(DOCKERFILE.read_text()) if i.keyword == "USER"]
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert f"{security['runAsUser']}:{security['runAsGroup']}" == user and security["runAsNonRoot"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in ("adaptlm", "adaptlm-replicas"):
        spec = find("Service", service)["spec"]
        assert spec["selector"].items() <= labels.items() and spec["ports"][0]["targetPort"] == "http"
    assert find("Service", "adaptlm-replicas")["spec"]["clusterIP"] == "None"
    assert find("PodDisruptionBudget", "adaptlm")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = find("HorizontalPodAutoscaler", "adaptlm")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "adaptlm"}
    assert hpa["minReplicas"] >= 2, "one replica left to fail over to"
    assert "cpu" in server["resources"]["requests"], "a CPU utilization target needs a CPU request"


def test_redis_persists_and_never_evicts() -> None:
    redis = find("StatefulSet", "redis")
    args = container(redis, "redis")["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in container(redis, "redis")["volumeMounts"]


def test_the_balancer_is_the_shared_configuration() -> None:
    config = find("ConfigMap", "adaptlm-balancer")["data"]
    assert config["adaptlm.conf.template"] == (ROOT / "deploy" / "nginx" / "adaptlm.conf.template").read_text(), \
        "deploy/k8s/balancer.yaml's template differs from deploy/nginx/adaptlm.conf.template: copy it over"
    assert config["empty.conf"] == (ROOT / "deploy" / "nginx" / "empty.conf").read_text()
    nginx = container(find("Deployment", "adaptlm-balancer"), "nginx")
    env = {e["name"]: e["value"] for e in nginx["env"]}
    placeholders = set(re.findall(r"\$\{(BALANCER_\w+)\}", config["adaptlm.conf.template"]))
    assert set(env) == placeholders
    assert nginx["ports"][0]["containerPort"] == int(env["BALANCER_PORT"])
    servers = re.findall(r"server (\S+):(\d+) resolve", env["BALANCER_SERVERS"])
    assert servers == [(f"adaptlm-replicas.{NAMESPACE}.svc.cluster.local", str(Settings().port))]
    mounts = {m["mountPath"]: m["subPath"] for m in nginx["volumeMounts"]}
    assert mounts == {"/etc/nginx/templates/adaptlm.conf.template": "adaptlm.conf.template",
                      "/etc/nginx/conf.d/default.conf": "empty.conf"}


def test_the_drain_time_is_the_same_everywhere() -> None:
    # docs/operations.md: "SIGTERM after a 5 s pre-stop pause, then the rest of the 60 s grace period, 55 s, to drain";
    # compose and the systemd unit give the same 60 s before SIGKILL
    pod = find("Deployment", "adaptlm")["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    pause = container(find("Deployment", "adaptlm"), "adaptlm")["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep" and 0 < int(pause[1]) < grace
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert re.search(rf"SIGTERM after a {pause[1]} s\s+pre-stop pause, then the rest of the {grace} s grace\s+period, "
                     rf"{grace - int(pause[1])} s, to drain", operations), "docs/operations.md's drain times"
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    assert compose["x-adaptlm"]["stop_grace_period"] == f"{grace}s"
    unit = (ROOT / "deploy" / "adaptlm.service").read_text()
    assert re.search(rf"^TimeoutStopSec={grace}$", unit, flags=re.MULTILINE)
