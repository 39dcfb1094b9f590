#!/usr/bin/env bash
# Builds the suite's control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler) from the modules go.mod pins, once per machine: into a cache keyed by the
# release, outside the clone, so every clone and CI run on the machine shares it. Prints the
# folder of the binaries. Go's own module and build caches make a rebuild after a change cheap.
# Beside them, in crds/, the Prometheus Operator's CustomResourceDefinitions at a pinned
# release (from its Go module): k8s/'s monitoring component makes PodMonitors, which a cluster
# accepts only once the operator's CRDs are installed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
release="$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
cache="${EBB_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ebb/controlplane}"
bin="$cache/$release-$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-12)/bin"  # contents only: every clone shares it
operator=github.com/prometheus-operator/prometheus-operator@v0.85.0
wanted=(etcd kube-apiserver kube-controller-manager kube-scheduler)
have=1
for b in "${wanted[@]}"; do [[ -x "$bin/$b" ]] || have=0; done
[[ -f "$bin/../crds/monitoring.coreos.com_podmonitors.yaml" ]] || have=0
if [[ $have == 0 ]]; then
    command -v go >/dev/null || { echo "go not found: cannot build the control plane" >&2; exit 1; }
    started=$SECONDS
    mkdir -p "$bin.partial"
    # -trimpath and no VCS stamp: the same binaries from any clone. No symbol table or DWARF
    # (-s -w, as Kubernetes' release builds link): a shorter link of four large binaries.
    (cd "$here" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="-s -w" \
        -o "$bin.partial/" tool)
    mv "$bin.partial/server" "$bin.partial/etcd"  # etcd's main package is named for its folder
    # Downloaded, not required by go.mod: the operator's own dependencies stay out of go.sum.
    operator_dir="$(cd "$here" && go mod download -json "$operator" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
    mkdir -p "$bin/../crds"
    cp "$operator_dir"/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml \
        "$bin/../crds/"
    rm -rf "$bin" && mv "$bin.partial" "$bin"
    echo "built the control plane $release in $((SECONDS - started)) s: $bin" >&2
fi
echo "$bin"
