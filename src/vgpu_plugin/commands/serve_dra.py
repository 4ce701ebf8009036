"""``serve``'s DRA half (docs/dra.md): started beside the device plugin when the config's
``dra.enabled`` is true, for the GPUs ``dra.gpus`` selects; the device plugin keeps the rest.

The driver needs the API server (claims, the node's ResourceSlice): in-cluster credentials,
or the kubeconfig file in ``KUBECONFIG`` outside a cluster. Its sockets are in the kubelet's
``plugins_registry`` and ``plugins`` dirs (``VGPU_DRA_REGISTRY_DIR``, ``VGPU_DRA_PLUGINS_DIR``
to move them, for tests).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from vgpu_plugin.core import dra
from vgpu_plugin.core.config import Config
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.kubelet.dra.driver import DraDriver
from vgpu_plugin.kubelet.dra.server import DraServer
from vgpu_plugin.node.gpu.nvml import NvmlUnavailable, device_facts
from vgpu_plugin.node.host.atomicfile import DeferredSync
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.node.serving.kubeapi import ApiError, ClientMissing, KubeApi

log = logging.getLogger("vgpu_plugin.commands.serve")

API_TIMEOUT_S = 10.0
# How often prepared claims are checked against the API server (and once at start).
STALE_CLAIMS_INTERVAL_S = 300.0
# How often the driver checks that its ResourceSlice is still there (one GET; docs/dra.md).
SLICE_CHECK_INTERVAL_S = 30.0


def split_gpus(
    config: Config, gpus: Sequence[PhysicalGpu]
) -> tuple[list[PhysicalGpu], list[PhysicalGpu]]:
    """(the device plugin's GPUs, the DRA driver's GPUs)."""
    ours = [g for g in gpus if config.dra.serves(g)]
    return [g for g in gpus if g not in ours], ours


class DraRunner:
    """The DRA driver and its sockets, started and stopped with ``serve``."""

    def __init__(
        self,
        config: Config,
        gpus: Sequence[PhysicalGpu],
        node_name: str,
        store: AllocationStore,
        shim_version: str,
        lock_dir: str,
        cdi_spec_dir: str,
        syncer: DeferredSync | None = None,
    ) -> None:
        try:
            api = KubeApi(API_TIMEOUT_S, os.environ.get("KUBECONFIG") or None)
        except ClientMissing:
            raise
        except Exception as exc:  # the client's config errors have no common base
            raise RuntimeError(f"no access to the API server for the DRA driver: {exc}") from exc
        try:
            facts = device_facts()
        except NvmlUnavailable as exc:
            log.warning("no compute capability or driver version for the slice: %s", exc)
            facts = {}
        self.driver = DraDriver(
            gpus, config, node_name, ClaimLedger(store), api, api, shim_version,
            facts=facts, lock_dir=lock_dir, cdi_spec_dir=cdi_spec_dir, syncer=syncer,
        )  # fmt: skip
        self.server = DraServer(
            self.driver,
            os.environ.get("VGPU_DRA_REGISTRY_DIR", dra.REGISTRY_DIR),
            os.environ.get("VGPU_DRA_PLUGINS_DIR", dra.PLUGINS_DIR),
            on_registered=lambda: self.driver.publish("registered with the kubelet"),
        )
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def start(self, rebuild: bool = False) -> None:
        """``rebuild``: the first start since the node booted (``DraDriver.rebuild``, before
        the driver registers)."""
        if rebuild:
            intact, rebuilt, refused = self.driver.rebuild()
            log.info(
                "first start since the node booted: of the prepared claims %d intact,"
                " %d rebuilt, %d not rebuildable",
                intact,
                rebuilt,
                refused,
            )
        self.driver.recover()
        for g in self.driver.gpus:
            log.info("GPU %d %s %s: DRA", g.index, g.uuid, g.name)
        self.driver.publish("started")
        self.server.start()
        self._sweeper = threading.Thread(
            target=self._sweep_stale, name="vgpu-dra-stale", daemon=True
        )
        self._sweeper.start()
        self._keeper = threading.Thread(target=self._keep_slice, name="vgpu-dra-slice", daemon=True)
        self._keeper.start()

    def _keep_slice(self) -> None:
        """Every ``SLICE_CHECK_INTERVAL_S``: the ResourceSlice published again if it went."""
        while not self._stop.wait(SLICE_CHECK_INTERVAL_S):
            try:
                self.driver.keep_published()
            except ApiError as exc:
                log.error("cannot check the ResourceSlice: %s", exc)
            except Exception:  # keep checking after a bug in one pass
                log.exception("ResourceSlice check failed")

    def _sweep_stale(self) -> None:
        """At start, then every ``STALE_CLAIMS_INTERVAL_S``: claims the API server lost."""
        while not self._stop.is_set():
            try:
                self.driver.release_stale()
            except Exception:  # keep sweeping after a bug in one pass
                log.exception("stale-claim pass failed")
            self._stop.wait(STALE_CLAIMS_INTERVAL_S)

    def apply_health(self, uuid: str, healthy: bool) -> None:
        try:
            self.driver.apply_health(uuid, healthy)
        except ApiError as exc:  # publish logs its own failures; belt and braces
            log.error("cannot republish after a health change: %s", exc)

    def apply_config(self, config: Config) -> None:
        self.driver.apply_config(config)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop()
