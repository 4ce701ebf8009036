"""What the gRPC edge needs from the rest of the plugin: the ``Backend`` protocol.

The server (``server.py``) owns sockets, registration and kubelet restarts; a Backend owns
what is advertised and allocated. Backends report refusals as ``BackendError``, which the
servicer turns into the gRPC status the kubelet sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from vgpu_plugin.api.constants import MAX_MESSAGE_BYTES
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb


class BackendError(Exception):
    """A refusal with the gRPC status code the kubelet should see, e.g. INVALID_ARGUMENT."""

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code: Any = code  # a grpc.StatusCode (grpc ships no type information)
        self.message = message

    @classmethod
    def invalid(cls, message: str) -> BackendError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def internal(cls, message: str) -> BackendError:
        return cls(grpc.StatusCode.INTERNAL, message)


class Backend(Protocol):
    """The plugin's domain as the gRPC edge sees it. Methods may be called from any thread."""

    def options(self) -> pb.DevicePluginOptions:
        """Sent both in RegisterRequest.options and from GetDevicePluginOptions."""
        ...

    def devices(self) -> list[pb.Device]:
        """The complete device list to advertise now (unhealthy devices included)."""
        ...

    def wait_for_change(self, timeout: float) -> bool:
        """Blocks until the device list may have changed since the previous call returned
        True, or ``timeout`` seconds pass; returns whether it changed. Only the server's one
        watcher thread calls it."""
        ...

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse: ...

    def preferred_allocation(
        self, request: pb.PreferredAllocationRequest
    ) -> pb.PreferredAllocationResponse: ...

    def pre_start_container(
        self, request: pb.PreStartContainerRequest
    ) -> pb.PreStartContainerResponse: ...


def default_options() -> pb.DevicePluginOptions:
    """What this plugin supports: preferred allocation yes, a PreStartContainer call no."""
    return pb.DevicePluginOptions(get_preferred_allocation_available=True, pre_start_required=False)


class ListTooLargeError(ValueError):
    """The ListAndWatch message would exceed the kubelet's 4 MiB gRPC receive limit."""

    def __init__(self, count: int, size: int, limit: int) -> None:
        super().__init__(
            f"the device list ({count} devices) serializes to {size} bytes, over the kubelet's "
            f"{limit}-byte gRPC message limit: the kubelet would reject every ListAndWatch "
            f"update. Lower sharing.splitCount (or advertise fewer GPUs) so the list fits."
        )
        self.count = count
        self.size = size
        self.limit = limit


def list_and_watch_size(devices: Sequence[pb.Device]) -> int:
    """Bytes of the ListAndWatch message that would carry ``devices``."""
    return len(pb.ListAndWatchResponse(devices=devices).SerializeToString())


def check_list_size(devices: Sequence[pb.Device], limit: int = MAX_MESSAGE_BYTES) -> int:
    """Returns the message size; raises ListTooLargeError when it does not fit in ``limit``.
    Call it at startup and before applying a config that changes the list."""
    size = list_and_watch_size(devices)
    if size > limit:
        raise ListTooLargeError(len(devices), size, limit)
    return size
