"""Client of the kubelet's pod-resources API (``v1.PodResourcesLister``).

Allocate never learns which pod it serves; the kubelet tells us afterwards, over this API,
which container holds which device ID. That is used for metric labels and for cleanup, never
on the Allocate path (a kubelet that is slow or restarting must not stall admission).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from vgpu_plugin.api.constants import POD_RESOURCES_SOCKET
from vgpu_plugin.api.podresources.v1 import api_pb2 as pb
from vgpu_plugin.api.podresources.v1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.core import defaults
from vgpu_plugin.core.pods import PodRef, PodResourcesUnavailable

DEFAULT_SOCKET = Path(POD_RESOURCES_SOCKET)
DEFAULT_TIMEOUT = 5.0
# The kubelet's own limit for this API is 16 MiB; gRPC's client default (4 MiB) is smaller
# than a busy node's List answer can be.
_MAX_MESSAGE = 16 * 1024 * 1024


def _call(socket: Path | str, timeout: float, method: str, request: Any) -> Any:
    path = Path(socket).absolute()
    if not path.is_socket():
        what = "does not exist" if not path.exists() else "is not a socket"
        raise PodResourcesUnavailable(f"pod-resources socket {path} {what}")
    options = [("grpc.max_receive_message_length", _MAX_MESSAGE)]
    try:
        with grpc.insecure_channel(f"unix://{path}", options=options) as channel:
            stub = pb_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
            return getattr(stub, method)(request, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        name = code.name if code is not None else "error"
        raise PodResourcesUnavailable(
            f"pod-resources {method} on {path} failed: {name}: {detail}"
        ) from exc


def list_assignments(
    socket: Path | str = DEFAULT_SOCKET,
    resource_name: str = defaults.RESOURCE_NAME,
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, PodRef]:
    """Every device ID of ``resource_name`` that a container holds now, and that container.
    Raises PodResourcesUnavailable when the kubelet cannot be asked."""
    response = _call(socket, timeout, "List", pb.ListPodResourcesRequest())
    out: dict[str, PodRef] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = PodRef(pod.namespace, pod.name, container.name)
            for devices in container.devices:
                if devices.resource_name != resource_name:
                    continue
                for device_id in devices.device_ids:
                    out[device_id] = ref
    return out


def allocatable_devices(
    socket: Path | str = DEFAULT_SOCKET,
    resource_name: str = defaults.RESOURCE_NAME,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[str]:
    """The device IDs of ``resource_name`` the kubelet knows on this node (what the plugin
    advertised). Raises PodResourcesUnavailable, also on kubelets without this call."""
    response = _call(socket, timeout, "GetAllocatableResources", pb.AllocatableResourcesRequest())
    return sorted(
        device_id
        for devices in response.devices
        if devices.resource_name == resource_name
        for device_id in devices.device_ids
    )
