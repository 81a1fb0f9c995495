#!/usr/bin/env bash
# make lab / make lab-down: a simulated rack provisioned into a real
# Kubernetes cluster on this machine (docs/lab.md, "make lab").
#
#   up    install packages, build or reuse Kubernetes v1.34.4 (kube-tools
#         cache), boot media and the lab image, start the rack and the
#         controller, apply examples/lab-cluster.yaml, wait until the cluster
#         is Ready and its DNS answers, print how to use it
#   down  stop the controller, remove the rack (caches stay)
#   upgrade  like up, but the cluster starts at the previous minor (v1.33.13,
#         its kube-tools built once if missing) and is then upgraded to
#         v1.34.4 by reimaging, control plane first; prints each phase's time
#
#   KILN_CACHE=DIR       cache root (default /var/cache/kiln)
#   KILN_KUBE_MIRROR=URL download Kubernetes from a dl.k8s.io-style release
#                        mirror (every file checked against its .sha256)
#                        instead of building it from source
#   KILN_LAB_DIR=DIR     where the lab keeps its state (default
#                        /var/lib/kiln/lab-run/kiln)
#   KILN_LAB_ARGS=...    extra arguments to kiln-lab up (e.g. --timeout 60m)
#   BACKEND=netns|qemu|libvirt  the hosts' machine backend (make lab
#                        BACKEND=...): qemu and libvirt make one TCG VM on
#                        the lab bridge with a single-node cluster
#                        (examples/lab-vm/cluster.yaml, the golden image
#                        examples/images/vm-lab.yaml); docs/lab.md
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:${PATH}"
export GOTOOLCHAIN=$(cat hack/go-toolchain) # README, "Go version"
export KILN_CACHE=${KILN_CACHE:-/var/cache/kiln}
dir=${KILN_LAB_DIR:-/var/lib/kiln/lab-run/kiln}
cmd=${1:-up}
start=$(date +%s)
say() { echo "lab: [$(( $(date +%s) - start ))s] $*"; }

# Refuse an unknown backend before anything is installed or built.
backend=${BACKEND:-netns}
if [ "$cmd" = up ]; then
  case "$backend" in
    netns|qemu|libvirt) ;;
    *) echo "lab: BACKEND=${BACKEND}: want netns, qemu or libvirt" >&2; exit 2 ;;
  esac
fi

if [ "$(id -u)" != 0 ]; then
  echo "lab: needs root (network namespaces, nftables, systemd-nspawn, loop devices): sudo make $([ "$cmd" = down ] && echo lab-down || echo lab)" >&2
  exit 2
fi

build_lab() {
  mkdir -p bin
  CGO_ENABLED=0 go build -trimpath -o bin/kiln-lab ./e2e/fleet/cmd/kiln-lab
}

case "$cmd" in
  up)
    # Say up front what this run will cost.
    ver=v1.34.4
    if [ -f "$KILN_CACHE/kube-tools/$ver/manifest.json" ]; then
      kt="cached"
    elif [ -n "${KILN_KUBE_MIRROR:-}" ]; then
      kt="downloaded from \$KILN_KUBE_MIRROR (a few minutes)"
    else
      kt="BUILT FROM SOURCE once: about 6 minutes on 2 idle cores, up to an hour when the machine is busy (progress below)"
    fi
    if compgen -G "$KILN_CACHE/rootfs/*" >/dev/null; then rf="cached roots may be reused"; else rf="debootstrap of a Debian root: about 1 minute, once"; fi
    say "this run: packages (apt, if missing); Kubernetes $ver: $kt; Debian root: $rf;"
    if [ "$backend" = netns ]; then
      say "  lab image: about 1 minute when the agent changed, else cached; provisioning 1 control plane + 2 workers: about 2 minutes (stops after 5 minutes without progress, naming what blocks)"
    else
      say "  BACKEND=$backend: one TCG VM (no KVM here), a single-node cluster; VM image (kernel, ESP): 10-60 minutes when not cached; provisioning under TCG: about 10 minutes on an idle machine, much longer on a busy one: give it the machine (stops after 20 minutes without progress, naming what blocks)"
    fi
    ./hack/deps.sh
    say "building Kiln"
    make --no-print-directory build
    build_lab
    say "Kubernetes $ver (make kube-tools)"
    ./hack/kube-tools.sh
    say "starting the lab"
    # shellcheck disable=SC2086
    exec ./bin/kiln-lab up --dir "$dir" --bin bin --backend "$backend" ${KILN_LAB_ARGS:-}
    ;;
  upgrade)
    # make lab-upgrade: the cluster at the previous minor, upgraded to the
    # pinned one by reimaging (docs/lab.md, "make lab-upgrade").
    prev=v1.33.13
    for v in $prev v1.34.4; do
      if [ -f "$KILN_CACHE/kube-tools/$v/manifest.json" ]; then
        say "Kubernetes $v: cached"
      else
        say "Kubernetes $v: BUILT FROM SOURCE: about 30-40 minutes on 2 cores, once (set KILN_BUILD_JOBS=1 on a shared machine)"
      fi
    done
    say "  two lab images (about 3 minutes each when not cached), provisioning (about 5-10 minutes), then the upgrade: control plane, then workers, each reimaged"
    ./hack/deps.sh
    say "building Kiln"
    make --no-print-directory build
    build_lab
    say "Kubernetes $prev (make kube-tools KUBE_RELEASE=$prev)"
    ./hack/kube-tools.sh --version "$prev"
    say "Kubernetes v1.34.4 (make kube-tools)"
    ./hack/kube-tools.sh
    say "starting the lab and the upgrade"
    # shellcheck disable=SC2086
    exec ./bin/kiln-lab upgrade --dir "$dir" --bin bin ${KILN_LAB_ARGS:-}
    ;;
  down)
    [ -x bin/kiln-lab ] || build_lab
    exec ./bin/kiln-lab down --dir "$dir" --bin bin
    ;;
  *) echo "usage: $0 up|down|upgrade" >&2; exit 2 ;;
esac
