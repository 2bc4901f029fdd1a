"""Validates the Prometheus Operator resources (PodMonitor, ServiceMonitor) in Kubernetes
manifests against the operator's API types.

kubernetes-validate knows the built-in kinds only. The operator's types come from the
cloudcoil-models-prometheus-operator package (pydantic models generated from the operator's
CRDs); their JSON schema is made strict here (no unknown fields, as `kubectl --validate=strict`
would refuse them) and each resource is checked against it. Other kinds are left to
kubernetes-validate. Exit status 1 when any resource fails.
"""

import sys

import jsonschema
import yaml
from cloudcoil.models.prometheus_operator import v1

KINDS = {"PodMonitor": v1.PodMonitor, "ServiceMonitor": v1.ServiceMonitor}
API_VERSION = "monitoring.coreos.com/v1"


def strict(node):
    """Forbids properties a schema object does not declare, all the way down."""
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            node.setdefault("additionalProperties", False)
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)
    return node


def main(paths):
    failures = 0
    checked = 0
    for path in paths:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for doc in docs:
            model = KINDS.get(doc.get("kind"))
            if model is None:
                continue
            name = f"{path}: {doc['kind']}/{doc.get('metadata', {}).get('name')}"
            if doc.get("apiVersion") != API_VERSION:
                print(f"FAIL {name}: apiVersion must be {API_VERSION}")
                failures += 1
                continue
            schema = strict(model.model_json_schema(by_alias=True))
            errors = list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
            for error in errors:
                where = "/".join(str(p) for p in error.absolute_path) or "(root)"
                print(f"FAIL {name} at {where}: {error.message}")
            failures += bool(errors)
            checked += 1
            if not errors:
                print(f"ok   {name}")
    if checked == 0:
        print("no PodMonitor or ServiceMonitor found")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
