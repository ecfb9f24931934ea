"""deploy/k8s, the Kubernetes manifests, checked offline and against ``rampart.config``.

Core kinds are validated with ``kubernetes-validate`` in strict mode (its bundled
schemas, Kubernetes 1.37; unknown fields fail), the KEDA ScaledObject with
``jsonschema`` against a schema of KEDA 2.20's documented ScaledObject spec in
``deploy/k8s/schemas`` (written for Rampart: see the file), read strictly as the
API server does with ``--validate=strict``. The kustomize overlays are rendered with ``kubectl
kustomize`` where kubectl is installed. Then the numbers must agree with the
code: image and bentofile.yaml, grace period and the longest deadline, autoscaling
thresholds and the queue-delay setting, env names and ``rampart.config.Settings``,
probe paths and trigger metrics and a real server (tests/server/test_deploy.py).
"""

from __future__ import annotations

import copy
import math
import re
import shutil
import subprocess

import pytest
import yaml

from rampart.config import ENV_PREFIX, FLAT_NAMES, Settings
from tests.support import ROOT
from tests.support.deploy import K8S, adapter_rules, container, deployment, load_all, one, scaled_object, validate

OVERLAYS = ("cpu", "gpu")
#: Seconds the grace period must leave after the preStop sleep and the longest deadline,
#: for the last answer to leave and the processes to exit.
GRACE_MARGIN_S = 5


def manifest_files() -> list:
    """Every complete resource file (not kustomize's own files, patches or schemas)."""
    return sorted(
        p for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml" and not p.name.startswith("patch-") and "schemas" not in p.parts
    )


def render(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the overlays are not rendered (their base files are validated)")
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def env(deployment: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(deployment).get("env", [])}


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates(path):
    docs = load_all(path)
    assert docs
    for doc in docs:
        validate(doc)


def test_validators_reject_mistakes():
    bad_port = copy.deepcopy(deployment())
    container(bad_port)["ports"][0]["containerPort"] = "3000"  # a string where an integer belongs
    with pytest.raises(AssertionError, match="containerPort|3000"):
        validate(bad_port)
    unknown_field = copy.deepcopy(deployment())
    unknown_field["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(AssertionError, match="terminationGracePeriod"):
        validate(unknown_field)
    typo = copy.deepcopy(scaled_object())
    typo["spec"]["minReplicas"] = 2  # KEDA spells it minReplicaCount
    with pytest.raises(AssertionError, match="minReplicas"):
        validate(typo)
    not_a_string = copy.deepcopy(scaled_object())
    not_a_string["spec"]["triggers"][0]["metadata"]["threshold"] = 0.1  # trigger metadata is map[string]string
    with pytest.raises(AssertionError, match="threshold"):
        validate(not_a_string)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_render_to_valid_resources(overlay):
    docs = render(overlay)
    assert sorted(d["kind"] for d in docs) == sorted(
        ["Namespace", "Deployment", "Service", "PodDisruptionBudget", "ScaledObject"])
    for doc in docs:
        validate(doc)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "rampart"
    rendered = one(docs, "Deployment")
    resources = container(rendered)["resources"]
    gpus = resources["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if overlay == "gpu" else None), resources
    Settings.from_env(env(rendered))  # the overlay's settings are valid together
    assert env(rendered)["RAMPART_MAX_DEADLINE_MS"] == env(deployment())["RAMPART_MAX_DEADLINE_MS"]


def test_image_matches_bentofile():
    bentofile = yaml.safe_load((ROOT / "bentofile.yaml").read_text())
    assert container(deployment())["image"] == f"{bentofile['name']}:{bentofile['labels']['version']}"
    assert "$(BENTO_VERSION)" in (ROOT / "Makefile").read_text()  # `make build` tags the bento with it


def test_env_names_are_settings_and_valid():
    settings_env = {ENV_PREFIX + name.upper() for name in FLAT_NAMES}
    for path in [K8S / "base" / "deployment.yaml", *K8S.glob("overlays/*/patch-deployment.yaml")]:
        names = set(env(one(load_all(path), "Deployment")))
        assert names <= settings_env, f"{path.name}: not a setting: {names - settings_env}"
    Settings.from_env(env(deployment()))


def test_grace_period_outlasts_the_longest_deadline():
    spec = deployment()["spec"]["template"]["spec"]
    settings = Settings.from_env(env(deployment()))
    assert settings.deadlines.max_deadline_ms == Settings().deadlines.max_deadline_ms  # the manifests keep the documented default
    pre_stop = container(deployment())["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + settings.deadlines.max_deadline_ms / 1000 + GRACE_MARGIN_S


def test_autoscaling_thresholds_come_from_the_queue_delay():
    queue_delay_s = Settings.from_env(env(deployment())).primary.queue_delay_ms / 1000
    keda = scaled_object()["spec"]
    triggers = {t["name"]: t for t in keda["triggers"]}
    assert {t["type"] for t in triggers.values()} == {"prometheus"}
    wait = triggers["queue-wait"]
    # Scale when the primary's queue is on average half full: wait / queue delay = depth / limit (Little's law).
    assert math.isclose(float(wait["metadata"]["threshold"]), 0.5 * queue_delay_s)
    assert math.isclose(float(wait["metadata"]["activationThreshold"]), 0.25 * queue_delay_s)
    assert all(t["metricType"] == "Value" for t in triggers.values())  # ratios, not per-pod averages

    # The HPA alternative: the same minimum, maximum, behaviour, targets and queries.
    hpa = one(load_all(K8S / "autoscaling" / "hpa" / "horizontalpodautoscaler.yaml"), "HorizontalPodAutoscaler")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (keda["minReplicaCount"], keda["maxReplicaCount"])
    assert hpa["behavior"] == keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert keda["minReplicaCount"] >= 2  # with the PodDisruptionBudget's maxUnavailable 1, one pod always answers
    targets = {m["external"]["metric"]["name"]: m["external"]["target"]["value"] for m in hpa["metrics"]}
    rules = {rule["name"]["as"]: rule["metricsQuery"] for rule in adapter_rules()}
    assert set(targets) == set(rules)

    def quantity(value: str) -> float:
        return float(value[:-1]) / 1000 if value.endswith("m") else float(value)

    def normal(query: str) -> str:  # the KEDA query with the namespace matcher where the adapter puts its own
        return re.sub(r"\s+", " ", query.replace(',<<.LabelMatchers>>', "")).strip()

    for name, trigger in (("rampart_primary_queue_wait_seconds", wait),
                          ("rampart_primary_shed_share", triggers["shed-share"])):
        assert math.isclose(quantity(targets[name]), float(trigger["metadata"]["threshold"])), name
        assert normal(rules[name]) == normal(trigger["metadata"]["query"].replace('namespace="rampart",', "")), name


#: The measured memory of a warm replica (python -m bench.engine_bench, docs/engines.md), which the CPU
#: manifests' memory requests and limits are derived from.
ENGINE_BENCH = ROOT / "docs" / "bench" / "engines.json"
#: Share above the highest measured whole-tree RSS that the memory request keeps (docs/engines.md).
MEMORY_REQUEST_MARGIN = 1.15


def mebibytes(quantity: str) -> float:
    """A Kubernetes memory quantity ("1536Mi", "2Gi") in MiB."""
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi)", quantity).groups()
    return float(number) * units[unit]


def test_cpu_memory_requests_and_limits_come_from_the_measured_replica():
    """Base and CPU overlay: the request covers the highest whole-process-tree RSS measured after warm-up,
    during and after a 5x overload, with the margin; the limit is above the request (no Guaranteed class
    needed: a replica that grows past it is a leak to see, not to hide)."""
    import json

    memory = json.loads(ENGINE_BENCH.read_text())["memory"]
    peak = max(phase["rss_mb"]["total"] for phase in memory.values())
    assert peak <= 1536, memory  # a replica in 1.5 GiB
    for path in (K8S / "base" / "deployment.yaml", K8S / "overlays" / "cpu" / "patch-deployment.yaml"):
        resources = container(one(load_all(path), "Deployment"))["resources"]
        request, limit = mebibytes(resources["requests"]["memory"]), mebibytes(resources["limits"]["memory"])
        assert request >= MEMORY_REQUEST_MARGIN * peak, (path.name, request, peak)
        assert request <= 1536 and limit > request, (path.name, request, limit)
