"""The chart as the tests see it: rendered by real helm (``helm template``, helm 4 or 3) and
parsed into objects, by template file.

``render()`` is ``helm template <release> deploy/helm/vgpu-plugin -n <namespace>
--kube-version <v> -f <overrides>``; a refusal (schema or a template's ``fail``) raises
``HelmError`` with helm's message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployment import helm as helm_cli
from deployment.helm import CHART, KUBE_VERSION, ROOT, Helm, HelmError

__all__ = ["CHART", "ROOT", "Helm", "HelmError"]

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


@dataclass(frozen=True)
class Rendered:
    files: dict[str, str]  # template path (templates/x.yaml) -> rendered text
    objects: list[Obj]

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


def helms() -> list[Any]:
    """pytest params of every helm major, each skipped (saying why) where it is missing."""
    out = []
    for major in helm_cli.MAJORS:
        found = helm_cli.find(major)
        marks = [] if found else [pytest.mark.skip(reason=helm_cli.missing_reason(major))]
        out.append(pytest.param(found, id=f"helm{major}", marks=marks))
    return out


def any_helm() -> Helm:
    """The first helm there is (for checks that do not compare majors); skips where none."""
    for major in helm_cli.MAJORS:
        found = helm_cli.find(major)
        if found:
            return found
    pytest.skip(" and ".join(helm_cli.missing_reason(m) for m in helm_cli.MAJORS))


def _yaml(overrides: Mapping[str, Any] | None) -> str:
    return yaml.safe_dump(dict(overrides or {}), sort_keys=True)


@cache
def _render(
    helm: Helm, values: str, release: str, namespace: str, kube_version: str, sets: tuple[str, ...]
) -> Rendered:
    out = helm_cli.template(
        helm,
        values,
        release=release,
        namespace=namespace,
        kube_version=kube_version,
        sets=sets,
    )
    files = helm_cli.split_sources(out)
    return Rendered(files, list(parse_documents(files.values())))


def render(
    overrides: Mapping[str, Any] | None = None,
    helm: Helm | None = None,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    kube_version: str = KUBE_VERSION,
    sets: tuple[str, ...] = (),
) -> Rendered:
    """The chart rendered by ``helm`` (default: the first there is) with ``overrides`` as a
    values file. Callers must not change what it returns (renders are cached)."""
    return _render(
        helm or any_helm(), _yaml(overrides), release, namespace, kube_version, tuple(sets)
    )


def template_files() -> list[Path]:
    return sorted((CHART / "templates").iterdir())


def parse_documents(texts: Iterable[str]) -> Iterable[Obj]:
    for text in texts:
        yield from helm_cli.documents(text)


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
