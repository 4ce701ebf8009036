"""The simulation the demo and the tests run on: simgpu's control, the runc harness, the
kubelet emulator and the emulated node. The product never imports it; only the demo command
does (the DaemonSet image ships without it)."""
