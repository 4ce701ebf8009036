"""The host's files: an allocation's files, CDI specs, the shim's install, the one remover,
the cleanup, and what other tools left on the node (read only)."""
