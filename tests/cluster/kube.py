"""Small helpers over the kubernetes client for the cluster tier's tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.rest import ApiException

T = TypeVar("T")
PROBE = (Path(__file__).parent / "probe.py").read_text()
IMAGE = "vgpu-plugin:cluster-test"
EXEC_WITH_PID1_ENV = (
    "import os; env = dict(kv.split('=', 1) for kv in open('/proc/1/environ').read()"
    ".split(chr(0)) if '=' in kv); os.execve('/usr/bin/python3', ['python3', '-c', env['PROBE']],"
    " env)"
)
NAMESPACE = "default"
RESOURCE_GROUP, RESOURCE_VERSION = "resource.k8s.io", "v1"


def wait_for(what: str, get: Callable[[], T | None], timeout: float = 120, poll: float = 1) -> T:
    """Polls ``get`` until it returns something truthy; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = get()
        except ApiException as exc:
            last = f"API error {exc.status}: {exc.reason}"
        else:
            if last:
                return last  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what} (last: {last})"
            )
        time.sleep(poll)


def pod(
    name: str,
    command: str,
    *,
    claims: list[dict[str, str]] | None = None,
    limits: dict[str, str] | None = None,
    restart: str = "Never",
    volumes: bool = False,
) -> dict[str, Any]:
    """A workload pod of the plugin image (python3) running ``sh -c command``; the probe's
    source is in $PROBE."""
    container: dict[str, Any] = {
        "name": "main",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
        "env": [{"name": "PROBE", "value": PROBE}],
        "resources": {},
    }
    spec: dict[str, Any] = {
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": 1,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
    }
    if claims:
        spec["resourceClaims"] = claims
        container["resources"]["claims"] = [{"name": c["name"]} for c in claims]
    if limits:
        container["resources"]["limits"] = limits
    if volumes:
        spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
        container["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def claim(name: str, memory: str, compute: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.vgpu-plugin.io",
                            "capacity": {"requests": {"memory": memory, "compute": compute}},
                        },
                    }
                ]
            }
        },
    }


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    # -- objects --------------------------------------------------------------------------

    def create_pod(self, body: dict[str, Any]) -> None:
        self.core.create_namespaced_pod(NAMESPACE, body)

    def create_claim(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(
            RESOURCE_GROUP, RESOURCE_VERSION, NAMESPACE, "resourceclaims", body
        )

    def get_claim(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            RESOURCE_GROUP, RESOURCE_VERSION, NAMESPACE, "resourceclaims", name
        )

    def resource_slices(self) -> list[dict[str, Any]]:
        got = self.custom.list_cluster_custom_object(
            RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices"
        )
        return got["items"]  # type: ignore[no-any-return]

    def delete_pods(self, *names: str, wait: bool = True) -> None:
        for n in names:
            try:
                self.core.delete_namespaced_pod(n, NAMESPACE, grace_period_seconds=0)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        if wait:
            for n in names:
                wait_for(f"pod {n} to be gone", lambda n=n: not self.exists_pod(n), 120)

    def delete_claims(self, *names: str) -> None:
        for n in names:
            try:
                self.custom.delete_namespaced_custom_object(
                    RESOURCE_GROUP, RESOURCE_VERSION, NAMESPACE, "resourceclaims", n
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def exists_pod(self, name: str) -> bool:
        try:
            self.core.read_namespaced_pod(name, NAMESPACE)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def exec(
        self, pod: str, command: list[str], container: str = "main", namespace: str = NAMESPACE
    ) -> str:
        """``command``'s stdout in a running container (as ``kubectl exec``); fails naming its
        exit status and stderr when it does not exit 0."""
        from kubernetes.stream import stream

        resp = stream(
            client.CoreV1Api(self.api).connect_get_namespaced_pod_exec,
            pod,
            namespace,
            container=container,
            command=command,
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
            _preload_content=False,
        )
        try:
            resp.run_forever(timeout=120)
            out, err, rc = resp.read_stdout(), resp.read_stderr(), resp.returncode
        finally:
            resp.close()
        if rc != 0:
            raise AssertionError(
                f"exec {command} in {namespace}/{pod}: exit {rc}: {out.strip()} {err.strip()}"
            )
        return str(out)

    def probe_in(self, pod: str, container: str = "main") -> dict[str, Any]:
        """A new CUDA process in a running workload container: the probe's JSON. It runs with
        the environment of the container's first process: containerd execs with the spec it
        knows, without what the toolkit's runtime stand-in added at create (LD_LIBRARY_PATH to
        simgpu's libcuda, which the real toolkit puts in the linker's path instead)."""
        out = self.exec(pod, ["python3", "-c", EXEC_WITH_PID1_ENV], container)
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    # -- states ---------------------------------------------------------------------------

    def pod(self, name: str) -> Any:
        return self.core.read_namespaced_pod(name, NAMESPACE)

    def running(self, name: str) -> bool:
        p = self.pod(name)
        self.fail_on_create_error(p)
        return bool(p.status.phase == "Running")

    @staticmethod
    def fail_on_create_error(p: Any) -> None:
        for s in p.status.container_statuses or []:
            w = s.state.waiting
            if w is not None and w.reason in (
                "CreateContainerError",
                "RunContainerError",
                "CreateContainerConfigError",
                "ErrImageNeverPull",
            ):
                raise AssertionError(f"pod {p.metadata.name}: {w.reason}: {w.message}")

    def finished(self, name: str) -> dict[str, Any] | None:
        """The probe's JSON once the pod's container ended successfully; fails on a failed run
        or a container the runtime could not create."""
        p = self.pod(name)
        self.fail_on_create_error(p)
        for s in p.status.container_statuses or []:
            t = s.state.terminated
            if t is not None and (p.spec.restart_policy == "Never" or t.exit_code == 0):
                if t.exit_code != 0:
                    raise AssertionError(
                        f"pod {name} failed (exit {t.exit_code}): {t.message or t.reason}"
                    )
                return json.loads(t.message)  # type: ignore[no-any-return]
        return None

    def probed(self, name: str, container: str = "main") -> dict[str, Any] | None:
        """The probe's JSON from a running pod's log (``python3 -c "$PROBE"; exec sleep``)."""
        p = self.pod(name)
        self.fail_on_create_error(p)
        if p.status.phase != "Running":
            return None
        log = self.core.read_namespaced_pod_log(name, NAMESPACE, container=container)
        lines = log.strip().splitlines()
        if not lines:
            return None
        result: dict[str, Any] = json.loads(lines[-1])
        if "error" in result:
            raise AssertionError(f"pod {name}: CUDA probe failed: {result}")
        return result

    def unschedulable(self, name: str) -> str | None:
        """The scheduler's message when it reports the pod unschedulable."""
        p = self.pod(name)
        for c in p.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                return str(c.message)
        return None

    def node(self) -> Any:
        return self.core.list_node().items[0]

    def allocatable(self, resource: str) -> str | None:
        return self.node().status.allocatable.get(resource)  # type: ignore[no-any-return]
