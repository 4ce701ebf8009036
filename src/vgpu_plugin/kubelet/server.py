"""The device plugin's lifecycle with the kubelet: serve, register, survive restarts, stop.

``DevicePluginServer`` serves the DevicePlugin service on a socket of its own in the
device-plugins directory (a fresh, unique name each time), and only then calls
``Registration.Register`` on ``kubelet.sock``. A supervisor thread then polls both sockets;
when the kubelet restarts (it deletes our socket and recreates its own) the server serves on
a fresh socket and registers again, once per restart. While the kubelet is absent or refuses,
Register is retried with backoff, and a line is logged per state change, not per attempt.
What is advertised and allocated is the ``Backend``'s business (see ``backend.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from vgpu_plugin.api.constants import DEVICE_PLUGIN_PATH, KUBELET_SOCKET_NAME, VERSION
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.core import defaults
from vgpu_plugin.kubelet.backend import (
    Backend,
    check_list_size,
)
from vgpu_plugin.kubelet.peers import StreamSlots, server_limits, tame_grpc_logs
from vgpu_plugin.kubelet.servicer import (
    DEFAULT_MAX_STREAMS,
    DeviceFeed,
    DevicePluginService,
    ServerHooks,
)
from vgpu_plugin.kubelet.watch import FileId, RestartDetector, file_id

log = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107
# The names _socket_name makes: vgpu-<resource>-<pid>-<6 hex>.sock.
_OUR_SOCKET = re.compile(r"^vgpu-[A-Za-z0-9_.-]+-[0-9]+-[0-9a-f]{6}\.sock$")


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def other_instance_serves(plugin_dir: Path, socket_prefix: str, own: Path | None) -> bool:
    """Whether another live instance of this plugin serves the same resource: a socket named
    ``<socket_prefix><pid>-<hex>.sock`` other than ``own`` that accepts connections."""
    try:
        names = os.listdir(plugin_dir)
    except OSError:
        return False
    for name in names:
        path = plugin_dir / name
        if (
            name.startswith(socket_prefix)
            and _OUR_SOCKET.match(name)
            and re.fullmatch(r"[0-9]+-[0-9a-f]{6}\.sock", name[len(socket_prefix) :])
            and path != own
            and _answers(path)
        ):
            return True
    return False


def remove_stale_sockets(plugin_dir: Path) -> list[Path]:
    """Removes the sockets that crashed instances of this plugin left in ``plugin_dir``: a
    name of ours (``vgpu-<resource>-<pid>-<hex>.sock``), a socket, and nobody listening on it
    (connect refused). Another plugin's files, and a live instance's socket (a rolling update),
    are left alone. Returns what was removed."""
    removed: list[Path] = []
    try:
        names = os.listdir(plugin_dir)
    except OSError:
        return removed
    for name in names:
        path = plugin_dir / name
        if not _OUR_SOCKET.match(name) or not path.is_socket():
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
                continue  # someone serves on it
            except ConnectionRefusedError:
                pass
            except OSError:
                continue  # not clearly dead: keep it
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


class DevicePluginServer:
    """Serves one resource's DevicePlugin service and keeps it registered with the kubelet."""

    def __init__(
        self,
        backend: Backend,
        resource_name: str = defaults.RESOURCE_NAME,
        plugin_dir: Path | str = DEVICE_PLUGIN_PATH,
        *,
        poll_interval: float = 0.2,
        register_timeout: float = 5.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 10.0,
        max_workers: int = 16,
        max_streams: int = DEFAULT_MAX_STREAMS,
        hooks: ServerHooks | None = None,
    ) -> None:
        if not 1 <= max_streams < max_workers:
            raise ValueError(
                f"max_streams {max_streams} must be 1 or more and fewer than max_workers"
                f" {max_workers}: unary calls need threads the streams cannot take"
            )
        self.backend = backend
        self.resource_name = resource_name
        self.plugin_dir = Path(plugin_dir)
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET_NAME
        self.hooks = hooks or ServerHooks()
        self._poll = poll_interval
        self._register_timeout = register_timeout
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._max_workers = max_workers
        self._stopping = threading.Event()
        self._registered = threading.Event()
        self._feed = DeviceFeed(backend)
        self._service = DevicePluginService(
            backend, self._feed, self.hooks, self._stopping, StreamSlots(max_streams)
        )
        self._detector = RestartDetector(self.kubelet_socket)
        self._grpc: Any = None  # grpc.Server; grpc ships no type information
        self._executor: ThreadPoolExecutor | None = None
        self._own: tuple[Path, FileId | None] | None = None
        self._supervisor: threading.Thread | None = None
        self._state = ""
        self._restart_reason: str | None = None

    # -- public API ---------------------------------------------------------------------

    @property
    def socket_path(self) -> Path | None:
        """Our current socket, or None when not serving."""
        return None if self._own is None else self._own[0]

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def wait_registered(self, timeout: float) -> bool:
        """Blocks until the current socket is registered with the kubelet, or ``timeout``."""
        return self._registered.wait(timeout)

    def notify_devices_changed(self) -> None:
        """Re-sends the list on every open ListAndWatch stream (e.g. after a config reload)."""
        self._feed.bump()

    def start(self) -> None:
        """Checks the device list fits, serves, and registers in the background.

        Raises ListTooLargeError if the ListAndWatch message would exceed 4 MiB, and
        FileNotFoundError/ValueError/RuntimeError if the socket cannot be served."""
        if self._supervisor is not None:
            raise RuntimeError("DevicePluginServer.start() called twice")
        size = check_list_size(self.backend.devices())
        if not self.plugin_dir.is_dir():
            raise FileNotFoundError(f"device plugin directory {self.plugin_dir} does not exist")
        log.info(
            "advertising %s: ListAndWatch message of %d bytes",
            self.resource_name,
            size,
            extra={"resource": self.resource_name, "list_bytes": size},
        )
        tame_grpc_logs()
        for stale in remove_stale_sockets(self.plugin_dir):
            log.info("removed %s, the socket of a plugin instance that is gone", stale)
        self._stopping.clear()
        self._feed.start()
        try:
            self._serve_fresh()
        except Exception:
            self._feed.stop()
            raise
        self._supervisor = threading.Thread(
            target=self._supervise, name="vgpu-plugin-supervisor", daemon=True
        )
        self._supervisor.start()

    def stop(self, grace: float = 1.0, *, withdraw: bool = False) -> None:
        """Ends every stream, stops serving and removes our socket. Safe to call twice.

        ``withdraw``: first send the kubelet an empty device list, so that the node's
        capacity for the resource drops to 0 at once (the kubelet otherwise keeps the last
        count after the plugin is gone: a stale extended resource after an uninstall). Pods
        already given devices keep them; the kubelet asks nothing of a plugin to run them."""
        own = self._own[0] if self._own is not None else None
        if withdraw and other_instance_serves(self.plugin_dir, self._socket_prefix(), own):
            # A newer instance serves the resource (a rolling update with surge): the
            # devices stay on the node, with it.
            log.info("device plugin for %s: another instance serves it, devices left to it",
                     self.resource_name)  # fmt: skip
        elif withdraw and not self._stopping.is_set():
            told = self._service.withdraw(timeout=max(grace, 0.5) + 1.0)
            log.info("device plugin for %s: devices withdrawn (%d streams told)",
                     self.resource_name, told)  # fmt: skip
        self._stopping.set()
        self._feed.poke()
        if self._supervisor is not None:
            self._supervisor.join(timeout=10.0)
            self._supervisor = None
        self._close_server(grace)
        self._feed.stop()
        self._registered.clear()
        log.info("device plugin for %s stopped", self.resource_name)

    def __enter__(self) -> DevicePluginServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- serving ------------------------------------------------------------------------

    def _socket_prefix(self) -> str:
        resource = re.sub(r"[^A-Za-z0-9_.]+", "-", self.resource_name).strip("-")[:40]
        return f"vgpu-{resource}-"

    def _socket_name(self) -> str:
        return f"{self._socket_prefix()}{os.getpid()}-{secrets.token_hex(3)}.sock"

    def _serve_fresh(self) -> None:
        """Stops any previous server and serves on a new, unique socket."""
        self._close_server(grace=0.0)
        path = self.plugin_dir / self._socket_name()
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
            raise ValueError(
                f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes, the unix limit; "
                f"use a shorter device plugin directory"
            )
        executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix="vgpu-grpc")
        server = grpc.server(executor, **server_limits(self._max_workers))
        # The generated gRPC module is untyped (protoc writes no stub for it).
        pb_grpc.add_DevicePluginServicer_to_server(self._service, server)  # type: ignore[no-untyped-call]
        try:
            server.add_insecure_port(f"unix://{path}")
            server.start()
        except Exception:
            executor.shutdown(wait=False)
            raise
        self._grpc, self._executor = server, executor
        self._own = (path, file_id(path))
        log.debug("serving on %s", path)

    def _close_server(self, grace: float) -> None:
        server, executor, own = self._grpc, self._executor, self._own
        self._grpc, self._executor, self._own = None, None, None
        if server is not None:
            server.stop(grace).wait(grace + 5.0)
        if executor is not None:
            executor.shutdown(wait=False)
        if own is not None:
            path, ident = own
            # gRPC unlinks it on stop; this covers the cases it does not, and never
            # deletes a file that someone else has since created under that name.
            if ident is not None and file_id(path) == ident:
                path.unlink(missing_ok=True)

    def _own_gone(self) -> bool:
        own = self._own
        return own is None or file_id(own[0]) != own[1]

    # -- registration -------------------------------------------------------------------

    def _register(self) -> None:
        assert self._own is not None
        request = pb.RegisterRequest(
            version=VERSION,
            endpoint=self._own[0].name,
            resource_name=self.resource_name,
            options=self.backend.options(),
        )
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            stub.Register(request, timeout=self._register_timeout)

    def _supervise(self) -> None:
        need_serve = False
        backoff = self._backoff_initial
        while not self._stopping.is_set():
            if need_serve:
                try:
                    self._serve_fresh()
                except Exception as err:
                    self._note_state("serve-failed", logging.ERROR, "cannot serve: %s", err)
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, self._backoff_max)
                    continue
                need_serve = False
            kubelet = file_id(self.kubelet_socket)
            if kubelet is None:
                self._note_state(
                    "waiting",
                    logging.INFO,
                    "kubelet socket %s is absent; will register when it appears",
                    self.kubelet_socket,
                )
                self._poll_until(
                    lambda: file_id(self.kubelet_socket) is not None or self._own_gone()
                )
                need_serve = self._own_gone()
                continue
            # Streams the kubelet opens for this registration are numbered above the mark,
            # even one that ends before its answer reaches us (an older one's end is not ours).
            mark = self._service.streams_opened()
            try:
                self._register()
            except grpc.RpcError as err:
                code = err.code().name if callable(getattr(err, "code", None)) else "UNKNOWN"
                if self.hooks.on_register_failure is not None:
                    self.hooks.on_register_failure(code)
                detail = err.details() if callable(getattr(err, "details", None)) else str(err)
                self._note_state(
                    f"failing-{code}",
                    logging.WARNING,
                    "Register with the kubelet failed (%s: %s); retrying with backoff",
                    code,
                    detail,
                )
                # A new kubelet.sock is worth an immediate retry; otherwise back off.
                self._poll_until(self._kubelet_replaced_or_own_gone(kubelet), timeout=backoff)
                backoff = min(backoff * 2, self._backoff_max)
                need_serve = self._own_gone()
                continue
            backoff = self._backoff_initial
            self._on_registered(kubelet)
            self._poll_until(functools.partial(self._restart_or_dropped, kubelet, mark))
            self._registered.clear()
            self._detector.disarm()
            if self._restart_reason is None and self._service.dropped_since(mark):
                log.info(
                    "the kubelet ended the ListAndWatch stream of %s and no other instance "
                    "serves it: registering again",
                    self.resource_name,
                    extra={"resource": self.resource_name},
                )
                need_serve = self._own_gone()
            elif self._restart_reason is not None:
                if self.hooks.on_restart is not None:
                    self.hooks.on_restart(self._restart_reason)
                log.info(
                    "kubelet restart detected (%s): serving on a fresh socket, registering again",
                    self._restart_reason,
                )
                need_serve = True

    def _on_registered(self, kubelet: FileId) -> None:
        assert self._own is not None
        path, ident = self._own
        self._detector.arm(path, ident, kubelet)
        self._registered.set()
        self._note_state(
            f"registered-{path.name}",
            logging.INFO,
            "registered %s with the kubelet, endpoint %s",
            self.resource_name,
            path.name,
        )
        if self.hooks.on_register is not None:
            self.hooks.on_register(path.name)

    def _restart_or_dropped(self, kubelet: FileId, mark: int) -> bool:
        return self._restart_seen() or self._dropped_alone(kubelet, mark)

    def _dropped_alone(self, kubelet: FileId, mark: int) -> bool:
        """The kubelet ended the stream of our latest registration (one opened after
        ``mark``) while it still serves, the same kubelet (a restart is the detector's), and
        no other live instance of ours serves the resource (a newer one that took over, or an
        older one still stopping): registering again is ours."""
        if not self._service.dropped_since(mark) or self._own_gone():
            return False
        if file_id(self.kubelet_socket) != kubelet or not _answers(self.kubelet_socket):
            return False
        own = self._own[0] if self._own is not None else None
        return not other_instance_serves(self.plugin_dir, self._socket_prefix(), own)

    def _kubelet_replaced_or_own_gone(self, seen: FileId) -> Callable[[], bool]:
        return lambda: file_id(self.kubelet_socket) != seen or self._own_gone()

    def _restart_seen(self) -> bool:
        self._restart_reason = self._detector.check()
        return self._restart_reason is not None

    def _poll_until(self, condition: Callable[[], bool], timeout: float = math.inf) -> bool:
        """Checks ``condition`` every poll interval until true, stop, or ``timeout``."""
        waited = 0.0
        while not self._stopping.is_set():
            if condition():
                return True
            if waited >= timeout:
                return False
            step = min(self._poll, timeout - waited)
            self._stopping.wait(step)
            waited += step
        return False

    def _note_state(self, state: str, level: int, message: str, *args: object) -> None:
        """Logs ``message`` only when the state changes, so retries do not flood the log."""
        if state != self._state:
            self._state = state
            log.log(level, message, *args, extra={"resource": self.resource_name})
        else:
            log.debug(message, *args)
