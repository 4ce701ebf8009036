"""What `vgpu-plugin serve` says about itself at start: one line naming the version, the
shim's build id, the effective config's digest, the node and the front ends; and the node
name it is given is the metrics' Hostname."""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref
from pathlib import Path

from commands.test_serve import (  # noqa: F401 (served: the fixture)
    Served,
    sample,
    scrape,
    serve_once,
    served,
)

from vgpu_plugin.commands.serve import config_digest, settle_heap, start_line
from vgpu_plugin.core.config import DraConfig, Sharing, default_config, parse_config
from vgpu_plugin.node.observe.metrics import build_ids
from vgpu_plugin.sim.simgpu import Node


def test_the_digest_is_of_the_config_not_of_its_layout() -> None:
    a = parse_config("version: v1\nsharing: {splitCount: 4}\n")
    b = parse_config("# a comment\nversion: v1\nsharing:\n  splitCount: 4\n")
    assert config_digest(a) == config_digest(b)
    assert re.fullmatch(r"[0-9a-f]{12}", config_digest(a))
    changed = dataclasses.replace(a, sharing=Sharing(split_count=5))
    assert config_digest(changed) != config_digest(a)


def test_the_start_line_names_version_shim_digest_node_and_front_ends() -> None:
    config = default_config()
    version, shim = build_ids()
    line = start_line("gpu-node-7", config)
    assert line == (
        f"vgpu-plugin {version} (shim {shim}) starting on node gpu-node-7: "
        f"config sha256 {config_digest(config)}, front ends: device-plugin"
    )
    with_dra = dataclasses.replace(config, dra=DraConfig(enabled=True))
    assert start_line("n", with_dra).endswith("front ends: device-plugin, dra")


def test_serve_logs_the_start_line_once_and_its_node_name_is_the_hostname(
    served: Served,  # noqa: F811
) -> None:
    logs = served.wait_log("starting on node node-1")
    (line,) = [x for x in logs.splitlines() if "starting on node" in x]
    assert re.search(r"config sha256 [0-9a-f]{12}, front ends: device-plugin$", line), line
    a, _ = served.uuids()
    assert sample(scrape(served), "vgpu_gpu_memory_total_bytes", UUID=a, Hostname="node-1") > 0


def test_serve_names_hamis_files_in_its_host_root_at_start(
    simgpu_node: Node, tmp_path: Path
) -> None:
    """Before anything can refuse the start (here: no shim installed), serve logs its start
    line and the one line about HAMi's files, which it leaves as they are."""
    host = tmp_path / "empty"  # serve_once's --host-root
    pod_dir = host / "containers" / "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0_server"
    pod_dir.mkdir(parents=True)
    (host / "libvgpu.so").write_bytes(b"HAMi-core")
    proc = serve_once(simgpu_node, tmp_path, "version: v1\n")
    assert proc.returncode == 3, proc.stderr
    assert "starting on node" in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "HAMi's files are on this node" in x]
    assert f"HAMi-core's library {host / 'libvgpu.so'}" in line and pod_dir.name in line
    assert (host / "libvgpu.so").read_bytes() == b"HAMi-core" and pod_dir.is_dir()


def test_the_heap_start_up_built_is_out_of_the_collectors_walk_and_still_freed() -> None:
    """``settle_heap``: what start-up built (the ledger's records) is no longer walked by a
    full collection, which took 25-50 ms a pass with 2,000 records on whatever call was
    running; it stays usable and is freed by reference counting when dropped."""

    class Record:
        pass

    records = [Record() for _ in range(100)]
    gone = weakref.ref(records[0])
    assert any(o is records for o in gc.get_objects())
    try:
        settle_heap(collect=True)
        assert not any(o is records for o in gc.get_objects())
        assert gc.get_freeze_count() > 0
        records.append(Record())  # still a list like any other
        del records
        assert gone() is None
    finally:
        gc.unfreeze()
