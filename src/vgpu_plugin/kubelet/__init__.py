"""What faces the kubelet: the device-plugin gRPC server and servicer, the backend that
answers it, the kubelet-restart watch and the pod-resources client."""
