"""The config file's schema as one table: every key, its type, default, range and meaning.

The validator walks this table, and the docs' reference is compared with it, so the two cannot
drift. Leaf keys carry a ``check`` that turns a raw YAML value into a clean one or raises
:class:`Invalid` with a message that shows the bad value.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vgpu_plugin.core import cdi, defaults

SPLIT_MAX = 256


class Invalid(Exception):
    """A value broke its key's rule; ``where`` narrows the path (``[2]``, ``.zone``)."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.where = where


Check = Callable[[object], object]


@dataclass(frozen=True)
class KeySpec:
    """One key of the config file.

    ``path`` is dotted, with ``[]`` for list items (``overrides[].match.gpuModels``). ``type`` and
    ``allowed`` are worded for the docs. ``default`` is the value used when the key is absent
    (``None`` when there is none). Maps and lists of maps have no ``check``: the validator
    descends into them. ``same_keys_as`` makes a map accept the leaf keys of another map.
    """

    path: str
    type: str
    default: object
    allowed: str
    description: str
    required: bool = False
    same_keys_as: str = ""
    check: Check | None = field(default=None, compare=False, repr=False)
    # For NVIDIA's flags that have no effect here: why (check-config reports them).
    ignored_why: str = ""

    @property
    def is_container(self) -> bool:
        return self.check is None

    @property
    def default_text(self) -> str:
        """The default as YAML writes it (``[13, 31]``, ``true``); empty when there is none."""
        return "" if self.default is None else yaml_text(self.default)

    @property
    def key(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        return self.path.rsplit(".", 1)[0] if "." in self.path else ""


SHOWN_CHARS = 60


def clip(value: object) -> str:
    """``repr(value)``, cut to about 60 characters: an error quotes a 10 MB value by its start
    and its length, never whole."""
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    return (
        text
        if len(text) <= SHOWN_CHARS + 20
        else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
    )


def show(value: object) -> str:
    """A raw value as an error message quotes it, in YAML's words for null and booleans."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return "a map" if isinstance(value, dict) else "a list"
    return clip(value)


def yaml_text(value: object) -> str:
    """A plain value in YAML flow style, as the docs show defaults."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    return str(value)


def _words(choices: tuple[str, ...]) -> str:
    if len(choices) == 1:
        return choices[0]
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def one_of(*choices: str) -> Check:
    def check(value: object) -> object:
        if value not in choices or not isinstance(value, str):
            raise Invalid(f"must be {_words(choices)}, got {show(value)}")
        return value

    return check


def _is_int(value: object) -> bool:
    # YAML booleans load as bool, a subclass of int: `splitCount: true` must not read as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def int_in(lo: int, hi: int) -> Check:
    def check(value: object) -> object:
        if not _is_int(value):
            raise Invalid(f"must be an integer {lo}..{hi}, got {show(value)}")
        assert isinstance(value, int)
        if not lo <= value <= hi:
            raise Invalid(f"must be {lo}..{hi}, got {value}")
        return value

    return check


def number_above(lo: float, inclusive: bool) -> Check:
    rule = f">= {lo:g}" if inclusive else f"> {lo:g}"

    def check(value: object) -> object:
        if not (_is_int(value) or isinstance(value, float)):
            raise Invalid(f"must be a number {rule}, got {show(value)}")
        assert isinstance(value, (int, float))
        number = float(value)
        if not math.isfinite(number) or number < lo or (number == lo and not inclusive):
            raise Invalid(f"must be a number {rule}, got {show(value)}")
        return number

    return check


_PERCENT = re.compile(r"^([0-9]{1,3})\s*%$")


def compute(value: object) -> object:
    """``none``, ``proportional``, ``guaranteed`` or a percent per slice: ``30`` or ``"30%"``."""
    bad = Invalid(f"must be none, proportional, guaranteed or a percent 1..100, got {show(value)}")
    if value in ("none", "proportional", "guaranteed") and isinstance(value, str):
        return value
    if isinstance(value, str) and (m := _PERCENT.match(value.strip())):
        value = int(m.group(1))
    if not _is_int(value):
        raise bad
    assert isinstance(value, int)
    if not 1 <= value <= 100:
        raise bad
    return value


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def resource_name_problem(name: str) -> str | None:
    """Why ``name`` is not a Kubernetes extended resource name this plugin may advertise, or
    None when it is one."""
    domain, slash, short = name.partition("/")
    if not slash or not domain or not short:
        return "must be <domain>/<name> (e.g. nvidia.com/gpu)"
    if short.lower().startswith("mig-"):
        # NVIDIA's MIG resources (nvidia.com/mig-1g.5gb) name GPU instances; ours would be
        # slices of whole GPUs, and pods asking for a MIG profile would get something else.
        return (
            "is a MIG resource name; vgpu-plugin splits whole GPUs and serves no MIG devices"
            " (use nvidia.com/gpu or a name of your own)"
        )
    if len(domain) > 253 or not _DOMAIN.match(domain):
        return f"domain {domain!r} is not a DNS subdomain (lowercase letters, digits, - and .)"
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return "the kubernetes.io domain is reserved for Kubernetes' own resources"
    if len(short) > 63 or not _NAME.match(short):
        return (
            f"name {short!r} must be 1..63 letters, digits, -, _ or ., "
            "starting and ending with a letter or digit"
        )
    return None


def resource_name(value: object) -> object:
    if not isinstance(value, str):
        raise Invalid(f"must be <domain>/<name> (e.g. nvidia.com/gpu), got {show(value)}")
    problem = resource_name_problem(value)
    if problem is not None:
        raise Invalid(f"{problem}, got {show(value)}")
    return value


def nvidia_resource_name(value: object) -> object:
    """NVIDIA's plugin reads a bare name as one under ``nvidia.com/``; so do we."""
    if isinstance(value, str) and "/" not in value:
        value = "nvidia.com/" + value
    return resource_name(value)


def absolute_path(value: object) -> object:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise Invalid(f"must be an absolute path, got {show(value)}")
    return posixpath.normpath(value)


def boolean(value: object) -> object:
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {show(value)}")
    return value


def optional(check: Check) -> Check:
    """``check``, letting null through as not given (NVIDIA's flags are Go pointers: null is
    the same as leaving the key out)."""

    def checked(value: object) -> object:
        return None if value is None else check(value)

    return checked


def text(value: object) -> object:
    if not isinstance(value, str):
        raise Invalid(f"must be a string, got {show(value)}")
    return value


def text_or_number(value: object) -> object:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise Invalid(f"must be a string or a number, got {show(value)}")
    return value


def strategies(*choices: str) -> Check:
    """One strategy or a list of them, each one of ``choices``; cleaned to a tuple."""
    each = one_of(*choices)

    def check(value: object) -> object:
        items = value if isinstance(value, list) else [value]
        if not items:
            raise Invalid(f"must be {_words(choices)} or a list of them, got an empty list")
        for i, item in enumerate(items):
            try:
                each(item)
            except Invalid as exc:
                raise Invalid(exc.message, f"[{i}]" if isinstance(value, list) else "") from None
        return tuple(items)

    return check


def mig_strategy(value: object) -> object:
    if value in ("single", "mixed"):
        raise Invalid(
            f"vgpu-plugin splits whole GPUs and serves no MIG devices: must be none, got"
            f" {show(value)}"
        )
    return one_of("none")(value)


def string_list(value: object) -> object:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise Invalid(f"must be a list of strings, got {show(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise Invalid(f"must be a non-empty string (quote it), got {show(item)}", f"[{i}]")
    return tuple(value)


def string_map(value: object) -> object:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise Invalid(f"must be a map of strings to strings, got {show(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise Invalid(f"keys must be non-empty strings, got {show(key)}")
        if not isinstance(item, str):
            # `ready: true` loads as a boolean; a label value is always a string.
            raise Invalid(f"must be a string (quote it), got {show(item)}", f".{key}")
    return tuple(sorted(value.items()))


def xid_list(value: object) -> object:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise Invalid(f"must be a list of XID numbers, got {show(value)}")
    for i, item in enumerate(value):
        if not _is_int(item) or item < 0:
            raise Invalid(f"must be an integer >= 0, got {show(item)}", f"[{i}]")
    return tuple(sorted(set(value)))


def device_list_strategy(value: object) -> object:
    """NVIDIA's names, one (``volume-mounts``) or several (a list, or comma-separated)."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        items: str | list[str] = value
    elif isinstance(value, str):
        items = value
    else:
        raise Invalid(f"must be a strategy name or a list of them, got {show(value)}")
    try:
        return cdi.parse_strategies(items)
    except ValueError as exc:
        raise Invalid(str(exc)) from None


def _dns_subdomain(value: object) -> object:
    if not isinstance(value, str) or not re.match(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$", value):
        raise Invalid(f"{show(value)} is not a lowercase DNS subdomain (e.g. gpu.example.com)")
    if "." not in value:
        raise Invalid(f"{show(value)} needs a domain (e.g. gpu.example.com)")
    return value


def _bytes_quantity(value: object) -> object:
    """A byte size as Kubernetes writes it (``256Mi``, ``1Gi``) or a plain number of bytes."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    m = re.match(r"^([1-9][0-9]*)(Ki|Mi|Gi|Ti)?$", text) if isinstance(text, str) else None
    if m is None:
        raise Invalid(f"{show(value)} is not a size (e.g. 256Mi, 1Gi, or bytes)")
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]


def _gpu_selectors(value: object) -> object:
    items = string_list(value)
    assert isinstance(items, tuple)
    return items


def _leaf(
    path: str,
    type_: str,
    default: object,
    allowed: str,
    description: str,
    check: Check,
    required: bool = False,
) -> KeySpec:
    return KeySpec(path, type_, default, allowed, description, required=required, check=check)


_NVIDIA_FLAG = "NVIDIA device plugin flag"
_IGNORED = "Accepted and ignored (check-config lists it):"


_Kind = tuple[str, str, Check]  # type, allowed, check


def _flag(path: str, kind: _Kind, why: str) -> KeySpec:
    type_, allowed, check = kind
    description = f"{_NVIDIA_FLAG}. {_IGNORED} {why}"
    return KeySpec(path, type_, None, allowed, description, check=optional(check), ignored_why=why)


_BOOL: _Kind = ("boolean", "true | false", boolean)
_TEXT: _Kind = ("string", "", text)
_GFD = "gpu-feature-discovery's, not a device plugin's."

NVIDIA_FLAGS: tuple[KeySpec, ...] = (
    KeySpec(
        "flags",
        "map",
        None,
        "",
        "NVIDIA device plugin's flags block (its config file v1), accepted so that its configs"
        " load unchanged; the flags that mean something here are honoured, check-config lists"
        " the others as ignored.",
    ),
    _leaf(
        "flags.migStrategy",
        "string",
        None,
        "none",
        f"{_NVIDIA_FLAG}, honoured: none is what vgpu-plugin does (whole GPUs); single and"
        " mixed are refused, as no MIG device is served.",
        optional(mig_strategy),
    ),
    _leaf(
        "flags.failOnInitError",
        "boolean",
        True,
        "true | false",
        f"{_NVIDIA_FLAG}, honoured: false makes serve wait (advertising nothing) instead of"
        " exiting when NVML cannot be initialised.",
        optional(boolean),
    ),
    _flag(
        "flags.restartOnDeviceUnhealthy",
        _BOOL,
        "unhealthy GPUs are advertised Unhealthy and come back by themselves.",
    ),
    _flag(
        "flags.nvidiaDriverRoot",
        _TEXT,
        "the plugin loads NVML from its image's library path and passes no device nodes.",
    ),
    _flag("flags.nvidiaDevRoot", _TEXT, "no device nodes are passed (the runtime does it)."),
    _flag("flags.mpsRoot", _TEXT, "MPS is not used."),
    _flag("flags.gdsEnabled", _BOOL, "no GPUDirect Storage devices are passed."),
    _flag("flags.mofedEnabled", _BOOL, "no MOFED devices are passed."),
    _flag("flags.gdrcopyEnabled", _BOOL, "no gdrcopy devices are passed."),
    _flag("flags.useNodeFeatureAPI", _BOOL, _GFD),
    _flag(
        "flags.deviceDiscoveryStrategy",
        _TEXT,
        "GPUs are always found through NVML.",
    ),
    KeySpec("flags.plugin", "map", None, "", "NVIDIA device plugin's own flags."),
    _flag(
        "flags.plugin.passDeviceSpecs",
        _BOOL,
        "no device specs are passed; the NVIDIA runtime mounts the GPUs (false is what happens).",
    ),
    _flag(
        "flags.plugin.deviceListStrategy",
        (
            "string or list of strings",
            "envvar | volume-mounts | cdi-annotations | cdi-cri",
            strategies("envvar", "volume-mounts", "cdi-annotations", "cdi-cri"),
        ),
        "the GPUs are always passed as NVIDIA_VISIBLE_DEVICES (envvar is what happens).",
    ),
    _flag(
        "flags.plugin.deviceIDStrategy",
        ("string", "uuid | index", one_of("uuid", "index")),
        "NVIDIA_VISIBLE_DEVICES always names GPUs by UUID (uuid is what happens).",
    ),
    _flag("flags.plugin.cdiAnnotationPrefix", _TEXT, "CDI is not used."),
    _flag("flags.plugin.nvidiaCTKPath", _TEXT, "CDI is not used."),
    _flag("flags.plugin.containerDriverRoot", _TEXT, "no driver files are passed."),
    KeySpec("flags.gfd", "map", None, "", "gpu-feature-discovery's flags."),
    _flag("flags.gfd.oneshot", _BOOL, _GFD),
    _flag("flags.gfd.noTimestamp", _BOOL, _GFD),
    _flag("flags.gfd.sleepInterval", ("string or number", "", text_or_number), _GFD),
    _flag("flags.gfd.outputFile", _TEXT, _GFD),
    _flag("flags.gfd.machineTypeFile", _TEXT, _GFD),
)

# The value of an ignored flag at which vgpu-plugin does what the flag asks anyway; a flag
# given with another value (or any value, for those not here) is reported as ignored.
FLAG_MATCHES: Mapping[str, object] = {
    "flags.plugin.passDeviceSpecs": False,
    "flags.plugin.deviceListStrategy": ("envvar",),
    "flags.plugin.deviceIDStrategy": "uuid",
}

_RESOURCE = "<domain>/<name>"

SCHEMA: tuple[KeySpec, ...] = (
    _leaf(
        "version",
        "string",
        None,
        "v1",
        "Schema version of this file.",
        one_of("v1"),
        required=True,
    ),
    _leaf(
        "resourceName",
        "string",
        defaults.RESOURCE_NAME,
        _RESOURCE,
        "Extended resource the slices are advertised as; pods request it in their limits.",
        resource_name,
    ),
    KeySpec("sharing", "map", None, "", "How every GPU of the node is split."),
    _leaf(
        "sharing.splitCount",
        "integer",
        10,
        f"1..{SPLIT_MAX}",
        "Virtual device IDs (slices) per physical GPU.",
        int_in(1, SPLIT_MAX),
    ),
    _leaf(
        "sharing.memoryScaling",
        "number",
        1.0,
        "> 0",
        "Per-slice memory = GPU memory x memoryScaling / splitCount (whole MiB, rounded down);"
        " above 1 oversubscribes, backed by host memory.",
        number_above(0.0, inclusive=False),
    ),
    _leaf(
        "sharing.compute",
        "string or integer",
        "none",
        "none | proportional | guaranteed | 1..100",
        "Compute share per slice: none (not limited), proportional (capped at 100 / splitCount"
        " %, at least 1), guaranteed (at least 100 / splitCount % while others are busy, idle"
        " time lent up to computeLimit: docs/compute.md) or a percent cap (30 or '30%').",
        compute,
    ),
    _leaf(
        "sharing.computeLimit",
        "integer",
        100,
        "1..100",
        "With compute: guaranteed, the most of the GPU's time (percent) a container may use"
        " when others are idle; a guarantee above it is cut to it.",
        int_in(1, 100),
    ),
    _leaf(
        "sharing.placement",
        "string",
        "binpack",
        "binpack | spread",
        "Advice to the kubelet when a container asks for several slices: binpack (fewest and"
        " fullest GPUs) or spread (one slice per GPU, least used first).",
        one_of("binpack", "spread"),
    ),
    KeySpec(
        "sharing.timeSlicing",
        "map",
        None,
        "",
        "NVIDIA device plugin's time-slicing format, accepted as is: sets resourceName and"
        " splitCount, so it cannot be combined with either.",
    ),
    _leaf(
        "sharing.timeSlicing.renameByDefault",
        "boolean",
        False,
        "true | false",
        "Advertise the resource as <name>.shared unless it has its own rename.",
        boolean,
    ),
    _leaf(
        "sharing.timeSlicing.failRequestsGreaterThanOne",
        "boolean",
        False,
        "true | false",
        "Refuse containers that ask for more than one slice.",
        boolean,
    ),
    KeySpec(
        "sharing.timeSlicing.resources",
        "list of maps",
        None,
        "exactly one item",
        "The replicated resource; vgpu-plugin serves one resource, so exactly one.",
        required=True,
    ),
    _leaf(
        "sharing.timeSlicing.resources[].name",
        "string",
        None,
        f"{_RESOURCE} or <name>",
        "Resource to replicate; a bare name is taken as nvidia.com/<name>.",
        nvidia_resource_name,
        required=True,
    ),
    _leaf(
        "sharing.timeSlicing.resources[].rename",
        "string",
        None,
        f"{_RESOURCE} or <name>",
        "Name to advertise the slices under instead.",
        nvidia_resource_name,
    ),
    _leaf(
        "sharing.timeSlicing.resources[].replicas",
        "integer",
        None,
        f"1..{SPLIT_MAX}",
        "Slices per GPU (becomes splitCount).",
        int_in(1, SPLIT_MAX),
        required=True,
    ),
    _leaf(
        "sharing.timeSlicing.resources[].devices",
        "string",
        "all",
        "all",
        "Which GPUs to replicate; only all (every GPU of the node is split).",
        one_of("all"),
    ),
    KeySpec(
        "overrides",
        "list of maps",
        (),
        "",
        "Per node and per GPU changes to sharing; the first override that matches a GPU wins.",
    ),
    KeySpec(
        "overrides[].match",
        "map",
        None,
        "at least one key",
        "Which GPUs the override applies to: every key given must match (a list matches when"
        " any of its items does).",
        required=True,
    ),
    _leaf(
        "overrides[].match.nodeNames",
        "list of strings",
        None,
        "glob patterns",
        "Node names, e.g. gpu-a1 or 'gpu-a*'.",
        string_list,
    ),
    _leaf(
        "overrides[].match.nodeLabels",
        "map of strings",
        None,
        "",
        "Node labels that must all be present with these values.",
        string_map,
    ),
    _leaf(
        "overrides[].match.gpuModels",
        "list of strings",
        None,
        "glob patterns, any case",
        "GPU model names as NVML reports them, e.g. '*A100*'.",
        string_list,
    ),
    _leaf(
        "overrides[].match.gpuUUIDs",
        "list of strings",
        None,
        "",
        "GPU UUIDs, e.g. GPU-709fac35-5f40-624b-90f7-b0a3db7a97a0.",
        string_list,
    ),
    KeySpec(
        "overrides[].sharing",
        "map",
        None,
        "keys of sharing except timeSlicing",
        "The sharing keys to change for the matched GPUs; keys not given keep sharing's value.",
        required=True,
        same_keys_as="sharing",
    ),
    _leaf(
        "hostRoot",
        "string",
        defaults.HOST_ROOT,
        "absolute path",
        "Host directory holding the shim, ld.so.preload, limits files and per-container dirs.",
        absolute_path,
    ),
    _leaf(
        "deviceListStrategy",
        "string or list of strings",
        cdi.DEFAULT_STRATEGIES,
        " | ".join(cdi.STRATEGIES),
        "How Allocate names a container's GPUs to the runtime (NVIDIA's names; several at"
        " once allowed, envvar and volume-mounts excluded together). volume-mounts and the CDI"
        " strategies need the toolkit settings in docs/security.md; envvar lets any pod that"
        " sets NVIDIA_VISIBLE_DEVICES itself have every GPU unless the toolkit ignores it.",
        device_list_strategy,
    ),
    _leaf(
        "driverMemoryLimit",
        "boolean",
        True,
        "true | false",
        "Also set NVIDIA_GPU_MEMORY_REQUEST and NVIDIA_GPU_MEMORY_LIMIT (whole MiB), which the"
        " toolkit's apply-cuda-memory-limits hook hands to the driver, for containers where"
        " one limit fits all their GPUs and memory is not oversubscribed.",
        boolean,
    ),
    KeySpec("health", "map", None, "", "GPU health checking."),
    _leaf(
        "health.ignoredXids",
        "list of integers",
        (13, 31, 43, 45, 68, 109),
        ">= 0 each",
        "XID errors that do not mark a GPU unhealthy (application faults, not the GPU's).",
        xid_list,
    ),
    _leaf(
        "health.recoverySeconds",
        "number",
        60.0,
        ">= 0",
        "Seconds without a new critical XID after which an unhealthy GPU is healthy again.",
        number_above(0.0, inclusive=True),
    ),
    *NVIDIA_FLAGS,
    KeySpec("dra", "map", None, "", "The DRA driver (docs/dra.md): pods claim amounts of a GPU."),
    _leaf(
        "dra.enabled",
        "boolean",
        False,
        "true | false",
        "Serve the DRA driver for the GPUs in dra.gpus; the device plugin keeps the others.",
        boolean,
    ),
    _leaf(
        "dra.driverName",
        "string",
        "gpu.vgpu-plugin.io",
        "DNS subdomain",
        "The driver's name in ResourceSlices, DeviceClasses and claims.",
        _dns_subdomain,
    ),
    _leaf(
        "dra.gpus",
        "list of strings",
        ("all",),
        "all, or glob patterns",
        "GPUs served by DRA, by UUID or index ('0', 'GPU-709f*'); all: every GPU.",
        _gpu_selectors,
    ),
    KeySpec("dra.memory", "map", None, "", "The request policy of a GPU's memory capacity."),
    _leaf(
        "dra.memory.default",
        "string or integer",
        1 << 30,
        "size",
        "Memory a claim gets when it does not ask (also an extended-resource request's).",
        _bytes_quantity,
    ),
    _leaf(
        "dra.memory.minimum",
        "string or integer",
        1 << 30,
        "size",
        "The least memory a claim may ask for.",
        _bytes_quantity,
    ),
    _leaf(
        "dra.memory.step",
        "string or integer",
        256 << 20,
        "size",
        "A claim's memory is rounded up to minimum + a multiple of this.",
        _bytes_quantity,
    ),
    KeySpec("dra.compute", "map", None, "", "The request policy of a GPU's compute capacity."),
    _leaf(
        "dra.compute.default",
        "integer",
        10,
        "1..100",
        "Compute share (percent) a claim gets when it does not ask.",
        int_in(1, 100),
    ),
    _leaf(
        "dra.compute.minimum",
        "integer",
        1,
        "1..100",
        "The least compute a claim may ask for.",
        int_in(1, 100),
    ),
    _leaf(
        "dra.compute.step",
        "integer",
        1,
        "1..100",
        "A claim's compute is rounded up to this step.",
        int_in(1, 100),
    ),
    _leaf(
        "dra.computeLimit",
        "integer",
        None,
        "1..100",
        "Set: a claim's compute is a guarantee (idle time lent, docs/compute.md) and this the"
        " cap of every claim; unset: a claim's compute is its cap.",
        int_in(1, 100),
    ),
)


def children(path: str) -> Mapping[str, KeySpec]:
    """The keys allowed in the map at ``path`` (``""`` is the top level), by name."""
    return {spec.key: spec for spec in SCHEMA if spec.parent == path}


def spec_for(path: str) -> KeySpec | None:
    return next((spec for spec in SCHEMA if spec.path == path), None)
