#!/usr/bin/env bash
# Builds the pinned Kubernetes release (kubeadm, kubelet, kube-apiserver,
# kube-controller-manager, kube-scheduler, kube-proxy, kubectl, etcd, CoreDNS,
# pause) from the Go module proxy into ${KILN_CACHE:-/var/cache/kiln}/kube-tools,
# and writes the images kubeadm pulls as docker-archive tarballs next to them.
# A cache that verifies makes this a few-second no-op.
#
#   KILN_CACHE=DIR         cache root (default /var/cache/kiln)
#   KILN_KUBE_MIRROR=URL   download from a dl.k8s.io-style mirror instead of building
#   KILN_BUILD_JOBS=N      build parallelism (go build -p, GOMAXPROCS); on a shared
#                          machine use 1 and run under `nice -n 19`
#
# Extra arguments go to `kiln-imagebuilder kube-tools` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:${PATH}"
export GOTOOLCHAIN=$(cat hack/go-toolchain) # README, "Go version"
mkdir -p bin
CGO_ENABLED=0 go build -trimpath -o bin/kiln-imagebuilder ./cmd/kiln-imagebuilder
exec ./bin/kiln-imagebuilder kube-tools "$@"
