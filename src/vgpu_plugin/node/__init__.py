"""The node, one subpackage per concern: the ledger, the host's files, GPU facts and health,
observation, and what a running plugin watches and talks to (docs/architecture.md)."""
