"""The DRA driver: its domain (``driver``) and its gRPC edge (``server``); docs/dra.md."""
