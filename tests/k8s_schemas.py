"""Validating rendered Kubernetes objects against real schemas, unknown fields rejected.

- Core and apps objects (Deployment, Service, ConfigMap, PodDisruptionBudget): the
  OpenAPI-derived JSON schemas that ``kubernetes-validate`` bundles (no network), in their
  ``strict`` form, which rejects any property the API does not define.
- Custom resources (InferencePool, HTTPRoute): the CustomResourceDefinitions in
  ``../shared/schemas`` beside the checkout (copied from gateway-api-inference-extension and
  gateway-api). A CRD's ``openAPIV3Schema`` is structural: the API server prunes (or, with
  ``fieldValidation=Strict``, rejects) every field its skeleton of ``properties`` does not
  name. JSON-schema validators allow unknown properties, so the skeleton gets
  ``additionalProperties: false`` wherever it lists properties and neither allows others nor
  says ``x-kubernetes-preserve-unknown-fields``. ``metadata`` (just ``type: object`` in a CRD)
  is checked against ObjectMeta's strict schema. The CRDs' CEL rules
  (``x-kubernetes-validations``) are not evaluated here; the tests check the ones that
  concern the rendered objects by hand.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO.parent / "shared" / "schemas"
CRD_FILES = {
    "inference.networking.k8s.io": "inference.networking.k8s.io_inferencepools.yaml",
    "gateway.networking.k8s.io": "gateway.networking.k8s.io_httproutes.yaml",
}
# The oldest Kubernetes the manifests are for (the kubelet's preStop sleep action is on by
# default from 1.30), and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())


class SchemaError(AssertionError):
    """An object that its schema refuses, with the path to the offending field."""


def validate_core(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(p) for p in error.path)
        raise SchemaError(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): "
                          f"{path}: {error.message}") from None


def strict_structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a structural schema in which every object node lists all it allows."""
    schema = copy.deepcopy(schema)

    def visit(node: dict[str, Any]) -> None:
        properties = node.get("properties")
        if (properties is not None and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for child in (properties or {}).values():
            visit(child)
        if isinstance(node.get("items"), dict):
            visit(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            visit(node["additionalProperties"])

    visit(schema)
    return schema


@functools.cache
def _crd_schema(group: str, version: str, kind: str) -> dict[str, Any]:
    if group not in CRD_FILES:
        raise SchemaError(f"no CRD known for group {group!r}")
    path = SCHEMAS / CRD_FILES[group]
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the CRD schemas live in ../shared/schemas beside the checkout "
            "(CI lays shared/ there); without them custom resources cannot be validated")
    crd = yaml.safe_load(path.read_text())
    if crd["spec"]["names"]["kind"] != kind:
        raise SchemaError(f"{path.name} defines {crd['spec']['names']['kind']}, not {kind}")
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version and entry.get("served"):
            return strict_structural(entry["schema"]["openAPIV3Schema"])
    raise SchemaError(f"{path.name} serves no version {version!r} of {kind}")


@functools.cache
def _object_meta_schema() -> dict[str, Any]:
    folder = f"v{kubernetes_validate.utils.latest_version()}-local-strict"
    ref = resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/{folder}/objectmeta-meta-v1.json")
    return json.loads(ref.read_text())


def validate_custom(obj: dict[str, Any]) -> None:
    group, _, version = obj["apiVersion"].partition("/")
    schema = _crd_schema(group, version, obj["kind"])
    name = f"{obj['kind']}/{obj.get('metadata', {}).get('name')}"
    for part, part_schema in ((obj, schema), (obj.get("metadata", {}), _object_meta_schema())):
        errors = sorted(jsonschema.Draft202012Validator(part_schema).iter_errors(part),
                        key=lambda e: list(e.path))
        if errors:
            raise SchemaError(f"{name}: " + "; ".join(
                f"{'.'.join(str(p) for p in e.path) or '<root>'}: {e.message}"
                for e in errors[:5]))


def validate_object(obj: dict[str, Any]) -> None:
    """Every rendered object: its kind's schema, strict, on every version in K8S_VERSIONS."""
    group = obj["apiVersion"].rpartition("/")[0]
    if group in CRD_FILES:
        validate_custom(obj)
    else:
        for version in K8S_VERSIONS:
            validate_core(obj, version)
