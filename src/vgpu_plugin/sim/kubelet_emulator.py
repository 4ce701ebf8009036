"""A kubelet emulator for tests: the device manager's side of the device plugin protocol.

Behaves as docs/contracts.md#kubelet-facts describes the real kubelet, over unix sockets and gRPC:
- serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock``;
- on ``Register`` checks the version, the resource name and that the endpoint socket exists,
  then calls the plugin's ``GetDevicePluginOptions`` *while Register is still pending*, opens
  ``ListAndWatch`` and only then answers; a new registration for a resource replaces the old;
- keeps the latest device list per resource; a ListAndWatch stream that ends is never reopened
  (only a new Register opens another);
- ``restart()`` stops, deletes every socket in the directory and serves a new ``kubelet.sock``;
  like a kubelet process that dies, a stopped emulator records nothing more, not even from a
  Register call that was in flight when it stopped (gRPC cancels the call at once, but its
  Python handler runs on to the end).

Usage::

    with KubeletEmulator(plugin_dir) as kubelet:
        ...start the plugin...
        kubelet.wait_registrations(1, timeout=5)
        devices = kubelet.wait_devices("nvidia.com/gpu", lambda d: len(d) == 8, timeout=5)
        response = kubelet.allocate("nvidia.com/gpu", [devices[0].ID])
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import grpc

from vgpu_plugin.api.constants import KUBELET_SOCKET_NAME, VERSION
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.api.podresources.v1 import api_pb2 as pr_pb
from vgpu_plugin.api.podresources.v1 import api_pb2_grpc as pr_grpc

# Extended resource names: <domain>/<name>, as the kubelet validates them.
_RESOURCE_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def short_tmp_dir(prefix: str = "dp-") -> Path:
    """A fresh directory under /tmp: unix socket paths must stay under 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@dataclass(frozen=True)
class Registration:
    """One accepted Register call."""

    version: str
    endpoint: str
    resource_name: str
    # RegisterRequest.options, or None when the plugin left the field unset.
    request_options: pb.DevicePluginOptions | None
    # What GetDevicePluginOptions answered while Register was pending.
    plugin_options: pb.DevicePluginOptions
    at: float


@dataclass
class _Plugin:
    """A registered plugin endpoint and its one ListAndWatch stream."""

    registration: Registration
    channel: Any
    stub: Any
    stream: Any = None
    devices: list[pb.Device] | None = None
    updates: int = 0
    stream_ended: bool = False
    stream_error: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class KubeletEmulator:
    """The kubelet's device manager, for tests. Thread-safe; usable as a context manager."""

    def __init__(
        self,
        plugin_dir: Path | str,
        *,
        call_timeout: float = 5.0,
        before_answer: Callable[[Registration], None] | None = None,
    ) -> None:
        """``before_answer`` runs in the Register handler once the registration is recorded
        and its stream open, before the answer goes out: a test can restart the kubelet
        there, as a real one may restart at that instant."""
        self.plugin_dir = Path(plugin_dir)
        self.before_answer = before_answer
        self.socket_path = self.plugin_dir / KUBELET_SOCKET_NAME
        self.call_timeout = call_timeout
        self._cond = threading.Condition()
        self._registrations: list[Registration] = []
        self._rejected: list[str] = []
        self._plugins: dict[str, _Plugin] = {}
        self._streams_opened: dict[str, int] = {}
        self._server: Any = None
        self._executor: ThreadPoolExecutor | None = None
        # Which serving this is; stop() ends it, so a handler of an earlier one can tell.
        self._generation = 0

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Serves Registration on kubelet.sock."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._executor = ThreadPoolExecutor(8, thread_name_prefix="kubelet-emu")
        server = grpc.server(self._executor)
        with self._cond:
            generation = self._generation
        service = _RegistrationService(self, generation)
        pb_grpc.add_RegistrationServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server

    def stop(self) -> None:
        """Stops serving and drops every plugin connection (their streams end)."""
        with self._cond:
            self._generation += 1
        server, self._server = self._server, None
        if server is not None:
            server.stop(0).wait(5.0)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        with self._cond:
            plugins = list(self._plugins.values())
            self._plugins.clear()
            self._cond.notify_all()
        for plugin in plugins:
            self._close(plugin)

    def disconnect(self, resource_name: str) -> None:
        """What kubelet 1.36 does to the resource's current plugin when an older instance's
        ListAndWatch stream ends (a rolling update with surge): ends its stream and forgets
        it, although it serves on."""
        with self._cond:
            plugin = self._plugins.pop(resource_name, None)
            self._cond.notify_all()
        if plugin is not None:
            self._close(plugin)

    def restart(self) -> None:
        """What a restarting kubelet does: stop, delete every socket here, serve again."""
        self.stop()
        for entry in os.scandir(self.plugin_dir):
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                Path(entry.path).unlink(missing_ok=True)
        self.start()

    def __enter__(self) -> KubeletEmulator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what happened ----------------------------------------------------------------

    @property
    def registrations(self) -> list[Registration]:
        with self._cond:
            return list(self._registrations)

    @property
    def rejected(self) -> list[str]:
        """Why each refused Register call was refused."""
        with self._cond:
            return list(self._rejected)

    def registration_count(self, resource_name: str | None = None) -> int:
        return len(self._matching(resource_name))

    def wait_registrations(
        self, count: int, timeout: float, resource_name: str | None = None
    ) -> list[Registration]:
        """Waits until at least ``count`` registrations happened; returns them all."""
        self._wait(
            lambda: len(self._matching(resource_name)) >= count,
            timeout,
            lambda: f"{count} registrations (have {len(self._matching(resource_name))})",
        )
        return self._matching(resource_name)

    def streams_opened(self, resource_name: str) -> int:
        """How many ListAndWatch streams were opened for the resource, over all restarts."""
        with self._cond:
            return self._streams_opened.get(resource_name, 0)

    def devices(self, resource_name: str) -> list[pb.Device] | None:
        """The latest list from the current plugin's stream; None before its first message."""
        with self._cond:
            plugin = self._plugins.get(resource_name)
            return None if plugin is None or plugin.devices is None else list(plugin.devices)

    def updates(self, resource_name: str) -> int:
        """Messages received on the current plugin's stream."""
        with self._cond:
            plugin = self._plugins.get(resource_name)
            return 0 if plugin is None else plugin.updates

    def stream_ended(self, resource_name: str) -> bool:
        with self._cond:
            plugin = self._plugins.get(resource_name)
            return plugin is None or plugin.stream_ended

    def wait_devices(
        self,
        resource_name: str,
        predicate: Callable[[list[pb.Device]], bool],
        timeout: float,
    ) -> list[pb.Device]:
        """Waits until the current stream's latest list satisfies ``predicate``."""

        def ok() -> bool:
            plugin = self._plugins.get(resource_name)
            return plugin is not None and plugin.devices is not None and predicate(plugin.devices)

        def what() -> str:
            plugin = self._plugins.get(resource_name)
            got = None if plugin is None or plugin.devices is None else len(plugin.devices)
            return f"a device list for {resource_name} satisfying the predicate (last: {got})"

        self._wait(ok, timeout, what)
        found = self.devices(resource_name)
        assert found is not None
        return found

    # -- calls into the plugin, as the kubelet makes them ----------------------------

    def get_device_plugin_options(self, resource_name: str) -> pb.DevicePluginOptions:
        stub = self._stub(resource_name)
        result: pb.DevicePluginOptions = stub.GetDevicePluginOptions(
            pb.Empty(), timeout=self.call_timeout
        )
        return result

    def allocate(self, resource_name: str, *containers: Sequence[str]) -> pb.AllocateResponse:
        """One Allocate call with a request per container; raises grpc.RpcError on refusal."""
        request = pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=list(c)) for c in containers
            ]
        )
        result: pb.AllocateResponse = self._stub(resource_name).Allocate(
            request, timeout=self.call_timeout
        )
        return result

    def get_preferred_allocation(
        self,
        resource_name: str,
        available: Iterable[str],
        must_include: Iterable[str] = (),
        size: int = 1,
    ) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        response = self._stub(resource_name).GetPreferredAllocation(
            request, timeout=self.call_timeout
        )
        return list(response.container_responses[0].deviceIDs)

    def pre_start_container(
        self, resource_name: str, device_ids: Iterable[str]
    ) -> pb.PreStartContainerResponse:
        result: pb.PreStartContainerResponse = self._stub(resource_name).PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=list(device_ids)), timeout=30.0
        )
        return result

    # -- internals --------------------------------------------------------------------

    def _matching(self, resource_name: str | None) -> list[Registration]:
        with self._cond:
            return [
                r
                for r in self._registrations
                if resource_name is None or r.resource_name == resource_name
            ]

    def _wait(self, ok: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ok():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kubelet emulator: no {what()} after {timeout} s")
                self._cond.wait(left)

    def _stub(self, resource_name: str) -> Any:
        with self._cond:
            plugin = self._plugins.get(resource_name)
        if plugin is None:
            raise LookupError(f"no plugin registered for {resource_name}")
        return plugin.stub

    def _reject(self, context: Any, code: Any, why: str, generation: int | None) -> NoReturn:
        with self._cond:
            # A stopped kubelet's late handler (see register) records nothing.
            if generation is None or generation == self._generation:
                self._rejected.append(why)
        context.abort(code, why)
        raise AssertionError("context.abort returned")  # it raises; this is for readers

    def register(
        self, request: pb.RegisterRequest, context: Any, generation: int | None = None
    ) -> pb.Empty:
        """The Registration.Register handler; ``generation``: the serving it came in on
        (None: the current one)."""
        if request.version != VERSION:
            self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unsupported API version {request.version!r}, want {VERSION!r}",
                generation,
            )
        if not _RESOURCE_NAME.match(request.resource_name):
            self._reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid extended resource name {request.resource_name!r}",
                generation,
            )
        endpoint = self.plugin_dir / request.endpoint
        if "/" in request.endpoint or not _is_socket(endpoint):
            self._reject(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"endpoint {request.endpoint!r} is not a socket in {self.plugin_dir}",
                generation,
            )
        channel = grpc.insecure_channel(f"unix://{endpoint}")
        stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        try:
            # Like the kubelet: ask the plugin for its options while Register is pending.
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=self.call_timeout)
        except grpc.RpcError as err:
            channel.close()
            self._reject(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"GetDevicePluginOptions on {request.endpoint} failed: {err.code().name}",
                generation,
            )
        registration = Registration(
            version=request.version,
            endpoint=request.endpoint,
            resource_name=request.resource_name,
            request_options=request.options if request.HasField("options") else None,
            plugin_options=options,
            at=time.time(),
        )
        plugin = _Plugin(registration=registration, channel=channel, stub=stub)
        old: _Plugin | None = None
        with self._cond:
            gone = generation is not None and generation != self._generation
            if not gone:
                old = self._plugins.get(request.resource_name)
                self._plugins[request.resource_name] = plugin
                self._registrations.append(registration)
                self._streams_opened[request.resource_name] = (
                    self._streams_opened.get(request.resource_name, 0) + 1
                )
                plugin.stream = stub.ListAndWatch(pb.Empty())
                self._cond.notify_all()
        if gone:
            # The kubelet this call came to has stopped (its answer was already cancelled):
            # a dead kubelet records nothing and opens no stream.
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet stopped")
            raise AssertionError("context.abort returned")  # it raises; this is for readers
        if old is not None:
            self._close(old)
        plugin.thread = threading.Thread(
            target=self._watch, args=(plugin,), name="kubelet-emu-law", daemon=True
        )
        plugin.thread.start()
        if self.before_answer is not None:
            self.before_answer(registration)
        return pb.Empty()

    def _watch(self, plugin: _Plugin) -> None:
        try:
            for response in plugin.stream:
                with self._cond:
                    plugin.devices = list(response.devices)
                    plugin.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError as err:
            plugin.stream_error = err.code().name
        finally:
            with self._cond:
                plugin.stream_ended = True
                self._cond.notify_all()

    @staticmethod
    def _close(plugin: _Plugin) -> None:
        if plugin.stream is not None:
            plugin.stream.cancel()
        plugin.channel.close()
        if plugin.thread is not None:
            plugin.thread.join(timeout=5.0)


class _RegistrationService(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletEmulator, generation: int) -> None:
        self._kubelet = kubelet
        self._generation = generation

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        return self._kubelet.register(request, context, self._generation)


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


class PodResourcesEmulator:
    """The kubelet's pod-resources API (``v1.PodResourcesLister``) over a unix socket.

    The demo and end-to-end tests record which container holds which devices (as the kubelet
    does after Allocate) and the plugin's node agent reads it back like on a real node.
    """

    def __init__(
        self,
        socket_path: Path | str,
        allocatable: Callable[[], Sequence[tuple[str, Sequence[str]]]] | None = None,
    ) -> None:
        """``allocatable`` returns (resource, device ids) pairs for GetAllocatableResources,
        e.g. from a KubeletEmulator's device lists; without it that call is UNIMPLEMENTED, as
        on a kubelet with the feature gate off."""
        self.socket_path = Path(socket_path)
        self.allocatable = allocatable
        self._lock = threading.Lock()
        # (namespace, pod) -> container -> [(resource, device ids)]
        self._pods: dict[tuple[str, str], dict[str, list[tuple[str, list[str]]]]] = {}
        self._server: Any = None

    def assign(
        self, namespace: str, pod: str, container: str, resource: str, device_ids: Sequence[str]
    ) -> None:
        with self._lock:
            containers = self._pods.setdefault((namespace, pod), {})
            containers.setdefault(container, []).append((resource, list(device_ids)))

    def remove_pod(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._pods.pop((namespace, pod), None)

    def list_response(self) -> Any:
        with self._lock:
            pods = [
                pr_pb.PodResources(
                    namespace=ns,
                    name=name,
                    containers=[
                        pr_pb.ContainerResources(
                            name=c,
                            devices=[
                                pr_pb.ContainerDevices(resource_name=r, device_ids=ids)
                                for r, ids in devs
                            ],
                        )
                        for c, devs in containers.items()
                    ],
                )
                for (ns, name), containers in self._pods.items()
            ]
        return pr_pb.ListPodResourcesResponse(pod_resources=pods)

    def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(ThreadPoolExecutor(4, thread_name_prefix="podresources-emu"))
        pr_grpc.add_PodResourcesListerServicer_to_server(  # type: ignore[no-untyped-call]
            _PodResourcesService(self), server
        )
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(0).wait(5.0)
        self.socket_path.unlink(missing_ok=True)


class _PodResourcesService(pr_grpc.PodResourcesListerServicer):
    def __init__(self, emulator: PodResourcesEmulator) -> None:
        self._emulator = emulator

    def List(self, request: Any, context: Any) -> Any:
        return self._emulator.list_response()

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        source = self._emulator.allocatable
        if source is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "GetAllocatableResources is not enabled")
            return None  # abort raises; this keeps the types honest
        devices = [
            pr_pb.ContainerDevices(resource_name=r, device_ids=list(ids)) for r, ids in source()
        ]
        return pr_pb.AllocatableResourcesResponse(devices=devices)
