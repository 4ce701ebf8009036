"""The DRA driver's pure side (docs/dra.md): the node's ResourceSlice, the reading of a
claim's allocation, the names both use, and Kubernetes quantities.

Facts this relies on (Kubernetes 1.34 on, ``resource.k8s.io/v1``; see docs/dra.md):

- A ResourceSlice device's attributes are typed ``bool``, ``int``, ``string`` or ``version``
  (semantic version 2.0.0) only; a quantity is refused.
- A capacity with a ``requestPolicy`` needs ``allowMultipleAllocations: true``; a
  ``validRange`` needs a ``default``; a policy has exactly one of ``validRange`` and
  ``validValues``. A capacity without a policy is consumed whole by a claim that does not ask
  for it.
- The scheduler writes each allocated device into the claim's
  ``status.allocation.devices.results[]`` with ``driver``, ``pool``, ``device``, ``request``,
  ``consumedCapacity`` (rounded up to the step, the default when not asked for) and a
  ``shareID`` per allocation of a shared device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

from vgpu_plugin.core.devices import PhysicalGpu

API_VERSION: Final = "resource.k8s.io/v1"
DRIVER_NAME: Final = "gpu.vgpu-plugin.io"
MEMORY: Final = "memory"
COMPUTE: Final = "compute"
# The plugin registration type and the DRA service names a driver announces.
PLUGIN_TYPE: Final = "DRAPlugin"
SERVICE_V1: Final = "v1.DRAPlugin"
SERVICE_V1BETA1: Final = "v1beta1.DRAPlugin"
REGISTRY_DIR: Final = "/var/lib/kubelet/plugins_registry"
PLUGINS_DIR: Final = "/var/lib/kubelet/plugins"

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")
_QUANTITY = re.compile(
    r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
_BINARY = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_SUFFIX: Final[Mapping[str, Fraction]] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    **{s: Fraction(1 << (10 * (i + 1))) for i, s in enumerate(_BINARY)},
}


def parse_quantity(text: object, what: str = "quantity") -> Fraction:
    """A Kubernetes quantity (``6Gi``, ``30``, ``1.5G``, ``500m``, ``1e3``) as an exact number;
    ValueError in one line otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return Fraction(text)
    m = _QUANTITY.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{what}: {text!r} is not a Kubernetes quantity (e.g. 6Gi, 30, 500m)")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    value = Fraction(number)
    if suffix[:1] in ("e", "E"):
        value *= Fraction(10) ** int(suffix[1:])
    else:
        value *= _SUFFIX[suffix]
    return -value if sign == "-" else value


def format_bytes(n: int) -> str:
    """Bytes as the shortest exact binary quantity: ``16Gi``, ``256Mi``, or the bare number."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIX[suffix])
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


@dataclass(frozen=True)
class CapacityPolicy:
    """How a claim may consume one capacity of a device: what it gets when it does not ask,
    the least it may ask, and the step its request is rounded up to (all in the capacity's
    unit: bytes for memory, percent for compute)."""

    default: int
    minimum: int
    step: int

    def problem(self, what: str, maximum: int | None = None) -> str | None:
        if self.minimum < 1 or self.step < 1:
            return f"{what}: minimum and step must be at least 1"
        if self.default < self.minimum or (maximum is not None and self.default > maximum):
            return f"{what}: default {self.default} is outside {self.minimum}..{maximum or ''}"
        if (self.default - self.minimum) % self.step:
            return f"{what}: default {self.default} is not minimum + a multiple of step"
        return None


MEMORY_POLICY: Final = CapacityPolicy(default=1 << 30, minimum=256 << 20, step=256 << 20)
COMPUTE_POLICY: Final = CapacityPolicy(default=10, minimum=1, step=1)


@dataclass(frozen=True)
class DeviceFacts:
    """What NVML says of a GPU beyond discovery, for its ResourceSlice attributes: compute
    capability (``"8.0"``) and driver version (``"550.54.15"``); empty when unknown."""

    compute_capability: str = ""
    driver_version: str = ""


def device_name(gpu: PhysicalGpu) -> str:
    """The GPU's DRA device name: a DNS label from its UUID (``gpu-709fac35-...``), so a
    claim's allocation names the same GPU whatever index it has after a reboot."""
    uuid = gpu.uuid.lower()
    name = uuid if uuid.startswith("gpu-") else f"gpu-{uuid}"
    name = re.sub(r"[^a-z0-9-]", "-", name)[:63].strip("-")
    if not _DNS_LABEL.match(name):
        raise ValueError(f"GPU {gpu.uuid!r} gives no DNS label as a DRA device name")
    return name


def check_driver_name(name: str) -> str:
    if len(name) > 63 or not _DNS_SUBDOMAIN.match(name) or "." not in name:
        raise ValueError(
            f"DRA driver name {name!r}: must be a lowercase DNS subdomain with a domain"
            " (e.g. gpu.example.com), at most 63 characters"
        )
    return name


def _version(text: str, parts: int = 3) -> str | None:
    """``8.0`` -> ``8.0.0``; ``535.104.05`` -> ``535.104.5``: a semantic version (no leading
    zeros), or None when ``text`` is not dotted numbers."""
    items = text.strip().split(".")
    if not text.strip() or not all(i.isdigit() for i in items) or len(items) > parts:
        return None
    return ".".join(str(int(i)) for i in items + ["0"] * (parts - len(items)))


def _capacity(value: str, policy: CapacityPolicy, fmt: Any, maximum: str | None) -> dict[str, Any]:
    valid: dict[str, Any] = {"min": fmt(policy.minimum), "step": fmt(policy.step)}
    if maximum is not None:
        valid["max"] = maximum
    return {"value": value, "requestPolicy": {"default": fmt(policy.default), "validRange": valid}}


def slice_device(
    gpu: PhysicalGpu,
    facts: DeviceFacts,
    memory: CapacityPolicy = MEMORY_POLICY,
    compute: CapacityPolicy = COMPUTE_POLICY,
) -> dict[str, Any]:
    """One GPU as a ResourceSlice device: attributes, and consumable memory and compute."""
    attributes: dict[str, Any] = {
        "uuid": {"string": gpu.uuid},
        "model": {"string": gpu.name},
        "index": {"int": gpu.index},
        "memoryBytes": {"int": gpu.memory_total},
    }
    cc = _version(facts.compute_capability)
    if cc is not None:
        attributes["computeCapability"] = {"version": cc}
    if facts.driver_version:
        attributes["driverVersion"] = {"string": facts.driver_version}
        dv = _version(facts.driver_version)
        if dv is not None:
            attributes["driverSemver"] = {"version": dv}
    if gpu.numa_node is not None:
        attributes["numaNode"] = {"int": gpu.numa_node}
    return {
        "name": device_name(gpu),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            MEMORY: _capacity(format_bytes(gpu.memory_total), memory, format_bytes, None),
            COMPUTE: _capacity("100", compute, str, "100"),
        },
    }


def slice_name(node_name: str, driver: str) -> str:
    """One slice per node and driver; its name joins both (a DNS subdomain)."""
    name = f"{node_name}-{driver}".lower()
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise ValueError(f"ResourceSlice name {name!r} is not a DNS subdomain")
    return name


def resource_slice(
    node_name: str,
    driver: str,
    gpus: Sequence[tuple[PhysicalGpu, DeviceFacts]],
    generation: int = 1,
    memory: CapacityPolicy = MEMORY_POLICY,
    compute: CapacityPolicy = COMPUTE_POLICY,
) -> dict[str, Any]:
    """The node's ResourceSlice: one pool named after the node, one device per GPU given
    (the healthy ones; an unhealthy GPU is left out until it recovers). ``generation`` goes
    up with every change, so the scheduler drops what an older one said."""
    ordered = sorted(gpus, key=lambda x: x[0].index)
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node_name, driver)},
        "spec": {
            "driver": check_driver_name(driver),
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": [slice_device(g, f, memory, compute) for g, f in ordered],
        },
    }


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a claim's allocation that is this driver's, with what the claim consumed
    of it (memory in bytes, compute in percent; None: the claim consumed it whole)."""

    request: str
    pool: str
    device: str
    memory_bytes: int | None
    compute_percent: int | None
    share_id: str = ""


class ClaimError(ValueError):
    """The claim cannot be prepared as it stands; the message says why, in one line."""


def claim_devices(claim: Mapping[str, Any], driver: str, uid: str = "") -> list[ClaimDevice]:
    """This driver's devices in the claim's allocation (``status.allocation.devices.results``);
    ClaimError when the claim is another one than asked (``uid``), not allocated, or says
    something this driver cannot read."""
    meta = claim.get("metadata") or {}
    ref = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
    if uid and meta.get("uid") != uid:
        raise ClaimError(f"claim {ref}: UID {meta.get('uid')!r} is not the kubelet's {uid!r}")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ref} is not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    out: list[ClaimDevice] = []
    for r in results:
        if r.get("driver") != driver:
            continue
        consumed = r.get("consumedCapacity") or {}
        try:
            memory = (
                math.ceil(parse_quantity(consumed[MEMORY], "memory"))
                if MEMORY in consumed
                else None
            )
            compute = (
                math.ceil(parse_quantity(consumed[COMPUTE], "compute"))
                if COMPUTE in consumed
                else None
            )
        except ValueError as exc:
            raise ClaimError(f"claim {ref}: {exc}") from exc
        if compute is not None and not 1 <= compute <= 100:
            raise ClaimError(f"claim {ref}: compute {compute} is outside 1..100")
        if memory is not None and memory < 1:
            raise ClaimError(f"claim {ref}: memory {memory} is not positive")
        for key in ("request", "pool", "device"):
            if not isinstance(r.get(key), str) or not r[key]:
                raise ClaimError(f"claim {ref}: an allocation result has no {key}")
        out.append(
            ClaimDevice(
                r["request"], r["pool"], r["device"], memory, compute, str(r.get("shareID") or "")
            )
        )
    if not out:
        raise ClaimError(f"claim {ref} has no device of driver {driver}")
    return out


def allocation_id(claim_uid: str) -> str:
    """The allocation id of a claim's grant: fixed by the claim, so preparing it again (a
    kubelet retry, a plugin restart) finds the same files."""
    aid = f"dra-{claim_uid.lower()}"
    if not re.match(r"^[a-z0-9][a-z0-9-]{0,123}[a-z0-9]$", aid):
        raise ClaimError(f"claim UID {claim_uid!r} is not a UID")
    return aid
