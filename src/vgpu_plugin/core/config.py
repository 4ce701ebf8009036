"""The plugin's configuration: typed values, the YAML file's parsing, and which sharing applies
to each GPU.

The file's keys, types, defaults and ranges live in ``schema.SCHEMA``; this module turns the
validated tree into frozen values and checks what spans several keys.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from vgpu_plugin.core import cdi, defaults
from vgpu_plugin.core.schema import FLAG_MATCHES, SCHEMA, resource_name_problem, show
from vgpu_plugin.core.validate import check_tree
from vgpu_plugin.core.yamltext import YamlProblem, load_yaml

if TYPE_CHECKING:
    from vgpu_plugin.core.devices import PhysicalGpu

SharingValue = int | float | str


@dataclass(frozen=True)
class Sharing:
    """How one GPU is split; ``compute`` is ``"none"``, ``"proportional"``, ``"guaranteed"``
    or a percent; ``compute_limit``: the cap of a ``guaranteed`` container (docs/compute.md)."""

    split_count: int = 10
    memory_scaling: float = 1.0
    compute: str | int = "none"
    placement: str = "binpack"
    compute_limit: int = 100

    @property
    def oversubscribed(self) -> bool:
        """Slices promise more memory than the GPU has; the shim backs the excess with host RAM."""
        return self.memory_scaling > 1


SHARING_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "splitCount": "split_count",
        "memoryScaling": "memory_scaling",
        "compute": "compute",
        "computeLimit": "compute_limit",
        "placement": "placement",
    }
)


@dataclass(frozen=True)
class Match:
    """Which GPUs an override applies to. Every criterion given must hold; an empty tuple is
    no criterion. Node names and GPU models are glob patterns (models compared in any case)."""

    node_names: tuple[str, ...] = ()
    node_labels: tuple[tuple[str, str], ...] = ()
    gpu_models: tuple[str, ...] = ()
    gpu_uuids: tuple[str, ...] = ()

    def is_empty(self) -> bool:
        return not (self.node_names or self.node_labels or self.gpu_models or self.gpu_uuids)

    def matches(self, node_name: str, node_labels: Mapping[str, str], gpu: PhysicalGpu) -> bool:
        if self.node_names and not any(fnmatchcase(node_name, p) for p in self.node_names):
            return False
        if any(node_labels.get(key) != value for key, value in self.node_labels):
            return False
        model = gpu.name.lower()
        if self.gpu_models and not any(fnmatchcase(model, p.lower()) for p in self.gpu_models):
            return False
        uuids = {u.lower() for u in self.gpu_uuids}
        return not uuids or gpu.uuid.lower() in uuids


def _no_changes() -> Mapping[str, SharingValue]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Override:
    """A partial ``Sharing`` for the GPUs ``match`` selects: only the keys given (by ``Sharing``
    field name, e.g. ``split_count``) replace the base values."""

    match: Match
    sharing: Mapping[str, SharingValue] = field(default_factory=_no_changes)

    def __post_init__(self) -> None:
        names = {f.name for f in dataclasses.fields(Sharing)}
        unknown = sorted(set(self.sharing) - names)
        if unknown:
            raise ValueError(f"Override.sharing: unknown Sharing fields {unknown}")
        # A read-only view: the override is frozen, and so must be what it changes.
        object.__setattr__(self, "sharing", MappingProxyType(dict(self.sharing)))

    def __hash__(self) -> int:
        # Explicit, as a mapping proxy has no hash; keeps Config usable as a cache key.
        return hash((self.match, tuple(sorted(self.sharing.items()))))

    def apply(self, base: Sharing) -> Sharing:
        changes: dict[str, Any] = dict(self.sharing)
        return dataclasses.replace(base, **changes)


@dataclass(frozen=True)
class HealthConfig:
    ignored_xids: tuple[int, ...] = (13, 31, 43, 45, 68, 109)
    recovery_seconds: float = 60.0


@dataclass(frozen=True)
class DraConfig:
    """The DRA driver (docs/dra.md): whether it runs, its name, its GPUs (globs of UUIDs or
    indexes), and the request policies of the memory (bytes) and compute (percent) capacities."""

    enabled: bool = False
    driver_name: str = "gpu.vgpu-plugin.io"
    gpus: tuple[str, ...] = ("all",)
    memory: tuple[int, int, int] = (1 << 30, 1 << 30, 256 << 20)  # default, minimum, step
    compute: tuple[int, int, int] = (10, 1, 1)
    compute_limit: int | None = None  # set: a claim's compute is a guarantee, this its cap

    def serves(self, gpu: PhysicalGpu) -> bool:
        """Whether ``gpu`` is the DRA driver's (else the device plugin's)."""
        if not self.enabled:
            return False
        return any(
            p == "all" or fnmatchcase(gpu.uuid, p) or fnmatchcase(str(gpu.index), p)
            for p in self.gpus
        )


@dataclass(frozen=True)
class Config:
    version: str = "v1"
    resource_name: str = defaults.RESOURCE_NAME
    sharing: Sharing = Sharing()
    overrides: tuple[Override, ...] = ()
    host_root: str = defaults.HOST_ROOT
    health: HealthConfig = HealthConfig()
    # How Allocate names the GPUs to the runtime (core/cdi.py), and the driver's own limit.
    device_list_strategy: tuple[str, ...] = cdi.DEFAULT_STRATEGIES
    driver_memory_limit: bool = True
    # From NVIDIA's time-slicing format: Allocate refuses containers asking for several slices.
    fail_requests_greater_than_one: bool = False
    # From NVIDIA's flags: false makes serve wait instead of exiting when NVML cannot start.
    fail_on_init_error: bool = True
    # NVIDIA's flags given that have no effect here, one line each (check-config prints them).
    ignored_flags: tuple[str, ...] = ()
    dra: DraConfig = DraConfig()


# The most errors a ConfigError's text lists (all stay in ``errors``): a file of 60,000 bad
# keys must not make a log line of 60,000 lines.
SHOWN_ERRORS = 20


class ConfigError(ValueError):
    """The config is invalid. ``errors`` holds every problem as ``path: message``."""

    def __init__(self, errors: Sequence[str], source: str = "<config>") -> None:
        self.errors = list(errors)
        self.source = source
        if len(self.errors) == 1:
            text = f"{source}: {self.errors[0]}"
        else:
            shown = [f"  {e}" for e in self.errors[:SHOWN_ERRORS]]
            if len(self.errors) > SHOWN_ERRORS:
                shown.append(f"  ... and {len(self.errors) - SHOWN_ERRORS} more")
            text = f"{source}: {len(self.errors)} errors:\n" + "\n".join(shown)
        super().__init__(text)


# A ConfigMap holds at most 1 MiB; anything larger is not a config.
MAX_FILE_BYTES = 1 << 20


class UnreadableFile(ValueError):
    """A file cannot be read as text; the message says why (not the path: callers add it)."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def read_text_file(path: str | Path, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file at ``path`` (symlinks followed), never blocking:
    a FIFO, a directory or a device is refused rather than read, and so is a file over
    ``limit`` bytes. Raises :class:`UnreadableFile`."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise UnreadableFile(f"cannot read the file: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise UnreadableFile(f"not a regular file ({kind})")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise UnreadableFile(f"cannot read the file: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise UnreadableFile(f"larger than {limit} bytes")
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def default_config() -> Config:
    return Config()


def parse_config(text: str, source: str = "<config>") -> Config:
    """The config in YAML ``text``, or :class:`ConfigError` listing everything wrong with it."""
    try:
        data = load_yaml(text)
    except YamlProblem as exc:
        raise ConfigError([str(exc)], source) from None
    if data is None:
        raise ConfigError(
            ["top level: the file is empty (a config needs at least version: v1)"], source
        )
    errors: list[str] = []
    tree = check_tree(data, errors)
    config = _build(tree, errors)
    if errors:
        raise ConfigError(errors, source)
    return config


def load_config(path: str | Path) -> Config:
    """Read and parse the file at ``path``; a symlink (ConfigMap mounts swap one) is followed."""
    try:
        text = read_text_file(path)
    except UnreadableFile as exc:
        raise ConfigError([str(exc)], str(path)) from None
    return parse_config(text, str(path))


def matching_override(
    config: Config, node_name: str, node_labels: Mapping[str, str], gpu: PhysicalGpu
) -> int | None:
    """The index of the first override that matches ``gpu`` on this node, or None."""
    for i, override in enumerate(config.overrides):
        if override.match.matches(node_name, node_labels, gpu):
            return i
    return None


def sharing_for(
    config: Config, node_name: str, node_labels: Mapping[str, str], gpu: PhysicalGpu
) -> Sharing:
    """The sharing for ``gpu``: the first matching override merged over ``config.sharing``."""
    i = matching_override(config, node_name, node_labels, gpu)
    return config.sharing if i is None else config.overrides[i].apply(config.sharing)


def _sharing_changes(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {SHARING_KEYS[key]: value for key, value in tree.items() if key in SHARING_KEYS}


def _build(tree: Mapping[str, Any], errors: list[str]) -> Config:
    """Frozen values from the validated tree, checking what spans several keys."""
    resource = tree.get("resourceName", Config.resource_name)
    sharing_tree: Mapping[str, Any] = tree.get("sharing", {})
    changes = _sharing_changes(sharing_tree)
    fail_over_one = False
    sliced = sharing_tree.get("timeSlicing")
    if sliced is not None:
        fail_over_one = sliced.get("failRequestsGreaterThanOne", False)
        replicated = _time_slicing(sliced, errors)
        if replicated is not None:
            name, replicas = replicated
            if "resourceName" in tree and tree["resourceName"] != name:
                errors.append(
                    f"resourceName: {resource!r} conflicts with sharing.timeSlicing, which names"
                    f" {name!r}; set one of them"
                )
            if "splitCount" in sharing_tree:
                errors.append(
                    "sharing.splitCount: cannot be combined with sharing.timeSlicing,"
                    " whose replicas set the split"
                )
            resource, changes["split_count"] = name, replicas
    items = tree.get("overrides", [])
    overrides = tuple(_override(i, item, errors) for i, item in enumerate(items))
    health = tree.get("health", {})
    defaults = HealthConfig()
    flags: Mapping[str, Any] = tree.get("flags", {})
    fail_on_init = flags.get("failOnInitError")
    return Config(
        version=tree.get("version", Config.version),
        resource_name=resource,
        sharing=dataclasses.replace(Sharing(), **changes),
        overrides=overrides,
        host_root=tree.get("hostRoot", Config.host_root),
        health=HealthConfig(
            ignored_xids=health.get("ignoredXids", defaults.ignored_xids),
            recovery_seconds=health.get("recoverySeconds", defaults.recovery_seconds),
        ),
        fail_requests_greater_than_one=fail_over_one,
        device_list_strategy=tree.get("deviceListStrategy", Config.device_list_strategy),
        driver_memory_limit=tree.get("driverMemoryLimit", Config.driver_memory_limit),
        fail_on_init_error=True if fail_on_init is None else fail_on_init,
        ignored_flags=_ignored_flags(flags),
        dra=_dra(tree.get("dra", {}), errors),
    )


def _dra(tree: Mapping[str, Any], errors: list[str]) -> DraConfig:
    base = DraConfig()
    policies = []
    for key, names, default in (
        ("memory", ("default", "minimum", "step"), base.memory),
        ("compute", ("default", "minimum", "step"), base.compute),
    ):
        sub = tree.get(key, {})
        d, lo, step = (sub.get(n, v) for n, v in zip(names, default, strict=True))
        if d < lo or (d - lo) % step:
            errors.append(
                f"dra.{key}.default: {d} must be minimum ({lo}) plus a multiple of step ({step})"
            )
        policies.append((d, lo, step))
    return DraConfig(
        enabled=tree.get("enabled", base.enabled),
        driver_name=tree.get("driverName", base.driver_name),
        gpus=tuple(tree.get("gpus", base.gpus)),
        memory=policies[0],
        compute=policies[1],
        compute_limit=tree.get("computeLimit", base.compute_limit),
    )


_NO_MATCH = object()


def _ignored_flags(flags: Mapping[str, Any], prefix: str = "flags") -> tuple[str, ...]:
    """``path: value: ignored (why)`` for every NVIDIA flag given that has no effect here."""
    why = {spec.path: spec.ignored_why for spec in SCHEMA if spec.ignored_why}
    out: list[str] = []
    for key, value in flags.items():
        path = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.extend(_ignored_flags(value, path))
        elif value is not None and path in why and FLAG_MATCHES.get(path, _NO_MATCH) != value:
            shown = ", ".join(value) if isinstance(value, tuple) else show(value)
            out.append(f"{path}: {shown}: ignored ({why[path]})")
    return tuple(out)


def _time_slicing(sliced: Mapping[str, Any], errors: list[str]) -> tuple[str, int] | None:
    """(resource name, replicas) of NVIDIA's time-slicing block, or None when it is invalid."""
    resources: list[dict[str, Any]] | None = sliced.get("resources")
    if resources is None:
        return None  # reported as required
    if len(resources) != 1:
        errors.append(
            "sharing.timeSlicing.resources: must list exactly one resource (vgpu-plugin serves"
            f" one resource), got {len(resources)}"
        )
        return None
    first = resources[0]
    if "name" not in first or "replicas" not in first:
        return None  # reported by the walk
    name: str = first.get("rename", "")
    if not name:
        name = first["name"] + (".shared" if sliced.get("renameByDefault", False) else "")
        problem = resource_name_problem(name)
        if problem is not None:
            errors.append(f"sharing.timeSlicing.renameByDefault: {problem}, got {name!r}")
            return None
    return name, first["replicas"]


def _override(i: int, item: Mapping[str, Any], errors: list[str]) -> Override:
    where = f"overrides[{i}]"
    match_tree: Mapping[str, Any] = item.get("match", {})
    match = Match(
        node_names=match_tree.get("nodeNames", ()),
        node_labels=match_tree.get("nodeLabels", ()),
        gpu_models=match_tree.get("gpuModels", ()),
        gpu_uuids=match_tree.get("gpuUUIDs", ()),
    )
    if "match" in item and match.is_empty() and not _has_bad_keys(errors, f"{where}.match"):
        # An empty match would catch every GPU and silently shadow the overrides after it.
        errors.append(
            f"{where}.match: must name at least one of nodeNames, nodeLabels, gpuModels, gpuUUIDs"
        )
    return Override(match=match, sharing=_sharing_changes(item.get("sharing", {})))


def _has_bad_keys(errors: list[str], prefix: str) -> bool:
    """Whether an error was already reported under ``prefix`` (so the match is not 'empty')."""
    return any(e.startswith(prefix + ".") or e.startswith(prefix + ":") for e in errors)
