"""The plugin's pure domain core: config, splitting, placement and Allocate responses.

No gRPC, NVML or file I/O here (``config.load_config`` reads one file); the edges call in.
"""
