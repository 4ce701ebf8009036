"""The chart as the tests see it: values merged as Helm merges them, checked against
``values.schema.json``, every template rendered with ``gotemplate`` and parsed into objects.

``render()`` mirrors ``helm template <release> deploy/helm/vgpu-plugin -n <namespace>
[--set ...]``; where a ``helm`` binary is on PATH, ``test_chart.py`` checks that it agrees.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml

from deployment.gotemplate import Template

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "vgpu-plugin"
MANIFESTS = ROOT / "deploy" / "manifests"
RELEASE = "vgpu-plugin"
NAMESPACE = "vgpu-system"

Obj = dict[str, Any]


def load_yaml_file(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def chart_meta() -> dict[str, Any]:
    meta: dict[str, Any] = load_yaml_file(CHART / "Chart.yaml")
    return meta


def default_values() -> dict[str, Any]:
    values: dict[str, Any] = load_yaml_file(CHART / "values.yaml")
    return values


def coalesce(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's merge of user values over the chart's: maps merge key by key, anything else
    (lists included) is replaced, and null deletes the chart's key."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = coalesce(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def validate_values(values: Mapping[str, Any]) -> None:
    """Raises jsonschema.ValidationError as ``helm install`` refuses values."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(values)


def _capitalised(meta: Mapping[str, Any]) -> dict[str, Any]:
    # Helm exposes Chart.yaml's fields under Go names: appVersion -> .Chart.AppVersion.
    return {k[:1].upper() + k[1:]: v for k, v in meta.items()}


@dataclass(frozen=True)
class Rendered:
    files: dict[str, str]  # template path (templates/x.yaml) -> rendered text
    objects: list[Obj]
    notes: str

    def kinds(self) -> list[str]:
        return [o["kind"] for o in self.objects]

    def one(self, kind: str, name: str | None = None) -> Obj:
        found = [
            o
            for o in self.objects
            if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
        ]
        if len(found) != 1:
            raise AssertionError(f"expected one {kind} {name or ''}, found {len(found)}")
        return found[0]

    def maybe(self, kind: str) -> Obj | None:
        found = [o for o in self.objects if o["kind"] == kind]
        return found[0] if found else None


def template_files() -> list[Path]:
    return sorted((CHART / "templates").iterdir())


def render(
    overrides: Mapping[str, Any] | None = None,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    service: str = "Helm",
) -> Rendered:
    values = coalesce(default_values(), overrides or {})
    validate_values(values)
    meta = chart_meta()
    tpl = Template()
    paths = template_files()
    for path in paths:
        tpl.add(f"templates/{path.name}", path.read_text())
    files: dict[str, str] = {}
    notes = ""
    for path in paths:
        name = f"templates/{path.name}"
        if path.name.startswith("_"):
            continue
        data = {
            "Values": values,
            "Release": {
                "Name": release,
                "Namespace": namespace,
                "Service": service,
                "IsInstall": True,
                "IsUpgrade": False,
                "Revision": 1,
            },
            "Chart": _capitalised(meta),
            "Template": {"Name": f"{meta['name']}/{name}", "BasePath": f"{meta['name']}/templates"},
            "Capabilities": {},
        }
        text = tpl.render(name, data)
        if path.name == "NOTES.txt":
            notes = text
        else:
            files[name] = text
    return Rendered(files, list(parse_documents(files.values())), notes)


def parse_documents(texts: Iterable[str]) -> Iterable[Obj]:
    for text in texts:
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            if not isinstance(doc, dict):
                raise AssertionError(f"a manifest document is not a map: {doc!r}")
            yield doc


def manifest_objects(directory: Path = MANIFESTS) -> dict[str, list[Obj]]:
    """The static manifests, by file path relative to ``directory``."""
    out: dict[str, list[Obj]] = {}
    for path in sorted(directory.rglob("*.yaml")):
        out[str(path.relative_to(directory))] = list(parse_documents([path.read_text()]))
    return out


def key(obj: Obj) -> tuple[str, str, str]:
    meta = obj.get("metadata", {})
    return (obj["kind"], meta.get("namespace", ""), meta["name"])


def diff(a: object, b: object, path: str = "") -> list[str]:
    """Every difference between two parsed objects, as 'path: a != b' lines."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b), key=str):
            where = f"{path}.{k}" if path else str(k)
            if k not in a:
                out.append(f"{where}: missing on the left")
            elif k not in b:
                out.append(f"{where}: missing on the right")
            else:
                out += diff(a[k], b[k], where)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items"]
        return [
            line
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for line in diff(x, y, f"{path}[{i}]")
        ]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} != {b!r}"]
