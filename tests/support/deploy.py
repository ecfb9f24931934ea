"""The Kubernetes manifests of deploy/k8s as the deploy, plan and server tests read them: the strict validator
(``kubernetes-validate`` for core kinds, ``jsonschema`` against the KEDA ScaledObject schema of
``deploy/k8s/schemas``) and the resources they look into."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import yaml

from tests.support import ROOT


K8S = ROOT / "deploy" / "k8s"


KUBERNETES_VERSION = "1.37.0"


KEDA_SCHEMA = K8S / "schemas" / "keda-scaledobject.schema.yaml"


def load_all(path) -> list[dict]:
    """The YAML documents of ``path`` (empty ones left out)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def strict(schema):
    """``schema`` with ``additionalProperties: false`` wherever it lists properties and does not
    keep unknown fields, as a structural CRD schema is applied by ``kubectl --validate=strict``."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


KEDA_VALIDATOR = jsonschema.Draft7Validator(strict(yaml.safe_load(KEDA_SCHEMA.read_text())))


def validate(doc: dict) -> None:
    """Raise if ``doc`` is not a valid resource: KEDA objects against the ScaledObject schema, the rest strict."""
    if doc["apiVersion"].startswith("keda.sh/"):
        errors = sorted(KEDA_VALIDATOR.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}") from None


def one(docs: list[dict], kind: str) -> dict:
    """The only document of ``kind`` in ``docs`` (fails if there are none or several)."""
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def container(deployment: dict) -> dict:
    """The only container of ``deployment``: Rampart."""
    (rampart,) = deployment["spec"]["template"]["spec"]["containers"]
    return rampart


def deployment() -> dict:
    """The base Deployment (deploy/k8s/base/deployment.yaml)."""
    return one(load_all(K8S / "base" / "deployment.yaml"), "Deployment")


def scaled_object() -> dict:
    """The KEDA ScaledObject (deploy/k8s/autoscaling/keda/scaledobject.yaml)."""
    return one(load_all(K8S / "autoscaling" / "keda" / "scaledobject.yaml"), "ScaledObject")


def adapter_rules() -> list[dict]:
    """The Prometheus adapter's external rules (deploy/k8s/autoscaling/hpa/prometheus-adapter-rules.yaml)."""
    config_map = one(load_all(K8S / "autoscaling" / "hpa" / "prometheus-adapter-rules.yaml"), "ConfigMap")
    return yaml.safe_load(config_map["data"]["config.yaml"])["externalRules"]
