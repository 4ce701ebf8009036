"""The node: allocation records, the shim's regions, NVML, health, the shim's install,
cleanup, the node view and its metrics."""
