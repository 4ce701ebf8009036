"""Generated kubelet API modules; see vgpu_plugin.api."""
