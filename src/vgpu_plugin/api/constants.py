"""Constants of the kubelet's device plugin API (upstream: deviceplugin/v1beta1/constants.go)."""

from __future__ import annotations

from typing import Final

# The API version a plugin states in RegisterRequest.version.
VERSION: Final = "v1beta1"
# Where the kubelet looks for plugin sockets, and the name of its own Registration socket.
DEVICE_PLUGIN_PATH: Final = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET_NAME: Final = "kubelet.sock"
# Device.health values.
HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"
# The kubelet gives PreStartContainer this long; Allocate has no deadline at all.
PRE_START_CONTAINER_TIMEOUT_S: Final = 30
# gRPC's default receive limit, which the kubelet keeps: every response must fit.
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
# The pod-resources API socket (v1.PodResourcesLister).
POD_RESOURCES_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
