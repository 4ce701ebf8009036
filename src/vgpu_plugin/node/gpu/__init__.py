"""GPU facts and health: NVML discovery and the health state machine."""
