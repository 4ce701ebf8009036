"""The kubelet's gRPC APIs: the protos, their generated modules and the API constants.

- ``vgpu_plugin.api.deviceplugin.v1beta1.api_pb2`` / ``api_pb2_grpc``: Registration and
  DevicePlugin services (package ``v1beta1``).
- ``vgpu_plugin.api.podresources.v1.api_pb2`` / ``api_pb2_grpc``: PodResourcesLister
  (package ``v1``).
- ``vgpu_plugin.api.pluginregistration.v1``: Registration (package ``pluginregistration``),
  how a DRA driver announces itself.
- ``vgpu_plugin.api.dra.v1`` and ``.v1beta1``: the DRAPlugin service (packages
  ``k8s.io.kubelet.pkg.apis.dra.v1`` and ``...v1beta1``).
- ``vgpu_plugin.api.constants``: version string, socket names, health values, size limit.
"""
