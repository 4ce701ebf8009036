"""Config parsing, validation and per-GPU sharing (docs/contracts.md#configuration)."""

from __future__ import annotations

import os
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
from core import yaml_bombs

from vgpu_plugin.core.config import (
    Config,
    ConfigError,
    HealthConfig,
    Match,
    Override,
    Sharing,
    default_config,
    load_config,
    matching_override,
    parse_config,
    sharing_for,
)
from vgpu_plugin.core.devices import PhysicalGpu

A100 = PhysicalGpu(0, "GPU-aaaa-0001", "NVIDIA A100-SXM4-80GB", 81920 << 20, 0, "0000:01:00.0", 0)
H100 = PhysicalGpu(1, "GPU-bbbb-0002", "NVIDIA H100 80GB HBM3", 81559 << 20, 1, "0000:02:00.0", 1)


def parse(text: str) -> Config:
    """``text`` as a config, with ``version: v1`` first when it has none (tests of other keys)."""
    text = textwrap.dedent(text)
    if not any(line.startswith("version:") for line in text.splitlines()):
        text = "version: v1\n" + text
    return parse_config(text)


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse(text)
    return caught.value.errors


def test_design_example_parses_to_the_values_written() -> None:
    config = parse(
        """
        version: v1
        resourceName: nvidia.com/gpu
        sharing:
          splitCount: 10
          memoryScaling: 1.0
          compute: none
          placement: binpack
        overrides:
          - match: {nodeNames: [gpu-a1], nodeLabels: {k: v}, gpuModels: ["*A100*"],
                    gpuUUIDs: [GPU-aaaa-0001]}
            sharing: {splitCount: 4}
        hostRoot: /usr/local/vgpu
        """
    )
    assert config.sharing == Sharing(10, 1.0, "none", "binpack")
    assert config.overrides == (
        Override(
            Match(("gpu-a1",), (("k", "v"),), ("*A100*",), ("GPU-aaaa-0001",)),
            {"split_count": 4},
        ),
    )
    assert config.host_root == "/usr/local/vgpu"


def test_minimal_file_gives_the_defaults() -> None:
    assert parse("version: v1\n") == default_config()
    assert default_config() == Config(
        version="v1",
        resource_name="nvidia.com/gpu",
        sharing=Sharing(split_count=10, memory_scaling=1.0, compute="none", placement="binpack"),
        overrides=(),
        host_root="/usr/local/vgpu",
        health=HealthConfig(ignored_xids=(13, 31, 43, 45, 68, 109), recovery_seconds=60.0),
    )


def test_version_is_required() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("sharing: {splitCount: 3}\n")
    assert caught.value.errors == ["version: required"]


@pytest.mark.parametrize(
    ("yaml_text", "error"),
    [
        ("sharing: {splitCount: 0}", "sharing.splitCount: must be 1..256, got 0"),
        ("sharing: {splitCount: 257}", "sharing.splitCount: must be 1..256, got 257"),
        ("sharing: {splitCount: true}", "sharing.splitCount: must be an integer 1..256, got true"),
        ("sharing: {splitCount: 2.5}", "sharing.splitCount: must be an integer 1..256, got 2.5"),
        ("sharing: {splitCount: '4'}", "sharing.splitCount: must be an integer 1..256, got '4'"),
        ("sharing: {memoryScaling: 0}", "sharing.memoryScaling: must be a number > 0, got 0"),
        ("sharing: {memoryScaling: -1.5}", "sharing.memoryScaling: must be a number > 0, got -1.5"),
        ("sharing: {memoryScaling: .inf}", "sharing.memoryScaling: must be a number > 0, got inf"),
        ("sharing: {memoryScaling: no}", "sharing.memoryScaling: must be a number > 0, got false"),
        (
            "sharing: {compute: half}",
            "sharing.compute: must be none, proportional, guaranteed or a percent 1..100,"
            " got 'half'",
        ),
        (
            "sharing: {compute: 0}",
            "sharing.compute: must be none, proportional, guaranteed or a percent 1..100, got 0",
        ),
        (
            "sharing: {compute: 101}",
            "sharing.compute: must be none, proportional, guaranteed or a percent 1..100, got 101",
        ),
        ("sharing: {placement: pack}", "sharing.placement: must be binpack or spread, got 'pack'"),
        ("version: v2", "version: must be v1, got 'v2'"),
        ("version: 1", "version: must be v1, got 1"),
        ("hostRoot: usr/local", "hostRoot: must be an absolute path, got 'usr/local'"),
        ("health: {recoverySeconds: -1}", "health.recoverySeconds: must be a number >= 0, got -1"),
        (
            "health: {ignoredXids: [13, -2]}",
            "health.ignoredXids[1]: must be an integer >= 0, got -2",
        ),
        ("sharing: 4", "sharing: must be a map, got 4"),
        ("overrides: {a: 1}", "overrides: must be a list, got a map"),
    ],
)
def test_each_bad_value_is_reported_with_its_path_and_value(yaml_text: str, error: str) -> None:
    assert errors_of(yaml_text + "\n") == [error]


def test_override_errors_carry_the_item_index() -> None:
    errors = errors_of(
        """
        overrides:
          - match: {nodeNames: [a]}
            sharing: {splitCount: 2}
          - match: {nodeNames: [b]}
            sharing: {compute: half}
        """
    )
    assert errors == [
        "overrides[1].sharing.compute: must be none, proportional, guaranteed or a percent"
        " 1..100, got 'half'"
    ]


def test_every_error_is_collected_not_just_the_first() -> None:
    errors = errors_of(
        """
        version: v9
        resourceName: gpu
        sharing: {splitCount: 0, memoryScaling: 0, compute: half, placement: pack}
        hostRoot: relative
        """
    )
    assert [e.split(":")[0] for e in errors] == [
        "version",
        "resourceName",
        "sharing.splitCount",
        "sharing.memoryScaling",
        "sharing.compute",
        "sharing.placement",
        "hostRoot",
    ]


def test_config_error_text_lists_every_error_and_the_source() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("version: v1\nsharing: {splitCount: 0, placement: x}\n", source="cm.yaml")
    text = str(caught.value)
    assert text.startswith("cm.yaml: 2 errors:")
    for error in caught.value.errors:
        assert error in text


@pytest.mark.parametrize(
    ("yaml_text", "path", "suggestion"),
    [
        ("splitcount: 3", "splitcount", None),
        ("sharing: {splitcount: 3}", "sharing.splitcount", "splitCount"),
        ("sharing: {memScaling: 2}", "sharing.memScaling", None),
        (
            "overrides: [{match: {gpuModel: [x]}, sharing: {}}]",
            "overrides[0].match.gpuModel",
            "gpuModels",
        ),
        ("health: {ignoredXid: [1]}", "health.ignoredXid", "ignoredXids"),
        (
            "flags: {migStrategy: none, plugin: {passDeviceSpec: true}}",
            "flags.plugin.passDeviceSpec",
            "passDeviceSpecs",
        ),
    ],
)
def test_unknown_keys_are_rejected_by_name(
    yaml_text: str, path: str, suggestion: str | None
) -> None:
    errors = errors_of(yaml_text + "\n")
    assert any(e.startswith(f"{path}: unknown key") for e in errors), errors
    if suggestion is not None:
        assert any(f"did you mean {suggestion}?" in e for e in errors), errors


@pytest.mark.parametrize(
    "name", ["gpu", "nvidia.com/", "/gpu", "NVIDIA.com/gpu", "nvidia.com/-gpu", "kubernetes.io/gpu"]
)
def test_resource_names_must_be_domain_slash_name(name: str) -> None:
    errors = errors_of(f"resourceName: {name!r}\n")
    assert len(errors) == 1
    assert errors[0].startswith("resourceName: ")
    assert errors[0].endswith(f"got {name!r}")


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "nvidia.com/gpu.shared", "example.org/vgpu_2"])
def test_good_resource_names_pass(name: str) -> None:
    assert parse(f"resourceName: {name}\n").resource_name == name


def test_compute_accepts_a_percent_written_with_a_sign() -> None:
    assert parse("sharing: {compute: '30%'}\n").sharing.compute == 30
    assert parse("sharing: {compute: proportional}\n").sharing.compute == "proportional"


def test_integer_memory_scaling_reads_as_a_number() -> None:
    assert parse("sharing: {memoryScaling: 2}\n").sharing.memory_scaling == 2.0


def test_xids_are_deduplicated_and_sorted() -> None:
    assert parse("health: {ignoredXids: [68, 13, 68]}\n").health.ignored_xids == (13, 68)


def test_host_root_is_normalised() -> None:
    assert parse("hostRoot: /opt//vgpu/\n").host_root == "/opt/vgpu"


def test_empty_match_is_rejected() -> None:
    errors = errors_of("overrides: [{match: {}, sharing: {splitCount: 2}}]\n")
    assert errors == [
        "overrides[0].match: must name at least one of nodeNames, nodeLabels, gpuModels, gpuUUIDs"
    ]
    errors = errors_of("overrides: [{match: {nodeNames: []}, sharing: {splitCount: 2}}]\n")
    assert errors[0].startswith("overrides[0].match: must name at least one")


def test_override_needs_match_and_sharing() -> None:
    assert errors_of("overrides: [{sharing: {splitCount: 2}}]\n") == [
        "overrides[0].match: required"
    ]
    assert errors_of("overrides: [{match: {nodeNames: [a]}}]\n") == [
        "overrides[0].sharing: required"
    ]


def test_label_values_must_be_strings() -> None:
    errors = errors_of("overrides: [{match: {nodeLabels: {gpu: true}}, sharing: {}}]\n")
    assert errors == ["overrides[0].match.nodeLabels.gpu: must be a string (quote it), got true"]


def test_an_override_cannot_use_time_slicing() -> None:
    errors = errors_of("overrides: [{match: {nodeNames: [a]}, sharing: {timeSlicing: {}}}]\n")
    assert len(errors) == 1
    assert errors[0].startswith("overrides[0].sharing.timeSlicing: unknown key")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("# only a comment\n", "empty"),
        ("- a\n- b\n", "top level: must be a map"),
        ("version: v1\nversion: v1\n", "line 2, column 1: duplicate key 'version'"),
        ("sharing:\n  splitCount: 2\n  splitCount: 3\n", "duplicate key 'splitCount'"),
        ("sharing: {splitCount: 2\n", "line 2"),
        ("a: 1\n---\nb: 2\n", "single document"),
    ],
)
def test_files_that_are_not_one_yaml_map_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert len(caught.value.errors) == 1
    assert fragment in caught.value.errors[0]


def test_yaml_merge_keys_may_override_merged_values() -> None:
    config = parse(
        """
        sharing: &base {splitCount: 4, compute: proportional}
        overrides:
          - match: {nodeNames: [a]}
            sharing:
              <<: *base
              splitCount: 2
        """
    )
    assert config.overrides[0].sharing == {"split_count": 2, "compute": "proportional"}


# NVIDIA's time-slicing format ----------------------------------------------------------------


NVIDIA = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def test_time_slicing_sets_resource_and_split() -> None:
    config = parse(NVIDIA)
    assert config.resource_name == "nvidia.com/gpu"
    assert config.sharing == Sharing(split_count=4)
    assert config.fail_requests_greater_than_one is False


def test_time_slicing_rename_by_default_adds_shared() -> None:
    text = NVIDIA.replace("    resources:", "    renameByDefault: true\n    resources:")
    assert parse(text).resource_name == "nvidia.com/gpu.shared"


def test_time_slicing_explicit_rename_and_bare_names() -> None:
    text = NVIDIA.replace("name: nvidia.com/gpu", "name: gpu\n      rename: gpu-small")
    text = text.replace("    resources:", "    renameByDefault: true\n    resources:")
    assert parse(text).resource_name == "nvidia.com/gpu-small"


def test_time_slicing_fail_requests_greater_than_one_is_kept() -> None:
    text = NVIDIA.replace("    resources:", "    failRequestsGreaterThanOne: true\n    resources:")
    assert parse(text).fail_requests_greater_than_one is True


def test_time_slicing_may_be_combined_with_our_own_knobs() -> None:
    config = parse(NVIDIA + "  compute: proportional\n  memoryScaling: 1.5\n")
    assert config.sharing == Sharing(4, 1.5, "proportional", "binpack")


def test_time_slicing_with_two_resources_is_a_clear_error() -> None:
    text = NVIDIA + "    - name: example.com/gpu\n      replicas: 2\n"
    assert errors_of(text) == [
        "sharing.timeSlicing.resources: must list exactly one resource (vgpu-plugin serves one"
        " resource), got 2"
    ]


def test_time_slicing_conflicts_are_reported() -> None:
    errors = errors_of(NVIDIA + "  splitCount: 3\nresourceName: example.com/gpu\n")
    assert len(errors) == 2
    assert any(e.startswith("sharing.splitCount: cannot be combined") for e in errors)
    assert any(e.startswith("resourceName: 'example.com/gpu' conflicts") for e in errors)
    # Naming the same resource twice is no conflict.
    assert parse(NVIDIA + "resourceName: nvidia.com/gpu\n").sharing.split_count == 4


def test_time_slicing_resource_fields_are_checked() -> None:
    errors = errors_of(NVIDIA.replace("replicas: 4", "replicas: 0\n      devices: [0, 1]"))
    assert errors == [
        "sharing.timeSlicing.resources[0].replicas: must be 1..256, got 0",
        "sharing.timeSlicing.resources[0].devices: must be all, got a list",
    ]
    errors = errors_of(NVIDIA.replace("      replicas: 4\n", ""))
    assert errors == ["sharing.timeSlicing.resources[0].replicas: required"]


def test_time_slicing_needs_resources() -> None:
    assert errors_of("sharing: {timeSlicing: {renameByDefault: true}}\n") == [
        "sharing.timeSlicing.resources: required"
    ]


# Which sharing applies to a GPU ----------------------------------------------------------------

OVERRIDES = """
sharing: {splitCount: 10, compute: proportional, memoryScaling: 1.0}
overrides:
  - match: {gpuUUIDs: [gpu-bbbb-0002]}
    sharing: {splitCount: 2}
  - match: {gpuModels: ["*a100*"], nodeNames: ["gpu-a*"]}
    sharing: {splitCount: 4, memoryScaling: 2}
  - match: {nodeLabels: {pool: inference, zone: "1"}}
    sharing: {placement: spread}
  - match: {nodeNames: [gpu-a1]}
    sharing: {splitCount: 8}
"""


def test_first_matching_override_wins_and_merges_over_the_base() -> None:
    config = parse(OVERRIDES)
    sharing = sharing_for(config, "gpu-a1", {}, A100)
    assert sharing == Sharing(4, 2.0, "proportional", "binpack")  # the second, not the fourth
    assert matching_override(config, "gpu-a1", {}, A100) == 1


def test_uuid_match_ignores_case() -> None:
    config = parse(OVERRIDES)
    assert sharing_for(config, "any", {}, H100) == Sharing(2, 1.0, "proportional", "binpack")


def test_all_criteria_of_a_match_must_hold() -> None:
    config = parse(OVERRIDES)
    # Model matches but the node name does not: falls through to later overrides / the base.
    assert matching_override(config, "cpu-1", {}, A100) is None
    assert sharing_for(config, "cpu-1", {}, A100) == config.sharing


def test_every_label_of_a_match_must_be_present_with_its_value() -> None:
    config = parse(OVERRIDES)
    labels = {"pool": "inference", "zone": "1", "other": "x"}
    assert matching_override(config, "n", labels, A100) == 2
    assert matching_override(config, "n", {"pool": "inference"}, A100) is None
    assert matching_override(config, "n", {"pool": "inference", "zone": "2"}, A100) is None


def test_override_sharing_holds_only_the_keys_given() -> None:
    config = parse(OVERRIDES)
    assert dict(config.overrides[2].sharing) == {"placement": "spread"}
    with pytest.raises(TypeError):
        config.overrides[2].sharing["placement"] = "binpack"  # type: ignore[index]


def test_configs_compare_and_hash_by_value() -> None:
    assert parse(OVERRIDES) == parse(OVERRIDES)
    assert hash(parse(OVERRIDES)) == hash(parse(OVERRIDES))
    assert parse(OVERRIDES) != parse(OVERRIDES.replace("splitCount: 8", "splitCount: 9"))


def test_override_refuses_unknown_fields_in_code() -> None:
    with pytest.raises(ValueError, match="split"):
        Override(Match(node_names=("a",)), {"split": 2})


# Reading the file ------------------------------------------------------------------------------


def test_load_config_follows_the_configmap_symlink_swap(tmp_path: Path) -> None:
    data = tmp_path / "..2024_01"
    data.mkdir()
    (data / "config.yaml").write_text("version: v1\nsharing: {splitCount: 3}\n")
    (tmp_path / "..data").symlink_to(data.name)
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    assert load_config(tmp_path / "config.yaml").sharing.split_count == 3

    fresh = tmp_path / "..2024_02"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("version: v1\nsharing: {splitCount: 5}\n")
    (tmp_path / "..tmp").symlink_to(fresh.name)
    os.replace(tmp_path / "..tmp", tmp_path / "..data")
    assert load_config(str(tmp_path / "config.yaml")).sharing.split_count == 5


def test_load_config_names_the_file_in_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nsharing: {splitCount: 0}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.source == str(path)
    assert str(caught.value) == f"{path}: sharing.splitCount: must be 1..256, got 0"


def test_load_config_turns_unreadable_files_into_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"version: v1\n\xff\xfe")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(binary)


# NVIDIA's config file as its users write it ------------------------------------------------------

NVIDIA_FLAGS = """
version: v1
flags:
  migStrategy: "none"
  failOnInitError: true
  nvidiaDriverRoot: "/run/nvidia/driver"
  gdsEnabled: null
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: "envvar"
    deviceIDStrategy: "uuid"
  gfd:
    oneshot: false
    sleepInterval: 60s
sharing:
  timeSlicing:
    renameByDefault: false
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""


def test_nvidia_flags_block_is_accepted_and_the_ignored_flags_are_listed() -> None:
    config = parse(NVIDIA_FLAGS)
    assert config.sharing.split_count == 10
    assert config.fail_on_init_error is True
    # What vgpu-plugin does anyway (none, envvar, uuid, no device specs) is not listed.
    assert config.ignored_flags == (
        "flags.nvidiaDriverRoot: '/run/nvidia/driver': ignored (the plugin loads NVML from its"
        " image's library path and passes no device nodes.)",
        "flags.gfd.oneshot: false: ignored (gpu-feature-discovery's, not a device plugin's.)",
        "flags.gfd.sleepInterval: '60s': ignored (gpu-feature-discovery's, not a device plugin's.)",
    )


def test_nvidia_flags_with_another_behaviour_than_ours_are_listed() -> None:
    text = NVIDIA_FLAGS.replace('"envvar"', "[volume-mounts, envvar]").replace('"uuid"', "index")
    text = text.replace("failOnInitError: true", "failOnInitError: false")
    config = parse(text)
    assert config.fail_on_init_error is False  # honoured, so never listed
    paths = [line.split(":")[0] for line in config.ignored_flags]
    assert "flags.plugin.deviceListStrategy" in paths
    assert "flags.plugin.deviceIDStrategy" in paths
    assert "flags.failOnInitError" not in paths


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "flags: {migStrategy: mixed}",
            "flags.migStrategy: vgpu-plugin splits whole GPUs and serves no MIG devices: must be"
            " none, got 'mixed'",
        ),
        ("flags: {plugin: {deviceIDStrategy: serial}}", "must be uuid or index, got 'serial'"),
        ("flags: {plugin: {deviceListStrategy: [envvar, x]}}", "deviceListStrategy[1]: must be"),
        ("flags: {failOnInitError: maybe}", "flags.failOnInitError: must be true or false"),
    ],
)
def test_nvidia_flags_are_checked(text: str, error: str) -> None:
    (got,) = errors_of(text + "\n")
    assert error in got


@pytest.mark.parametrize(
    "text",
    [
        NVIDIA.replace("name: nvidia.com/gpu", "name: nvidia.com/mig-1g.5gb"),
        NVIDIA.replace("name: nvidia.com/gpu", "name: mig-2g.10gb"),
        NVIDIA.replace("name: nvidia.com/gpu", "name: gpu\n      rename: mig-1g.5gb"),
        "resourceName: nvidia.com/mig-1g.5gb\n",
    ],
)
def test_mig_resource_names_are_refused(text: str) -> None:
    (error,) = errors_of(text)
    assert (
        "is a MIG resource name; vgpu-plugin splits whole GPUs and serves no MIG devices" in error
    )


# Bad input: one clear line, never a hang or a traceback -----------------------------------------


@pytest.mark.timeout(30)  # without the fix, opening the FIFO waits forever
def test_a_fifo_directory_loop_or_dangling_link_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("missing")
    for name, why in [
        ("fifo", "not a regular file (a FIFO)"),
        ("dir", "not a regular file (a directory)"),
        ("loop", "cannot read the file: Too many levels of symbolic links"),
        ("dangling", "cannot read the file: No such file or directory"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_config(tmp_path / name)
        assert str(caught.value) == f"{tmp_path / name}: {why}"


def test_integers_too_long_to_convert_are_one_error() -> None:
    (error,) = errors_of("sharing: {splitCount: " + "9" * 5000 + "}\n")
    assert "integer of 5000 characters" in error and "line 2" in error


def test_a_huge_value_or_key_is_never_echoed_whole() -> None:
    huge = "x" * 10_000_000
    for text in (
        f"resourceName: '{huge}'\n",
        f"? {huge}\n: 1\n",
        f"sharing: {{placement: {huge}}}\n",
    ):
        (error,) = errors_of(text)
        assert len(error) < 300 and "10000000 characters" in error


def test_many_errors_are_listed_up_to_a_limit() -> None:
    with pytest.raises(ConfigError) as caught:
        parse("sharing:\n" + "".join(f"  k{i}: 1\n" for i in range(500)))
    assert len(caught.value.errors) == 500
    assert len(str(caught.value).splitlines()) == 1 + 20 + 1
    assert str(caught.value).endswith("... and 480 more")


@pytest.mark.timeout(60)  # O(n²) duplicate detection took 35 s on 60,000 keys
def test_duplicate_keys_among_60000_are_found() -> None:
    keys = "".join(f"  k{i}: 1\n" for i in range(60000))
    (error,) = errors_of(f"sharing:\n{keys}  k59999: 2\n")
    assert "duplicate key 'k59999'" in error


# --- bounded parsing (issue 21, item 4) ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (yaml_bombs.COMPLEX_KEY, "line 9, column 4: a key must be a plain value, not a list"),
        (yaml_bombs.VALUE, "aliases expand this document by more than 10000 nodes"),
    ],
)
def test_an_alias_bomb_is_refused_fast_small_and_in_one_line(text: str, why: str) -> None:
    assert len(text) < 400
    tracemalloc.start()
    cpu = time.process_time()
    try:
        with pytest.raises(ConfigError) as info:
            parse_config(text, "config.yaml")
        used = time.process_time() - cpu  # CPU time: a loaded machine does not inflate it
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert why in message and message.startswith("config.yaml: "), message
    assert "\n" not in message and len(message) < 200
    assert used < 1.0 and peak < 100 << 20, (used, peak)


def test_anchors_within_the_budget_still_work() -> None:
    text = textwrap.dedent(
        """\
        version: v1
        sharing: &s {splitCount: 4}
        overrides:
          - match: {nodeNames: [a]}
            sharing: *s
        """
    )
    config = parse_config(text)
    assert config.sharing.split_count == 4 and len(config.overrides) == 1


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(ConfigError, match="an alias refers to a node that contains it"):
        parse_config("version: v1\nx: &x [1, *x]\n")
