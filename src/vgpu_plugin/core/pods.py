"""What the kubelet says about pods, as plain values: which container holds a device
(pod-resources ``List``), which containers its device checkpoint keeps, and the two ways
asking can fail. Pure, so the node's cleanup and view depend on the facts, not on the
kubelet clients that read them (``kubelet/podresources.py``, ``kubelet/checkpoint.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class PodRef:
    """The container that holds a device."""

    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


class PodResourcesUnavailable(RuntimeError):
    """The kubelet's pod-resources socket is missing or does not answer."""


class CheckpointError(ValueError):
    """The checkpoint exists but cannot be read or is not the kubelet's format."""


@dataclass(frozen=True)
class CheckpointEntry:
    """One container's devices of one resource, as the kubelet recorded them."""

    pod_uid: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]
    allocation_ids: tuple[str, ...]  # from the Allocate response's envs; () if not ours
    # The Allocate response the kubelet keeps, a ``ContainerAllocateResponse`` (None: absent
    # or not decodable); typed loosely so the core needs no protobuf.
    response: object | None = field(default=None, compare=False)
