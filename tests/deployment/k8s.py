"""Offline validation of Kubernetes objects, as strict as an API server's schema checks.

Built-in kinds are validated with ``kubernetes-validate`` against the OpenAPI schemas of the
oldest Kubernetes the chart supports and of the newest the package knows, in strict mode
(an unknown field is an error). The ServiceMonitor and PrometheusRule, CRDs the package has no
schema for, are checked against ``SERVICE_MONITOR_SCHEMA`` and ``PROMETHEUS_RULE_SCHEMA``
below, which cover the fields the chart writes.
``semantic_problems`` adds what the API server checks beyond its schema and the chart relies
on (names resolve, selectors select, lists do not repeat names).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]

from deployment.chart import chart_meta

Obj = dict[str, Any]


def versions() -> tuple[str, str]:
    """(oldest supported by the chart, newest known to kubernetes-validate)."""
    floor = re.search(r"(\d+\.\d+)", str(chart_meta()["kubeVersion"]))
    assert floor is not None
    return f"{floor.group(1)}.0", f"{kubernetes_validate.latest_version()}.0"


# resource.k8s.io/v1, with consumable capacity, is served from Kubernetes 1.34 on.
DRA_OLDEST = "1.34.0"
# Kinds the chart renders only with DRA (the admission policy that holds the plugin to its own
# node's ResourceSlice; served from 1.30): validated from DRA's version too.
DRA_ONLY = {
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"),
}
_STR = {"type": "string"}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "additionalProperties": False,
            "properties": {
                "name": _STR,
                "namespace": _STR,
                "labels": {"type": "object", "additionalProperties": _STR},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": _STR}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array", "items": _STR}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": _STR,
                            "path": _STR,
                            "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                            "scrapeTimeout": {
                                "type": "string",
                                "pattern": r"^(\d+(ms|s|m|h))+$",
                            },
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array", "items": _STR},
                                        "targetLabel": _STR,
                                        "action": _STR,
                                        "regex": _STR,
                                        "replacement": _STR,
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


_DURATION = {"type": "string", "pattern": r"^(\d+(ms|s|m|h|d|w|y))+$"}
_STRING_MAP = {"type": "object", "additionalProperties": _STR}
# The PrometheusRule fields the chart writes (the operator's CRD, monitoring.coreos.com/v1).
PROMETHEUS_RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": SERVICE_MONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": _STR,
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": _STR,
                                        "record": _STR,
                                        "expr": _STR,
                                        "for": _DURATION,
                                        "labels": _STRING_MAP,
                                        "annotations": _STRING_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}
CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "PrometheusRule": PROMETHEUS_RULE_SCHEMA}


def validate(obj: Obj) -> None:
    """Raises (jsonschema.ValidationError or kubernetes_validate's errors) when invalid."""
    crd = CRD_SCHEMAS.get(str(obj.get("kind")))
    if crd is not None:
        jsonschema.Draft7Validator(crd).validate(obj)
        return
    oldest, newest = versions()
    dra = str(obj.get("apiVersion", "")).startswith("resource.k8s.io/")
    dra = dra or (obj.get("apiVersion"), obj.get("kind")) in DRA_ONLY
    if dra or "resourceClaims" in (obj.get("spec") or {}):
        # DRA's objects (docs/dra.md) exist from Kubernetes 1.34 on, whatever the chart's floor.
        oldest = max(oldest, DRA_OLDEST, key=lambda v: tuple(map(int, v.split("."))))
    for version in (oldest, newest):
        kubernetes_validate.validate(obj, version, strict=True)


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _dupes(items: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({i for i in items if i in seen or seen.add(i)})  # type: ignore[func-returns-value]


def semantic_problems(obj: Obj) -> list[str]:
    """What the API server would refuse (or the chart would get wrong) beyond the schema."""
    problems: list[str] = []
    name = obj["metadata"]["name"]
    if not _DNS_SUBDOMAIN.match(name):
        problems.append(f"{obj['kind']} name {name!r} is not a DNS subdomain")
    if obj["kind"] == "Service":
        for port in obj["spec"].get("ports", []):
            if not _DNS_LABEL.match(port["name"]) or len(port["name"]) > 15:
                problems.append(f"service port name {port['name']!r}")
    if obj["kind"] != "DaemonSet":
        return problems
    spec = obj["spec"]
    pod = spec["template"]["spec"]
    selector = spec["selector"]["matchLabels"]
    labels = spec["template"]["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in selector.items()):
        problems.append("the selector does not select the pod template's labels")
    rolling = spec.get("updateStrategy", {}).get("rollingUpdate", {})
    if rolling and not rolling.get("maxUnavailable") and not rolling.get("maxSurge"):
        problems.append("maxUnavailable and maxSurge are both 0")
    volumes = {v["name"] for v in pod.get("volumes", [])}
    problems += [f"volume {d} twice" for d in _dupes(v["name"] for v in pod.get("volumes", []))]
    containers = pod.get("initContainers", []) + pod["containers"]
    problems += [f"container {d} twice" for d in _dupes(c["name"] for c in containers)]
    for c in containers:
        mounts = c.get("volumeMounts", [])
        problems += [
            f"{c['name']}: mount of unknown volume {m['name']}"
            for m in mounts
            if m["name"] not in volumes
        ]
        problems += [
            f"{c['name']}: {d} mounted twice" for d in _dupes(m["mountPath"] for m in mounts)
        ]
        problems += [
            f"{c['name']}: env {d} twice" for d in _dupes(e["name"] for e in c.get("env", []))
        ]
        problems += [
            f"{c['name']}: subPath mount {m['mountPath']} (updates would not propagate)"
            for m in mounts
            if "subPath" in m
        ]
        ports = {p.get("name") for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            if isinstance(port, str) and port not in ports:
                problems.append(f"{c['name']}: {probe} names unknown port {port}")
    return problems
