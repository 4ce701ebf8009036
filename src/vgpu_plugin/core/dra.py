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

import functools
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Protocol

from vgpu_plugin.core.devices import PhysicalGpu

API_VERSION: Final = "resource.k8s.io/v1"
DRIVER_NAME: Final = "gpu.vgpu-plugin.io"
MEMORY: Final = "memory"
COMPUTE: Final = "compute"
# The plugin registration type and the DRA service names a driver announces.
PLUGIN_TYPE: Final = "DRAPlugin"
SERVICE_V1: Final = "v1.DRAPlugin"
SERVICE_V1BETA1: Final = "v1beta1.DRAPlugin"
# The device health service (kubelet 1.34+, ResourceHealthStatus); kubelets from 1.36.2 open
# its stream only to drivers that list it at registration.
SERVICE_HEALTH: Final = "v1alpha1.DRAResourceHealth"
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


# Kubernetes keeps no more than milli precision (``0.1m`` reads as ``1m``) and caps a
# quantity at 2^63-1; exponents beyond these bounds only reach the cap or the first milli, so
# they are clamped before any power is computed (``1e999999999`` costs nothing).
QUANTITY_MAX: Final = (1 << 63) - 1
_EXPONENT_BOUND = 40
_MAX_TEXT = 100  # characters; longer text is refused, not parsed


def parse_quantity(text: object, what: str = "quantity") -> Fraction:
    """A Kubernetes quantity (``6Gi``, ``30``, ``1.5G``, ``500m``, ``1e3``) as Kubernetes reads
    it: exact to the milli, a finer fraction rounded up (away from zero) to the next milli, a
    magnitude over 2^63-1 capped there. ValueError in one line when it is no quantity."""
    if isinstance(text, int) and not isinstance(text, bool):
        return Fraction(max(-QUANTITY_MAX, min(QUANTITY_MAX, text)))
    if isinstance(text, str) and len(text) <= _MAX_TEXT:
        return _parse_text(text, what)
    return _parse_text_uncached(text, what)


@functools.lru_cache(maxsize=256)
def _parse_text(text: str, what: str) -> Fraction:
    """Every prepare reads the same few quantities (``6Gi``, ``30``): Fraction arithmetic is
    ~50 us a read. Cached by value (a Fraction is immutable); errors are not cached."""
    return _parse_text_uncached(text, what)


def _parse_text_uncached(text: object, what: str) -> Fraction:
    m = _QUANTITY.match(text) if isinstance(text, str) and len(text) <= _MAX_TEXT else None
    if m is None:
        shown = text if not isinstance(text, str) or len(text) <= _MAX_TEXT else text[:20] + "..."
        raise ValueError(f"{what}: {shown!r} is not a Kubernetes quantity (e.g. 6Gi, 30, 500m)")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    value = Fraction(number)
    if suffix not in _SUFFIX:  # an exponent (a bare "E" is exa, a suffix)
        # Past this bound a non-zero number is over the cap or under one milli either way.
        bound = _EXPONENT_BOUND + len(number)
        digits = suffix[1:].lstrip("+-").lstrip("0") or "0"
        exponent = min(bound, int(digits) if len(digits) <= 4 else bound)
        if suffix[1:2] == "-":
            exponent = -exponent
        value *= Fraction(10) ** exponent
    else:
        value *= _SUFFIX[suffix]
    value = Fraction(math.ceil(value * 1000), 1000)  # up to the next milli
    value = min(value, Fraction(QUANTITY_MAX))
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

    def round_up(self, value: Fraction) -> int:
        """What a claim of ``value`` consumes under this policy: the minimum, or minimum plus
        the least whole number of steps that holds ``value``; never less than asked."""
        if value <= self.minimum:
            return self.minimum
        return self.minimum + math.ceil((value - self.minimum) / self.step) * self.step


# A CUDA context's own memory, taken from every claim's limit before the first allocation:
# simgpu models it as 256 MiB (sim/demo.py CONTEXT_MIB); a real one is a few hundred MiB.
CUDA_CONTEXT_BYTES: Final = 256 << 20
# Minimum 1Gi: the smallest claim holds a context and leaves room to work (the chart's too).
MEMORY_POLICY: Final = CapacityPolicy(default=1 << 30, minimum=1 << 30, step=256 << 20)
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


UNHEALTHY_TAINT: Final = "vgpu-plugin.io/unhealthy"
# An unhealthy GPU keeps new claims off (NoSchedule) but does not evict the pods using it:
# the device plugin's health does not evict either, and a transient fault should not kill jobs.
_UNHEALTHY = {"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}


def slice_device(
    gpu: PhysicalGpu,
    facts: DeviceFacts,
    memory: CapacityPolicy = MEMORY_POLICY,
    compute: CapacityPolicy = COMPUTE_POLICY,
    unhealthy: bool = False,
) -> dict[str, Any]:
    """One GPU as a ResourceSlice device: attributes, and consumable memory and compute;
    an ``unhealthy`` one carries the ``UNHEALTHY_TAINT`` taint (device taints, KEP 5055)."""
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
    device: dict[str, Any] = {
        "name": device_name(gpu),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            MEMORY: _capacity(format_bytes(gpu.memory_total), memory, format_bytes, None),
            COMPUTE: _capacity("100", compute, str, "100"),
        },
    }
    if unhealthy:
        device["taints"] = [dict(_UNHEALTHY)]
    return device


def tainted_devices(resource_slice: Mapping[str, Any]) -> set[str]:
    """The names of the slice's devices that carry the ``UNHEALTHY_TAINT`` taint."""
    return {
        str(d.get("name"))
        for d in (resource_slice.get("spec") or {}).get("devices") or []
        if any(t.get("key") == UNHEALTHY_TAINT for t in d.get("taints") or [])
    }


def policy_warnings(memory: CapacityPolicy) -> list[str]:
    """What check-config warns about the DRA request policies: a memory minimum that does not
    hold one CUDA context lets a claim be granted that cannot start CUDA at all."""
    if memory.minimum <= CUDA_CONTEXT_BYTES:
        return [
            f"dra.memory.minimum {format_bytes(memory.minimum)} does not exceed one CUDA"
            f" context ({format_bytes(CUDA_CONTEXT_BYTES)}): the smallest claim could not start"
            " CUDA; 1Gi is the default"
        ]
    return []


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
    node_uid: str = "",
    unhealthy: Collection[str] = (),
) -> dict[str, Any]:
    """The node's ResourceSlice: one pool named after the node, one device per GPU given;
    those whose UUID is in ``unhealthy`` are tainted (the caller leaves an unhealthy GPU out
    instead where the API server has no device taints). ``generation`` goes
    up with every change, so the scheduler drops what an older one said. With ``node_uid``
    the slice is owned by its Node, so the garbage collector deletes it with the node."""
    ordered = sorted(gpus, key=lambda x: x[0].index)
    metadata: dict[str, Any] = {"name": slice_name(node_name, driver)}
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": check_driver_name(driver),
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                slice_device(g, f, memory, compute, g.uuid in unhealthy) for g, f in ordered
            ],
        },
    }


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a claim's allocation that is this driver's, with what the claim consumed
    of it (memory in bytes, compute in percent), rounded up to the request policies."""

    request: str
    pool: str
    device: str
    memory_bytes: int
    compute_percent: int
    share_id: str = ""


class ClaimError(ValueError):
    """The claim cannot be prepared as it stands; the message says why, in one line."""


def _consumed(consumed: Mapping[str, Any], name: str, policy: CapacityPolicy, where: str) -> int:
    """One capacity of a result's ``consumedCapacity``, rounded up to ``policy``. The slice
    gives every device a request policy for each capacity, so the scheduler writes both into
    every result: one missing is a malformed result (a scheduler without consumable capacity,
    a hand-written status), refused rather than read as the whole GPU."""
    if name not in consumed:
        raise ClaimError(
            f"{where}: no consumedCapacity {name!r}, which this driver's ResourceSlice requires"
            " (is the DRAConsumableCapacity feature off in the scheduler?)"
        )
    try:
        value = parse_quantity(consumed[name], name)
    except ValueError as exc:
        raise ClaimError(f"{where}: {exc}") from exc
    if value <= 0:
        raise ClaimError(f"{where}: {name} {consumed[name]!r} is not positive")
    return policy.round_up(value)


def _admin_requests(claim: Mapping[str, Any]) -> set[str]:
    """The names of the claim's requests that ask ``adminAccess`` (only an exact request can)."""
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    return {
        str(r.get("name"))
        for r in requests
        if isinstance(r, Mapping) and ((r.get("exactly") or {}).get("adminAccess") is True)
    }


def claim_devices(
    claim: Mapping[str, Any],
    driver: str,
    uid: str = "",
    memory: CapacityPolicy = MEMORY_POLICY,
    compute: CapacityPolicy = COMPUTE_POLICY,
) -> list[ClaimDevice]:
    """This driver's devices in the claim's allocation (``status.allocation.devices.results``),
    each with its consumed memory and compute rounded up to ``memory`` and ``compute``;
    ClaimError when the claim is another one than asked (``uid``), not allocated, or says
    something this driver cannot read, or asks ``adminAccess`` (docs/dra.md: a claim here is
    a limited share of a GPU; access to a GPU beside its users, for monitoring, is not
    offered, so such a claim fails rather than being prepared as a share it did not ask for).
    """
    meta = claim.get("metadata") or {}
    ref = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
    if uid and meta.get("uid") != uid:
        raise ClaimError(f"claim {ref}: UID {meta.get('uid')!r} is not the kubelet's {uid!r}")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ref} is not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    admin = _admin_requests(claim)
    out: list[ClaimDevice] = []
    for r in results:
        if r.get("driver") != driver:
            continue
        for key in ("request", "pool", "device"):
            if not isinstance(r.get(key), str) or not r[key]:
                raise ClaimError(f"claim {ref}: an allocation result has no {key}")
        if r.get("adminAccess") is True or r["request"].split("/")[0] in admin:
            raise ClaimError(
                f"claim {ref}: request {r['request']} asks adminAccess to device {r['device']};"
                f" driver {driver} grants only limited shares of a GPU and offers no"
                " admin (monitoring) access"
            )
        consumed = r.get("consumedCapacity")
        if not isinstance(consumed, Mapping):
            consumed = {}
        where = f"claim {ref}, device {r['device']}"
        mem = _consumed(consumed, MEMORY, memory, where)
        share = _consumed(consumed, COMPUTE, compute, where)
        if share > 100:
            raise ClaimError(f"claim {ref}: compute {share} is outside 1..100")
        out.append(
            ClaimDevice(
                r["request"], r["pool"], r["device"], mem, share, str(r.get("shareID") or "")
            )
        )
    if not out:
        raise ClaimError(f"claim {ref} has no device of driver {driver}")
    return out


class Promise(Protocol):
    """What a claim holds of one GPU: memory in bytes, compute in percent (0: all of it)."""

    @property
    def uuid(self) -> str: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def compute_percent(self) -> int: ...
    @property
    def promised_percent(self) -> int: ...


def check_fits(
    ref: str,
    totals: Mapping[str, int],
    prepared: Iterable[Promise],
    new: Iterable[Promise],
) -> None:
    """ClaimError unless, on every GPU the new claim uses, what the prepared claims promise
    plus what the new one asks stays within the GPU (``totals``: its memory in bytes; compute
    100 %). The scheduler keeps these sums too; this holds them when it did not (a bug, a
    stale slice, consumable capacity off), so the node never promises more than it has."""

    def percent(p: Promise) -> int:  # a guarantee is what is promised; else the cap
        return p.promised_percent or 100

    asked_mem: dict[str, int] = {}
    asked_cpu: dict[str, int] = {}
    for p in new:
        asked_mem[p.uuid] = asked_mem.get(p.uuid, 0) + p.memory_bytes
        asked_cpu[p.uuid] = asked_cpu.get(p.uuid, 0) + percent(p)
    held_mem = dict.fromkeys(asked_mem, 0)
    held_cpu = dict.fromkeys(asked_mem, 0)
    for p in prepared:
        if p.uuid in held_mem:
            held_mem[p.uuid] += p.memory_bytes
            held_cpu[p.uuid] += percent(p)
    for uuid in sorted(asked_mem):
        total = totals.get(uuid, 0)
        if held_mem[uuid] + asked_mem[uuid] > total:
            raise ClaimError(
                f"claim {ref}: GPU {uuid} has {format_bytes(total)} of memory; prepared claims"
                f" promise {format_bytes(held_mem[uuid])} and this one asks"
                f" {format_bytes(asked_mem[uuid])}"
            )
        if held_cpu[uuid] + asked_cpu[uuid] > 100:
            raise ClaimError(
                f"claim {ref}: GPU {uuid} has 100% of compute; prepared claims promise"
                f" {held_cpu[uuid]}% and this one asks {asked_cpu[uuid]}%"
            )


def allocation_id(claim_uid: str) -> str:
    """The allocation id of a claim's grant: fixed by the claim, so preparing it again (a
    kubelet retry, a plugin restart) finds the same files."""
    aid = f"dra-{claim_uid.lower()}"
    if not re.match(r"^[a-z0-9][a-z0-9-]{0,123}[a-z0-9]$", aid):
        raise ClaimError(f"claim UID {claim_uid!r} is not a UID")
    return aid
