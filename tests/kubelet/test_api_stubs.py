"""The committed kubelet API modules: generated from our protos, and wire-compatible upstream."""

from __future__ import annotations

import base64
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import unknown_fields

from vgpu_plugin.api import constants, generate
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as dp
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from vgpu_plugin.api.dra.v1 import api_pb2 as dra_v1
from vgpu_plugin.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2 as drahealth
from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2_grpc as drahealth_grpc
from vgpu_plugin.api.podresources.v1 import api_pb2 as pr
from vgpu_plugin.api.podresources.v1 import api_pb2_grpc as pr_grpc

# Upstream's field names and numbers (k8s.io/kubelet deviceplugin/v1beta1, podresources/v1).
DEVICEPLUGIN_FIELDS = {
    "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "Empty": {},
    "ListAndWatchResponse": {"devices": 1},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "Device": {"ID": 1, "health": 2, "topology": 3},
    "PreStartContainerRequest": {"devices_ids": 1},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {"container_requests": 1},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    },
    "PreferredAllocationResponse": {"container_responses": 1},
    "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "AllocateRequest": {"container_requests": 1},
    "ContainerAllocateRequest": {"devices_ids": 1},
    "CDIDevice": {"name": 1},
    "AllocateResponse": {"container_responses": 1},
    "ContainerAllocateResponse": {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    },
    "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
}
PODRESOURCES_FIELDS = {
    "AllocatableResourcesRequest": {},
    "AllocatableResourcesResponse": {"devices": 1, "cpu_ids": 2, "memory": 3},
    "ListPodResourcesRequest": {},
    "ListPodResourcesResponse": {"pod_resources": 1},
    "PodResources": {"name": 1, "namespace": 2, "containers": 3},
    "ContainerResources": {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    },
    "ContainerMemory": {"memory_type": 1, "size": 2, "topology": 3},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "DynamicResource": {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4},
    "ClaimResource": {"cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4},
    "CDIDevice": {"name": 1},
    "GetPodResourcesRequest": {"pod_name": 1, "pod_namespace": 2},
    "GetPodResourcesResponse": {"pod_resources": 1},
}

# k8s.io/kubelet dra/v1 and v1beta1; v1's Device.share_id is upstream's
# `optional string share_id = 5` (checked in the descriptor of its generated api.pb.go).
DRA_FIELDS = {
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "Device": {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4},
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
}
DRA_V1_FIELDS = {**DRA_FIELDS, "Device": {**DRA_FIELDS["Device"], "share_id": 5}}
# k8s.io/kubelet dra-health/v1alpha1, read from the 1.36.2 kubelet's embedded descriptor.
DRAHEALTH_FIELDS = {
    "NodeWatchResourcesRequest": {},
    "DeviceIdentifier": {"pool_name": 1, "device_name": 2},
    "DeviceHealth": {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    },
    "NodeWatchResourcesResponse": {"devices": 1},
}


def test_committed_modules_are_what_the_protos_generate(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="regenerating needs grpcio-tools (a test extra)")
    fresh = generate.generate(tmp_path)
    committed = generate.outputs(generate.SRC_ROOT)
    assert len(fresh) == len(committed) == 3 * len(generate.PROTOS)
    for new, old in zip(fresh, committed, strict=True):
        assert old.read_bytes() == new.read_bytes(), (
            f"{old} is stale: run `python -m vgpu_plugin.api.generate` and commit the result"
        )


@pytest.mark.parametrize(
    ("module", "package", "expected"),
    [
        (dp, "v1beta1", DEVICEPLUGIN_FIELDS),
        (pr, "v1", PODRESOURCES_FIELDS),
        (dra_v1, "k8s.io.kubelet.pkg.apis.dra.v1", DRA_V1_FIELDS),
        (dra_v1beta1, "k8s.io.kubelet.pkg.apis.dra.v1beta1", DRA_FIELDS),
        (drahealth, "v1alpha1", DRAHEALTH_FIELDS),
    ],
)
def test_messages_match_upstream(module: Any, package: str, expected: dict[str, Any]) -> None:
    descriptor = module.DESCRIPTOR
    assert descriptor.package == package
    assert set(descriptor.message_types_by_name) == set(expected)
    for name, fields in expected.items():
        message = descriptor.message_types_by_name[name]
        assert {f.name: f.number for f in message.fields} == fields, name


def test_dra_share_id_is_an_optional_string_as_upstream() -> None:
    field = dra_v1.Device.DESCRIPTOR.fields_by_name["share_id"]
    assert field.type == field.TYPE_STRING and field.has_presence
    assert field.containing_oneof is not None and field.containing_oneof.name == "_share_id"
    # Unset: nothing on the wire (the kubelet reads no share ID); set: field 5, length-delimited.
    assert dra_v1.Device(device_name="d").SerializeToString() == b"\x1a\x01d"
    assert dra_v1.Device(share_id="s").SerializeToString() == b"\x2a\x01s"


def test_dra_health_types_match_upstream() -> None:
    status = drahealth.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in status.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    fields = drahealth.DeviceHealth.DESCRIPTOR.fields_by_name
    assert fields["health"].enum_type is status
    assert fields["device"].message_type is drahealth.DeviceIdentifier.DESCRIPTOR
    assert fields["last_updated_time"].type == fields["last_updated_time"].TYPE_INT64
    assert fields["health_check_timeout_seconds"].type == fields["last_updated_time"].TYPE_INT64
    response = drahealth.NodeWatchResourcesResponse.DESCRIPTOR.fields_by_name["devices"]
    assert response.is_repeated
    assert response.message_type is drahealth.DeviceHealth.DESCRIPTOR


def test_services_match_upstream() -> None:
    def methods(module: Any, service: str) -> dict[str, tuple[str, str, bool]]:
        svc = module.DESCRIPTOR.services_by_name[service]
        return {
            m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in svc.methods
        }

    assert methods(dp, "Registration") == {"Register": ("RegisterRequest", "Empty", False)}
    assert methods(dp, "DevicePlugin") == {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": (
            "PreferredAllocationRequest",
            "PreferredAllocationResponse",
            False,
        ),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }
    assert methods(drahealth, "DRAResourceHealth") == {
        "NodeWatchResources": ("NodeWatchResourcesRequest", "NodeWatchResourcesResponse", True)
    }
    assert methods(pr, "PodResourcesLister") == {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse", False),
        "GetAllocatableResources": (
            "AllocatableResourcesRequest",
            "AllocatableResourcesResponse",
            False,
        ),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse", False),
    }


class _MethodRecorder(grpc.ServerInterceptor):  # type: ignore[misc]
    """Records the method path of every call a real gRPC server receives, then refuses it."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.paths.append(details.method)

        def refuse(request: Any, context: Any) -> Any:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "recorded")

        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture
def recording_channel() -> Iterator[tuple[Any, _MethodRecorder]]:
    directory = tempfile.mkdtemp(prefix="stubs-", dir="/tmp")  # short: unix path limit
    recorder = _MethodRecorder()
    server = grpc.server(ThreadPoolExecutor(2), interceptors=[recorder])
    server.add_insecure_port(f"unix://{directory}/rec.sock")
    server.start()
    channel = grpc.insecure_channel(f"unix://{directory}/rec.sock")
    yield channel, recorder
    channel.close()
    server.stop(0).wait()
    shutil.rmtree(directory, ignore_errors=True)


def _call_all(calls: list[Any]) -> None:
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            result = call()
            if hasattr(result, "__next__"):  # server streaming: pull the first message
                next(result)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_wire_method_names(recording_channel: tuple[Any, _MethodRecorder]) -> None:
    channel, recorder = recording_channel
    registration = dp_grpc.RegistrationStub(channel)
    plugin = dp_grpc.DevicePluginStub(channel)
    lister = pr_grpc.PodResourcesListerStub(channel)
    health = drahealth_grpc.DRAResourceHealthStub(channel)
    _call_all(
        [
            lambda: registration.Register(dp.RegisterRequest(), timeout=5),
            lambda: plugin.GetDevicePluginOptions(dp.Empty(), timeout=5),
            lambda: plugin.ListAndWatch(dp.Empty(), timeout=5),
            lambda: plugin.GetPreferredAllocation(dp.PreferredAllocationRequest(), timeout=5),
            lambda: plugin.Allocate(dp.AllocateRequest(), timeout=5),
            lambda: plugin.PreStartContainer(dp.PreStartContainerRequest(), timeout=5),
            lambda: lister.List(pr.ListPodResourcesRequest(), timeout=5),
            lambda: lister.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5),
            lambda: lister.Get(pr.GetPodResourcesRequest(), timeout=5),
            lambda: health.NodeWatchResources(drahealth.NodeWatchResourcesRequest(), timeout=5),
        ]
    )
    assert recorder.paths == [
        "/v1beta1.Registration/Register",
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
        "/v1.PodResourcesLister/List",
        "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/Get",
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
    ]


def test_constants() -> None:
    assert constants.VERSION == "v1beta1"
    assert constants.KUBELET_SOCKET_NAME == "kubelet.sock"
    assert constants.DEVICE_PLUGIN_PATH == "/var/lib/kubelet/device-plugins"
    assert (constants.HEALTHY, constants.UNHEALTHY) == ("Healthy", "Unhealthy")
    assert constants.MAX_MESSAGE_BYTES == 4 * 1024 * 1024
    assert constants.POD_RESOURCES_SOCKET == "/var/lib/kubelet/pod-resources/kubelet.sock"


def test_allocate_response_round_trips_every_field() -> None:
    response = dp.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": "GPU-a"},
        mounts=[dp.Mount(container_path="/etc/vgpu/limits", host_path="/h/l", read_only=True)],
        devices=[dp.DeviceSpec(container_path="/dev/x", host_path="/dev/x", permissions="rw")],
        annotations={"a": "b"},
        cdi_devices=[dp.CDIDevice(name="vendor.com/gpu=0")],
    )
    again = dp.ContainerAllocateResponse.FromString(response.SerializeToString())
    assert again == response
    assert again.mounts[0].read_only and again.cdi_devices[0].name == "vendor.com/gpu=0"


# ContainerAllocateResponse bytes from a real kubelet's checkpoint (a seed of the project,
# written by the plugin this project descends from): our messages must decode them.
KUBELET_CHECKPOINT_ALLOC_RESP = (
    "CiQKGkNVREFfREVWSUNFX01FTU9SWV9MSU1JVF8wEgYxNjAwMG0KQgoWTlZJRElBX1ZJU0lCTEVfREVWSUNFUxIo"
    "R1BVLWZjZGEwNTZmLTc3YzYtN2ZkZi1mN2M3LTY0NTM1MTFlYWFhMQoZChRDVURBX0RFVklDRV9TTV9MSU1JVBIB"
    "MApXCh9DVURBX0RFVklDRV9NRU1PUllfU0hBUkVEX0NBQ0hFEjQvdG1wL3ZncHUvYzQ1N2Q4ODItMmIxNi00YWQ5"
    "LWE5NjAtYTEzZTZjMDg0YTkyLmNhY2hlChoKEkNVREFfT1ZFUlNVQlNDUklCRRIEdHJ1ZRI6ChovdXNyL2xvY2Fs"
    "L3ZncHUvbGlidmdwdS5zbxIaL3Vzci9sb2NhbC92Z3B1L2xpYnZncHUuc28YARI1ChIvZXRjL2xkLnNvLnByZWxv"
    "YWQSHS91c3IvbG9jYWwvdmdwdS9sZC5zby5wcmVsb2FkGAESXQoJL3RtcC92Z3B1ElAvdXNyL2xvY2FsL3ZncHUv"
    "Y29udGFpbmVycy9hMmFiMWQ2My04NTE5LTRmZjctOTUwMS1lZGM1OGFlMWQ2YTRfdWJ1bnR1LWNvbnRhaW5lchIe"
    "Cg0vdG1wL3ZncHVsb2NrEg0vdG1wL3ZncHVsb2Nr"
)


def test_decodes_a_real_kubelet_checkpointed_response() -> None:
    raw = base64.b64decode(KUBELET_CHECKPOINT_ALLOC_RESP)
    response = dp.ContainerAllocateResponse.FromString(raw)
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-fcda056f-77c6-7fdf-f7c7-6453511eaaa1"
    assert response.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "16000m"
    assert [(m.container_path, m.read_only) for m in response.mounts] == [
        ("/usr/local/vgpu/libvgpu.so", True),
        ("/etc/ld.so.preload", True),
        ("/tmp/vgpu", False),
        ("/tmp/vgpulock", False),
    ]
    # Every field in it is known to our definition.
    assert len(unknown_fields.UnknownFieldSet(response)) == 0
    assert all(len(unknown_fields.UnknownFieldSet(m)) == 0 for m in response.mounts)
