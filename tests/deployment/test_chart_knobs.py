"""The chart's `extraArgs` and `securityContext` values: what they render, that serve takes
what `extraArgs` passes (a flag winning over the chart's environment), and that the schema
refuses what would not work."""

from __future__ import annotations

from typing import Any

import pytest

from deployment import k8s
from deployment.chart import Helm, HelmError, Obj, Rendered, render
from vgpu_plugin.commands.cli import build_parser
from vgpu_plugin.commands.settings import settings_from

RESTRICTED = {
    "privileged": False,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsUser": 0,
    "runAsNonRoot": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def containers(r: Rendered) -> list[Obj]:
    pod = r.one("DaemonSet")["spec"]["template"]["spec"]
    found: list[Obj] = pod.get("initContainers", []) + pod["containers"]
    return found


def plugin(r: Rendered) -> Obj:
    return next(c for c in containers(r) if c["name"] == "vgpu-plugin")


def env_of(c: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def test_extra_args_follow_serve_and_serve_takes_them(helm: Helm) -> None:
    assert plugin(render(helm=helm))["args"] == ["serve"]
    extra = ["--log-level=debug", "--cleanup-grace", "120"]
    r = render({"extraArgs": extra}, helm)
    k8s.validate(r.one("DaemonSet"))
    c = plugin(r)
    assert c["args"] == ["serve", *extra]
    # serve parses them, and a flag given wins over the chart's environment variable.
    args = build_parser().parse_args(c["args"])
    env = env_of(c)
    assert env["VGPU_LOG_LEVEL"] == "info"
    settings = settings_from(args, environ=env)
    assert settings.log_level == "debug"
    assert settings.cleanup_grace == 120
    assert settings.host_root == env["VGPU_HOST_ROOT"]  # the rest still from the chart


@pytest.mark.parametrize("bad", [[1], [""], "--log-level=debug"])
def test_the_schema_refuses_extra_args_that_are_not_a_list_of_arguments(
    bad: Any, helm: Helm
) -> None:
    with pytest.raises(HelmError, match="extraArgs"):
        render({"extraArgs": bad}, helm)


def test_the_security_context_is_restricted_by_default(helm: Helm) -> None:
    for c in containers(render({"nodeLabels": {"fromAPI": True}}, helm)):
        assert c["securityContext"] == RESTRICTED, c["name"]


def test_the_security_context_value_is_merged_over_the_restricted_one(helm: Helm) -> None:
    values = {
        "nodeLabels": {"fromAPI": True},  # every kind of container: init, plugin, sidecar
        "securityContext": {
            "seLinuxOptions": {"type": "spc_t"},
            "seccompProfile": {"type": "Localhost", "localhostProfile": "vgpu.json"},
        },
    }
    r = render(values, helm)
    names = [c["name"] for c in containers(r)]
    assert len(names) >= 3
    for c in containers(r):
        want = {
            **RESTRICTED,
            "seLinuxOptions": {"type": "spc_t"},
            "seccompProfile": {"type": "Localhost", "localhostProfile": "vgpu.json"},
        }
        assert c["securityContext"] == want, c["name"]
    k8s.validate(r.one("DaemonSet"))


def test_the_schema_refuses_a_security_context_that_is_not_a_map(helm: Helm) -> None:
    with pytest.raises(HelmError, match="securityContext"):
        render({"securityContext": "privileged"}, helm)
