"""The Helm chart: valid Kubernetes objects for every option, and a DaemonSet that runs the
plugin with the paths, ports, envs and args the plugin's own defaults expect."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from deployment import helm as helm_cli
from deployment import k8s
from deployment.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    Helm,
    HelmError,
    Obj,
    Rendered,
    diff,
    key,
    render,
)
from vgpu_plugin import __version__
from vgpu_plugin.commands import cli
from vgpu_plugin.commands.settings import FLAGS
from vgpu_plugin.core import dra
from vgpu_plugin.core.allocation import Mount
from vgpu_plugin.core.config import Config, Sharing, load_config
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.core.schema import spec_for
from vgpu_plugin.node.observe.metrics import parse_address
from vgpu_plugin.sim import demo
from vgpu_plugin.sim.runc import ContainerConfig
from vgpu_plugin.sim.toolkit import UNSAFE_DEFAULTS, ToolkitSettings
from vgpu_plugin.sim.toolkit import apply as toolkit_apply

# Envs the DaemonSet may set besides serve's flags: what the NVIDIA container toolkit reads.
NVIDIA_ENVS = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"}
DRA_ELSEWHERE = "dra elsewhere, extended resource, labels from the API"
GIB = 1 << 30

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "labels from the API": {"nodeLabels": {"fromAPI": True}},
    "labels from the API, no sidecar": {"nodeLabels": {"fromAPI": True, "refreshSeconds": 0}},
    "labels from a host file": {"nodeLabels": {"hostFile": "/etc/vgpu/node-labels"}},
    "service monitor": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}
    },
    "no service": {"metrics": {"service": {"enabled": False}}},
    "alerts and dashboard": {
        "metrics": {
            "prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
            "grafanaDashboard": {"enabled": True, "namespace": "monitoring"},
        }
    },
    "elsewhere": {
        "hostRoot": "/var/lib/vgpu",
        "kubeletDir": "/var/lib/k0s/kubelet",
        "lockDir": "/run/vgpulock",
        "stateDir": "/var/lib/vgpu-state",
        "metrics": {"port": 9500},
        "resourceName": "nvidia.com/gpu.shared",
    },
    "pinned image, own account, extras": {
        "image": {"repository": "registry.example/vgpu", "digest": "sha256:" + "ab" * 32},
        "serviceAccount": {"create": False, "name": "gpu-agents"},
        "runtimeClassName": "nvidia",
        "podAnnotations": {"a": "b"},
        "podLabels": {"team": "gpu"},
        "imagePullSecrets": [{"name": "pull"}],
        "affinity": {"nodeAffinity": {}},
        "shim": {"keepVersions": 0},
        "log": {"format": "json", "level": "debug"},
    },
    "dra": {"dra": {"enabled": True}},
    "dra elsewhere, extended resource, labels from the API": {
        "kubeletDir": "/var/lib/k0s/kubelet",
        "nodeLabels": {"fromAPI": True},
        "dra": {
            "enabled": True,
            "driverName": "gpu.example.com",
            "gpus": ["2", "GPU-709f*"],
            "memory": {"default": "5Gi", "minimum": "1Gi", "step": "1Gi"},
            "compute": {"default": 25, "minimum": 5, "step": 5},
            "deviceClass": {"name": "shared-gpu", "extendedResourceName": "example.com/gpu"},
            "claimTemplates": [
                {"name": "whole-default"},
                {"name": "half", "namespace": "ml", "memory": "40Gi", "compute": 50},
            ],
        },
    },
    "nvidia time-slicing config": {
        "config": {
            "version": "v1",
            "sharing": {
                "timeSlicing": {
                    "renameByDefault": True,
                    "resources": [{"name": "nvidia.com/gpu", "replicas": 4}],
                }
            },
        }
    },
}


@pytest.fixture
def defaults(helm: Helm) -> Rendered:
    return render(helm=helm)


def daemonset(r: Rendered) -> Obj:
    return r.one("DaemonSet")


def container(r: Rendered, name: str, init: bool = False) -> Obj:
    pod = daemonset(r)["spec"]["template"]["spec"]
    found = [c for c in pod["initContainers" if init else "containers"] if c["name"] == name]
    assert len(found) == 1, f"container {name}"
    result: Obj = found[0]
    return result


def envs(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def backing(r: Rendered, c: Obj, path: str) -> tuple[Obj, Obj, str]:
    """(volume, mount, path inside the volume) of the mount that holds ``path`` in ``c``."""
    mounts = [
        m
        for m in c["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"{c['name']}: nothing mounted at {path}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = daemonset(r)["spec"]["template"]["spec"]["volumes"]
    volume = next(v for v in volumes if v["name"] == mount["name"])
    return volume, mount, posixpath.relpath(path, mount["mountPath"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_renders_valid_kubernetes_objects(variant: str, helm: Helm) -> None:
    rendered = render(VARIANTS[variant], helm)
    assert rendered.objects
    for obj in rendered.objects:
        k8s.validate(obj)
        assert k8s.semantic_problems(obj) == [], obj["kind"]
        # Examples may go where the pods are; the dashboard where Grafana's sidecar looks.
        if obj["kind"] != "ResourceClaimTemplate" and not obj["metadata"]["name"].endswith(
            "-dashboard"
        ):
            assert obj["metadata"].get("namespace", NAMESPACE) == NAMESPACE


def test_validation_catches_a_broken_object(defaults: Rendered) -> None:
    # The check above is only worth something if it fails on an unknown field.
    ds = yaml.safe_load(yaml.safe_dump(daemonset(defaults)))
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError, match="volumeMount"):
        k8s.validate(ds)
    ds = yaml.safe_load(yaml.safe_dump(daemonset(defaults)))
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["name"] = "nope"
    assert k8s.semantic_problems(ds)


def test_defaults_create_no_rbac_and_no_monitor(defaults: Rendered) -> None:
    assert sorted(defaults.kinds()) == ["ConfigMap", "DaemonSet", "Service", "ServiceAccount"]
    pod = daemonset(defaults)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert defaults.one("ServiceAccount")["automountServiceAccountToken"] is False


def test_the_plugin_gets_every_serve_flag_by_its_env_with_the_plugins_defaults(
    defaults: Rendered,
) -> None:
    env = envs(container(defaults, "vgpu-plugin"))
    flag_envs = {f.env for f in FLAGS}
    assert set(env) - flag_envs == set(NVIDIA_ENVS)
    assert {k: env[k] for k in NVIDIA_ENVS} == NVIDIA_ENVS
    for f in FLAGS:
        if f.env == "NODE_NAME":
            assert env[f.env] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        elif f.env == "VGPU_NODE_LABELS_FILE":
            assert f.env not in env  # no labels source by default
        elif f.env == "VGPU_HOST_ROOT":
            assert env[f.env] == Config().host_root == spec_for("hostRoot").default  # type: ignore[union-attr]
        else:
            assert env[f.env] == f.default, f.env
    assert env["VGPU_HOST_ROOT"] == "/usr/local/vgpu"
    assert env["VGPU_LOCK_DIR"] == "/tmp/vgpulock"
    assert env["VGPU_DEVICE_PLUGIN_DIR"] == "/var/lib/kubelet/device-plugins"
    assert env["VGPU_POD_RESOURCES_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert env["VGPU_METRICS_ADDRESS"] == ":9400"


@pytest.mark.parametrize("variant", ["defaults", "elsewhere"])
def test_every_path_the_plugin_uses_is_the_right_host_mount(variant: str, helm: Helm) -> None:
    r = render(VARIANTS[variant], helm)
    values = {"hostRoot": "/usr/local/vgpu", "kubeletDir": "/var/lib/kubelet"}
    values |= {k: v for k, v in VARIANTS[variant].items() if isinstance(v, str)}
    c = container(r, "vgpu-plugin")
    env = envs(c)

    def host(path: str, read_only: bool = False) -> tuple[str, str]:
        volume, mount, inner = backing(r, c, path)
        assert "hostPath" in volume, f"{path} is not on the host"
        assert bool(mount.get("readOnly")) == read_only, path
        assert "subPath" not in mount
        return posixpath.normpath(posixpath.join(volume["hostPath"]["path"], inner)), volume[
            "hostPath"
        ]["type"]

    kubelet = values["kubeletDir"]
    assert host(env["VGPU_DEVICE_PLUGIN_DIR"]) == (f"{kubelet}/device-plugins", "Directory")
    socket = env["VGPU_POD_RESOURCES_SOCKET"]
    assert host(socket, read_only=True)[0] == f"{kubelet}/pod-resources/kubelet.sock"
    # Paths the plugin hands to the kubelet are host paths: the same inside and outside.
    for name in ("VGPU_HOST_ROOT", "VGPU_LOCK_DIR"):
        assert host(env[name]) == (env[name], "DirectoryOrCreate"), name
    assert env["VGPU_HOST_ROOT"] == values["hostRoot"]
    assert host(env["VGPU_STATE_DIR"])[1] == "DirectoryOrCreate"  # records outlive the pod
    volume, mount, inner = backing(r, c, env["VGPU_CONFIG"])
    assert "configMap" in volume and "subPath" not in mount and mount["readOnly"] is True
    cm = r.one("ConfigMap", volume["configMap"]["name"])
    assert inner in cm["data"]


def test_metrics_port_service_and_address_agree(helm: Helm) -> None:
    for variant in ("defaults", "elsewhere"):
        r = render(VARIANTS[variant], helm)
        c = container(r, "vgpu-plugin")
        port = parse_address(envs(c)["VGPU_METRICS_ADDRESS"])[1]
        assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
        service = r.one("Service")["spec"]
        assert service["clusterIP"] == "None"
        assert service["ports"][0]["port"] == port
        assert service["ports"][0]["targetPort"] == "metrics"
        assert service["selector"] == daemonset(r)["spec"]["selector"]["matchLabels"]
    assert parse_address(
        envs(container(render(helm=helm), "vgpu-plugin"))["VGPU_METRICS_ADDRESS"]
    ) == (
        "0.0.0.0",
        9400,
    )


def test_commands_are_the_clis(defaults: Rendered, helm: Helm) -> None:
    parser = cli.build_parser()
    main = container(defaults, "vgpu-plugin")
    init = container(defaults, "install-shim", init=True)
    assert main["command"] == init["command"] == ["vgpu-plugin"]
    assert parser.parse_args(main["args"]).command == "serve"
    args = parser.parse_args(init["args"])
    assert (args.command, args.keep) == ("install-shim", 3)
    # install-shim puts the shim where serve and Allocate look for it.
    assert envs(init)["VGPU_HOST_ROOT"] == envs(main)["VGPU_HOST_ROOT"]
    assert backing(defaults, init, envs(init)["VGPU_HOST_ROOT"])[0]["name"] == "host-root"
    state = backing(defaults, init, envs(init)["VGPU_STATE_DIR"])
    assert state[0]["name"] == "state" and state[1]["readOnly"] is True
    keep_all = render({"shim": {"keepVersions": 0}}, helm)
    assert container(keep_all, "install-shim", init=True)["args"] == ["install-shim"]


def test_nothing_runs_more_privileged_than_it_needs(helm: Helm) -> None:
    for overrides in VARIANTS.values():
        r = render(overrides, helm)
        pod = daemonset(r)["spec"]["template"]["spec"]
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
        host_paths = {v["name"] for v in pod["volumes"] if "hostPath" in v}
        assert host_paths <= {
            "device-plugins",
            "pod-resources",
            "host-root",
            "state",
            "lock-dir",
            "cdi-spec-dir",  # the allocations' CDI specs (docs/security.md)
            "host-node-labels",
            "plugins-registry",  # DRA only: the kubelet's plugin registration dir
            "plugins",  # DRA only: the driver's service socket
            "nvidia-devices-all",  # /dev/null, read-only: names the GPUs to the toolkit
        }
        devices = next(v for v in pod["volumes"] if v["name"] == "nvidia-devices-all")
        assert devices["hostPath"] == {"path": "/dev/null", "type": "CharDevice"}


def test_the_nodes_pids_only_where_asked(helm: Helm) -> None:
    """hostPID (the GPU-time measure of guaranteed containers needs the node's pids) is an
    opt-in; it adds nothing else: same containers, same security contexts."""
    plain = daemonset(render({}, helm))["spec"]["template"]["spec"]
    pids = daemonset(render({"hostPID": True}, helm))["spec"]["template"]["spec"]
    assert "hostPID" not in plain and pids.pop("hostPID") is True
    assert pids == plain


@pytest.mark.parametrize(
    "settings",
    [ToolkitSettings(), UNSAFE_DEFAULTS, ToolkitSettings(accept_volume_mounts=False)],
    ids=["safe", "toolkit defaults", "envvar only, not accepted"],
)
def test_the_plugin_sees_every_gpu_whatever_the_toolkits_settings(
    defaults: Rendered, settings: ToolkitSettings
) -> None:
    """NVML needs the node's GPUs in the plugin's own (unprivileged) container: the toolkit
    decides them from its env or its mounts, as sim/toolkit.py plays it."""
    pod = daemonset(defaults)["spec"]["template"]["spec"]
    c = container(defaults, "vgpu-plugin")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [
        Mount(m["mountPath"], volumes[m["name"]]["hostPath"]["path"], bool(m.get("readOnly")))
        for m in c["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    ]
    config = ContainerConfig("vgpu-plugin", c["args"], envs(c), mounts)
    gpus = ["GPU-a", "GPU-b"]
    decided = toolkit_apply(config, settings, gpus).envs["NVIDIA_VISIBLE_DEVICES"]
    if settings.accept_volume_mounts or settings.accept_envvar_when_unprivileged:
        assert decided == "GPU-a,GPU-b"
    else:  # nothing names a GPU to such a toolkit but privilege, which the plugin does not get
        assert decided == "void"


def test_scheduling_and_rollout(defaults: Rendered) -> None:
    ds = daemonset(defaults)
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    probe = container(defaults, "vgpu-plugin")["readinessProbe"]
    assert probe["httpGet"] == {"path": "/readyz", "port": "metrics"}
    live = container(defaults, "vgpu-plugin")["livenessProbe"]
    assert live["httpGet"] == {"path": "/healthz", "port": "metrics"}


@pytest.mark.parametrize(
    "variant", ["defaults", "elsewhere", "nvidia time-slicing config", "dra", DRA_ELSEWHERE]
)
def test_the_configmap_passes_check_config(variant: str, tmp_path: Path, helm: Helm) -> None:
    r = render(VARIANTS[variant], helm)
    text = r.one("ConfigMap")["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert cli.main(["check-config", str(path), "--no-nvml"]) == 0
    config = load_config(path)
    dra_values = VARIANTS[variant].get("dra", {})
    assert config.dra.enabled is bool(dra_values)
    if dra_values:
        assert config.dra.driver_name == dra_values.get("driverName", "gpu.vgpu-plugin.io")
        assert config.dra.gpus == tuple(dra_values.get("gpus", ["all"]))
    if variant == DRA_ELSEWHERE:
        assert config.dra.memory == (5 * GIB, GIB, GIB) and config.dra.compute == (25, 5, 5)
    if variant == "nvidia time-slicing config":
        assert (config.resource_name, config.sharing.split_count) == ("nvidia.com/gpu.shared", 4)
    else:
        assert config.resource_name == VARIANTS[variant].get("resourceName", "nvidia.com/gpu")
        assert config.sharing == Sharing()  # the plugin's own defaults


# Values helm must refuse (its schema check or a template's fail), with a word of the message
# that names what is wrong.
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"config": {"version": "v1", "resourceName": "x.com/y"}}, "config.resourceName"),
    ({"config": {"version": "v1", "hostRoot": "/x"}}, "config.hostRoot"),  # env would win
    ({"nodeLabels": {"fromAPI": True, "hostFile": "/etc/labels"}}, "fromAPI or hostFile"),
    (
        {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
        "metrics.service.enabled",
    ),
    ({"metrics": {"port": "9400"}}, "port"),
    ({"log": {"level": "verbose"}}, "level"),
    ({"hostRoot": "relative/path"}, "hostRoot"),
    ({"hostRoot": "/usr//local"}, "hostRoot"),
    ({"unknownTopLevelKey": 1}, "unknownTopLevelKey"),
    ({"config": {"version": "v1", "dra": {"enabled": True}}}, "config.dra"),  # chart's dra
    ({"dra": {"enabled": True, "driverName": "Not_A_Name"}}, "driverName"),
    ({"dra": {"enabled": True, "driverName": "nodomain"}}, "driverName"),  # the plugin's rule
    ({"dra": {"enabled": True, "claimTemplates": [{"name": "x", "compute": 0}]}}, "compute"),
    (
        {"dra": {"enabled": True, "deviceClass": {"name": "c", "extendedResourceName": "gpu"}}},
        "extendedResourceName",
    ),
    ({"dra": {"enabled": True, "memory": {"minimum": "1G"}}}, "minimum"),  # plugin reads Gi
    ({"dra": {"enabled": True, "gpus": [True]}}, "gpus"),
    ({"dra": {"enabled": True, "gpus": []}}, "gpus"),
    ({"dra": {"enabled": True, "computeLimit": 0}}, "computeLimit"),
    ({"dra": {"enabled": True, "computeLimit": 101}}, "computeLimit"),
    ({"dra": {"enabled": True, "computeLimit": "80%"}}, "computeLimit"),
    # The plugin's config is checked at install, not by a crash-looping pod.
    ({"config": {"version": "v1", "sharing": {"splitCount": 0}}}, "splitCount"),
    ({"config": {"version": "v1", "sharing": {"splitCount": -1}}}, "splitCount"),
    ({"config": {"version": "v1", "sharing": {"splitCount": 257}}}, "splitCount"),
    ({"config": {"version": "v1", "sharing": {"memoryScaling": 0}}}, "memoryScaling"),
    ({"config": {"version": "v1", "sharing": {"compute": "half"}}}, "compute"),
    ({"config": {"version": "v1", "sharing": {"splitCont": 4}}}, "splitCont"),
    ({"config": {"version": "v2"}}, "version"),
    ({"config": {"version": None}}, "version"),  # null deletes the chart's key
    (
        {"config": {"version": "v1", "overrides": [{"match": {"gpuModels": ["*A100*"]}}]}},
        "sharing",
    ),
    ({"config": {"version": "v1", "deviceListStrategy": "envvar,volume-mounts"}}, "deviceList"),
]


@pytest.mark.parametrize(
    ("overrides", "word"),
    REFUSED,
    ids=[yaml.safe_dump(o, default_flow_style=True).strip() for o, _ in REFUSED],
)
def test_the_chart_refuses_what_would_silently_misbehave(
    overrides: dict[str, Any], word: str, helm: Helm, tmp_path: Path
) -> None:
    with pytest.raises(HelmError, match=word):
        render(overrides, helm)
    # Where the plugin's own check sees the same config, it refuses it too: the chart's
    # schema is never stricter or looser than the plugin on these.
    config = overrides.get("config")
    if config is not None and not {"resourceName", "hostRoot", "dra"} & set(config):
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        assert cli.main(["check-config", str(path), "--no-nvml"]) != 0


def test_the_refusals_are_of_the_value_not_of_the_chart(helm: Helm) -> None:
    # Each refused value differs from one the chart takes in that value only.
    for accepted in (
        {"config": {"version": "v1", "sharing": {"splitCount": 1}}},
        {"config": {"version": "v1", "sharing": {"splitCount": 256, "compute": "30%"}}},
        {"config": {"version": "v1", "deviceListStrategy": "cdi-cri, volume-mounts"}},
        {"hostRoot": "/var/lib/vgpu"},
        {"dra": {"enabled": True, "memory": {"minimum": "1Gi"}, "gpus": [2, "GPU-a*"]}},
        {"dra": {"enabled": True, "driverName": "gpu.example.com"}},
        {"dra": {"enabled": True, "computeLimit": 100}},
    ):
        assert render(accepted, helm).one("ConfigMap")


@pytest.mark.parametrize(
    ("values", "sets", "want"),
    [
        ({"dra": {"enabled": True, "computeLimit": 80}}, (), 80),
        (None, ("dra.enabled=true", "dra.computeLimit=1"), 1),
        ({"dra": {"enabled": True}}, (), None),
    ],
    ids=["values", "set", "unset"],
)
def test_dra_compute_limit_reaches_the_plugins_config(
    values: dict[str, Any] | None,
    sets: tuple[str, ...],
    want: int | None,
    helm: Helm,
    tmp_path: Path,
) -> None:
    """dra.computeLimit set: claims' compute is a guarantee capped there (docs/compute.md);
    unset: the key is left out, and a claim's compute stays its cap."""
    text = render(values, helm, sets=sets).one("ConfigMap")["data"]["config.yaml"]
    assert ("computeLimit" in yaml.safe_load(text)["dra"]) is (want is not None)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert cli.main(["check-config", str(path), "--no-nvml"]) == 0
    assert load_config(path).dra.compute_limit == want


def test_dra_needs_kubernetes_1_34(helm: Helm) -> None:
    with pytest.raises(HelmError, match=r"Kubernetes 1\.34 or later.*v1\.33\.0"):
        render({"dra": {"enabled": True}}, helm, kube_version="1.33.0")
    # Without DRA the chart installs where the device plugin does; with it from 1.34 on.
    assert "DeviceClass" not in render(None, helm, kube_version="1.33.0").kinds()
    assert "DeviceClass" in render({"dra": {"enabled": True}}, helm, kube_version="1.34.0").kinds()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_passes(variant: str, helm: Helm) -> None:
    out = helm_cli.lint(helm, yaml.safe_dump(VARIANTS[variant]))
    assert "0 chart(s) failed" in out


def test_helm_lint_fails_on_a_refused_value(helm: Helm) -> None:
    with pytest.raises(HelmError, match="splitCount"):
        helm_cli.lint(
            helm, yaml.safe_dump({"config": {"version": "v1", "sharing": {"splitCount": 0}}})
        )


@pytest.mark.parametrize(
    "sets",
    [("dra.enabled=true", "dra.gpus={2,3}"), ("dra.enabled=true", "dra.gpus={0,GPU-709f*}")],
    ids=["numbers", "number and glob"],
)
def test_set_gpus_as_the_docs_write_it(sets: tuple[str, ...], helm: Helm, tmp_path: Path) -> None:
    """--set 'dra.gpus={2,3}' gives helm numbers: the schema takes them and the config lists
    them as the strings the plugin reads."""
    r = render(None, helm, sets=sets)
    text = r.one("ConfigMap")["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert cli.main(["check-config", str(path), "--no-nvml"]) == 0
    want = tuple(sets[1].split("=", 1)[1].strip("{}").split(","))
    assert load_config(path).dra.gpus == want


def test_notes_tell_what_was_installed() -> None:
    # helm 4 only: helm 3.17's install --dry-run=client still asks an API server its version.
    helm4 = helm_cli.find(4)
    if helm4 is None:
        pytest.skip(helm_cli.missing_reason(4))
    for overrides in VARIANTS.values():
        text = helm_cli.notes(
            helm4, yaml.safe_dump(overrides), release=RELEASE, namespace=NAMESPACE
        )
        assert f"{NAMESPACE}/{RELEASE}" in text
        sharing = overrides.get("config", {}).get("sharing", {})
        if "timeSlicing" in sharing:  # the split is NVIDIA's replicas, not splitCount's default
            assert "timeSlicing" in text and "slices of" not in text
        else:
            split = sharing.get("splitCount", 10)
            resource = overrides.get("resourceName", "nvidia.com/gpu")
            assert f"advertised as {split} slices of {resource} " in text


def test_node_labels_from_the_api_reach_the_plugin_and_only_the_helpers_get_a_token(
    helm: Helm,
) -> None:
    r = render(VARIANTS["labels from the API"], helm)
    role = r.one("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    binding = r.one("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "vgpu-plugin", "namespace": NAMESPACE}
    ]
    plugin = container(r, "vgpu-plugin")
    labels_file = envs(plugin)["VGPU_NODE_LABELS_FILE"]
    volume, mount, _ = backing(r, plugin, labels_file)
    assert "emptyDir" in volume and mount["readOnly"] is True
    init = container(r, "node-labels", init=True)
    sidecar = container(r, "node-labels-refresh")
    for helper in (init, sidecar):
        assert helper["command"] == ["vgpu-node-labels"]
        assert helper["args"][helper["args"].index("--output") + 1] == labels_file
        assert backing(r, helper, labels_file)[0]["name"] == volume["name"]
        assert envs(helper)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        token = backing(r, helper, "/var/run/secrets/kubernetes.io/serviceaccount/token")[0]
        assert token["name"] == "api-token"
    assert "--interval" in sidecar["args"] and "--interval" not in init["args"]
    assert all(m["name"] != "api-token" for m in plugin["volumeMounts"])
    pod = daemonset(r)["spec"]["template"]["spec"]
    init_names = [c["name"] for c in pod["initContainers"]]
    assert init_names == ["install-shim", "node-labels"]  # the file exists before serve starts
    once = render(VARIANTS["labels from the API, no sidecar"], helm)
    assert [c["name"] for c in daemonset(once)["spec"]["template"]["spec"]["containers"]] == [
        "vgpu-plugin"
    ]


def test_node_labels_from_a_host_file_mount_its_directory(helm: Helm) -> None:
    r = render(VARIANTS["labels from a host file"], helm)
    plugin = container(r, "vgpu-plugin")
    labels_file = envs(plugin)["VGPU_NODE_LABELS_FILE"]
    volume, mount, inner = backing(r, plugin, labels_file)
    # The directory, not the file: a replaced file (rename) is then seen by the plugin.
    assert volume["hostPath"] == {"path": "/etc/vgpu", "type": "Directory"}
    assert inner == "node-labels" and mount["readOnly"] is True
    assert r.maybe("ClusterRole") is None


def test_chart_version_follows_the_plugin(defaults: Rendered, helm: Helm) -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["appVersion"] == __version__
    assert container(defaults, "vgpu-plugin")["image"] == f"vgpu-plugin:{__version__}"
    pinned = render(VARIANTS["pinned image, own account, extras"], helm)
    assert container(pinned, "vgpu-plugin")["image"] == "registry.example/vgpu@sha256:" + "ab" * 32
    assert daemonset(pinned)["spec"]["template"]["spec"]["serviceAccountName"] == "gpu-agents"
    assert pinned.maybe("ServiceAccount") is None


def test_helm_4_and_helm_3_render_the_same_objects() -> None:
    found = [helm_cli.find(m) for m in helm_cli.MAJORS]
    if None in found:
        pytest.skip(" and ".join(helm_cli.missing_reason(m) for m in helm_cli.MAJORS))
    h4, h3 = found
    assert h4 is not None and h3 is not None
    for overrides in VARIANTS.values():
        theirs = sorted(render(overrides, h3).objects, key=key)
        ours = sorted(render(overrides, h4).objects, key=key)
        assert [key(o) for o in theirs] == [key(o) for o in ours]
        assert [diff(a, b) for a, b in zip(theirs, ours, strict=True)] == [[] for _ in ours]


DRA_KINDS = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceClass",
    "ResourceClaimTemplate",
}


def test_dra_is_off_by_default_and_adds_nothing(defaults: Rendered) -> None:
    assert not DRA_KINDS & set(defaults.kinds())
    plugin = container(defaults, "vgpu-plugin")
    assert not {"VGPU_DRA_REGISTRY_DIR", "VGPU_DRA_PLUGINS_DIR"} & set(envs(plugin))
    assert all(m["name"] != "api-token" for m in plugin["volumeMounts"])
    assert "dra" not in yaml.safe_load(defaults.one("ConfigMap")["data"]["config.yaml"])


@pytest.mark.parametrize("variant", ["dra", DRA_ELSEWHERE])
def test_dra_sockets_are_the_kubelets_plugin_dirs_at_their_host_paths(
    variant: str, helm: Helm
) -> None:
    r = render(VARIANTS[variant], helm)
    kubelet = VARIANTS[variant].get("kubeletDir", "/var/lib/kubelet")
    plugin = container(r, "vgpu-plugin")
    env = envs(plugin)
    # The kubelet dials the service socket at the path the driver announces: a host path.
    for name, sub, kind in (
        ("VGPU_DRA_REGISTRY_DIR", "plugins_registry", "Directory"),
        ("VGPU_DRA_PLUGINS_DIR", "plugins", "DirectoryOrCreate"),
    ):
        assert env[name] == f"{kubelet}/{sub}"
        volume, mount, inner = backing(r, plugin, env[name])
        assert volume["hostPath"] == {"path": env[name], "type": kind} and inner == "."
        assert not mount.get("readOnly")
    # The driver's API access: the pod's projected token, where the kubernetes client looks.
    token = backing(r, plugin, "/var/run/secrets/kubernetes.io/serviceaccount/token")
    assert token[0]["name"] == "api-token" and token[1]["readOnly"] is True
    assert daemonset(r)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("variant", ["dra", DRA_ELSEWHERE])
def test_dra_rbac_is_exactly_what_the_driver_calls(variant: str, helm: Helm) -> None:
    r = render(VARIANTS[variant], helm)
    role = r.one("ClusterRole", "vgpu-plugin-dra")
    # node/serving/kubeapi.py: GET a claim; GET, POST, PUT, DELETE its node's slice; GET its node
    # (the UID for the slice's ownerReference); no list, no watch.
    assert role["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["get", "create", "update", "delete"],
        },
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    ]
    binding = r.one("ClusterRoleBinding", "vgpu-plugin-dra")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = daemonset(r)["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    # What RBAC cannot say: only the slice of the plugin pod's own node, of its own driver.
    policy = r.one("ValidatingAdmissionPolicy")
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (condition,) = spec["matchConditions"]
    assert f"'system:serviceaccount:{NAMESPACE}:{account}'" in condition["expression"]
    checks = " ".join(v["expression"] for v in spec["validations"])
    assert "authentication.kubernetes.io/node-name" in " ".join(
        v["expression"] for v in spec["variables"]
    )
    assert "variables.slice.spec.nodeName == variables.node" in checks
    driver = VARIANTS[variant]["dra"].get("driverName", dra.DRIVER_NAME)
    assert f"variables.slice.spec.driver == '{driver}'" in checks
    bound = r.one("ValidatingAdmissionPolicyBinding")["spec"]
    assert bound == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


@pytest.mark.parametrize("variant", ["dra", DRA_ELSEWHERE])
def test_the_device_class_selects_the_slice_the_driver_publishes(
    variant: str, tmp_path: Path, helm: Helm
) -> None:
    r = render(VARIANTS[variant], helm)
    values = VARIANTS[variant]["dra"]
    (cls,) = [o for o in r.objects if o["kind"] == "DeviceClass"]
    (selector,) = cls["spec"]["selectors"]
    path = tmp_path / "config.yaml"
    path.write_text(r.one("ConfigMap")["data"]["config.yaml"])
    config = load_config(path)
    gpu = PhysicalGpu(0, "GPU-709f0000-0000-0000-0000-000000000000", "A100", 80 * GIB, 0, "", 0)
    published = dra.resource_slice(
        "node-1",
        config.dra.driver_name,
        [(gpu, dra.DeviceFacts())],
        generation=1,
        memory=dra.CapacityPolicy(*config.dra.memory),
        compute=dra.CapacityPolicy(*config.dra.compute),
    )
    assert selector == {"cel": {"expression": f'device.driver == "{published["spec"]["driver"]}"'}}
    extended = values.get("deviceClass", {}).get("extendedResourceName")
    assert cls["spec"].get("extendedResourceName") == extended
    templates = [o for o in r.objects if o["kind"] == "ResourceClaimTemplate"]
    wanted = values.get(
        "claimTemplates",
        [
            {"name": "gpu-10gi", "memory": "10Gi"},
            {"name": "gpu-6gi-30", "memory": "6Gi", "compute": 30},
        ],
    )
    assert [t["metadata"]["name"] for t in templates] == [w["name"] for w in wanted]
    for t, w in zip(templates, wanted, strict=True):
        assert t["metadata"]["namespace"] == w.get("namespace", NAMESPACE)
        (request,) = t["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == cls["metadata"]["name"]
        asked = {k: str(w[k]) for k in ("memory", "compute") if k in w}
        assert request["exactly"].get("capacity", {}).get("requests", {}) == asked
        # Each amount is one the slice's request policy takes as it is (no rounding).
        capacity = published["spec"]["devices"][0]["capacity"]
        for name, amount in asked.items():
            valid = capacity[name]["requestPolicy"]["validRange"]
            lo, step = dra.parse_quantity(valid["min"]), dra.parse_quantity(valid["step"])
            assert (dra.parse_quantity(amount) - lo) % step == 0, (t["metadata"]["name"], name)


def test_the_smallest_claim_the_chart_admits_holds_a_cuda_context_and_more(
    helm: Helm, tmp_path: Path
) -> None:
    """A claim no bigger than one CUDA context can never run a kernel; the simulated GPUs
    model a context as CONTEXT_MIB (real ones take a few hundred MiB too)."""
    path = tmp_path / "config.yaml"
    path.write_text(render(VARIANTS["dra"], helm).one("ConfigMap")["data"]["config.yaml"])
    default, minimum, _ = load_config(path).dra.memory
    assert minimum > demo.CONTEXT_MIB << 20
    assert default >= minimum
