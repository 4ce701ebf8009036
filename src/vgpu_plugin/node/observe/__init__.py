"""Observation: the shim's regions read from the host, the node view, and its metrics."""
