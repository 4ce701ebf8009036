#!/usr/bin/env bash
# The cluster tier's host packages (tests/cluster, docs/testing.md), from Debian, installed only
# where missing. The Kubernetes and containerd binaries come from ../shared/k8s (VGPU_K8S_ASSETS).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
declare -A need=(
  [etcd]=etcd-server [runc]=runc [iptables]=iptables [debootstrap]=debootstrap
  [busybox]=busybox-static [openssl]=openssl [xz]=xz-utils [ip]=iproute2 [unshare]=util-linux
)
missing=()
for tool in "${!need[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${need[$tool]}")
done
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] \
  || missing+=(containernetworking-plugins)
# The pause image is a static binary: libc.a.
[ -f "/usr/lib/$(gcc -dumpmachine 2>/dev/null)/libc.a" ] || missing+=(libc6-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "ci: apt-get install ${missing[*]} (cluster tier)"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
