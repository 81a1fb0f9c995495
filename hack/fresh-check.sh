#!/usr/bin/env bash
# make fresh-check: proves the install steps on a machine that has nothing
# but what a new machine of this kind has (docs/ci.md, "make fresh-check").
#
#   hack/fresh-check.sh [REF]     (REF defaults to HEAD; as root)
#
# 1. Builds once, and caches in ${KILN_CACHE:-/var/cache/kiln}/fresh-root/<key>
#    (keyed on the package list and this script's root version), a pristine
#    Debian 12 root: debootstrap --variant=minbase bookworm plus only git,
#    make, gcc (with libc6-dev) and ca-certificates. Go comes from the
#    host's /usr/local/go, bound read-only.
# 2. Clones REF of this repository into a throw-away directory, with the
#    project's shared/ (the Redfish mockups) beside it as CI lays it out.
# 3. Runs, under systemd-nspawn on a throw-away overlay of the cached root,
#    as root, with empty Go module and build caches (modules come from the Go
#    proxy, packages from deb.debian.org, over the host's network):
#      hack/deps.sh, make generate, make check, make build, make test-short,
#      and go test of every package whose tests need no network namespace,
#      nested container, loop device or VM boot (see fresh_tests below).
#    Every step runs even when one before it failed (each one starts from
#    the clean clone again), so one run shows every defect; the summary
#    names each failed step and the first missing command or file in its
#    output.
# Exits 0 only when every step passed. Removes everything it mounted,
# started or created on exit (the cached root stays).
#
#   KILN_CACHE=DIR          cache root (default /var/cache/kiln)
#   KILN_FRESH_MIRROR=URL   Debian mirror (default http://deb.debian.org/debian)
#   KILN_FRESH_KEEP=1       keep the work directory (logs, overlay) for a look
#   KILN_FRESH_STEPS="..."  run only these steps (names as in the summary)
set -euo pipefail
export PATH=/usr/local/go/bin:$PATH
# Bump when the way the root is built changes: it is part of the cache key.
root_version=1
# What a new machine of this kind has before any project step: gcc as
# `apt-get install gcc` brings it, with the C library headers (libc6-dev, a
# recommend that debootstrap --include would leave out).
root_pkgs=(git make gcc libc6-dev ca-certificates)
mirror=${KILN_FRESH_MIRROR:-http://deb.debian.org/debian}
cache=${KILN_CACHE:-/var/cache/kiln}/fresh-root
start=$(date +%s)
say() { echo "fresh-check: [$(( $(date +%s) - start ))s] $*"; }
die() { echo "fresh-check: $*" >&2; exit 2; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, overlay mounts, systemd-nspawn): sudo make fresh-check"
for t in debootstrap systemd-nspawn git; do
  command -v "$t" >/dev/null || die "$t not found on this machine (apt-get install debootstrap systemd-container git)"
done
[ -x /usr/local/go/bin/go ] || die "/usr/local/go/bin/go not found: Go is bound into the root from /usr/local/go"

repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
ref=${1:-HEAD}
commit=$(git -C "$repo" rev-parse --verify "$ref^{commit}") || die "no commit $ref in $repo"
# shared/ sits beside the main checkout (a worktree's main checkout is the
# one holding the common .git directory).
common=$(cd "$repo" && cd "$(git rev-parse --git-common-dir)" && pwd)
shared=""
for d in "$repo/../shared" "$(dirname "$common")/../shared"; do
  if [ -d "$d" ]; then shared=$(cd "$d" && pwd); break; fi
done

# ---- the cached root -------------------------------------------------------
key=$(printf '%s\n' "v$root_version" bookworm minbase "$mirror" "${root_pkgs[@]}" | sha256sum | cut -c1-16)
root=$cache/$key
mkdir -p "$cache"
# One build at a time; a second run waits and then uses it.
exec 9>"$cache/.lock"
flock 9
if [ -f "$root/.complete" ]; then
  say "root: cached $root"
else
  say "root: building $root (debootstrap minbase bookworm + ${root_pkgs[*]}; a few minutes, once)"
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  inc=$(IFS=,; echo "${root_pkgs[*]}")
  if ! debootstrap --variant=minbase --include="$inc" bookworm "$tmp/root" "$mirror" >"$tmp/debootstrap.log" 2>&1; then
    tail -n 20 "$tmp/debootstrap.log" >&2
    die "debootstrap failed (log above)"
  fi
  # apt's caches and lists are not part of a new machine's state.
  rm -rf "$tmp/root/var/cache/apt/archives/"*.deb "$tmp/root/var/lib/apt/lists/"*_* 2>/dev/null || true
  touch "$tmp/root/.complete"
  rm -rf "$root"
  mv "$tmp/root" "$root"
  rm -rf "$tmp"
  trap - EXIT
  say "root: built"
fi
flock -u 9

# ---- the throw-away machine ------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/var/tmp}/kiln-fresh.XXXXXX")
merged=$work/merged
machine=kiln-fresh-$$
nspawn_pid=""
cleanup() {
  local rc=$?
  if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
    kill "$nspawn_pid" 2>/dev/null || true
    wait "$nspawn_pid" 2>/dev/null || true
  fi
  if mountpoint -q "$merged" 2>/dev/null; then
    umount "$merged" 2>/dev/null || umount -l "$merged" || true
  fi
  # nspawn leaves its propagation directory behind where /run is not tmpfs.
  rm -rf "/run/systemd/nspawn/propagate/$machine"
  if [ -n "${KILN_FRESH_KEEP:-}" ]; then
    echo "fresh-check: kept $work"
  else
    rm -rf "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$work/upper" "$work/ovl" "$merged" "$work/src"
mount -t overlay overlay -o "lowerdir=$root,upperdir=$work/upper,workdir=$work/ovl" "$merged"

# A fresh clone of REF, as CI checks it out, and shared/ beside it.
say "clone: $commit ($ref) of $repo"
git clone -q --no-local --no-checkout "$repo" "$work/src/kiln"
git -C "$work/src/kiln" checkout -q --detach "$commit"
# The site's own CA certificates (a TLS-inspecting egress proxy's, say) are
# the network's configuration, like resolv.conf, not a project step: without
# them nothing reaches the Go proxy over https.
site_cas=$(find /usr/local/share/ca-certificates -name '*.crt' 2>/dev/null | wc -l)
if [ "$site_cas" -gt 0 ]; then
  mkdir -p "$merged/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$merged/usr/local/share/ca-certificates/"
  say "network: $site_cas site CA certificate(s) from /usr/local/share/ca-certificates"
fi
if [ -n "$shared" ]; then
  cp -a "$shared" "$work/src/shared"
else
  say "warning: no shared/ beside $repo: the Redfish mockup tests will skip"
fi

# The steps, run inside the machine by bash. Each step's output goes to
# /work/logs/STEP.log and to the terminal; a failed step is recorded and the
# tree restored to the clean clone before the next one.
cat >"$work/src/steps.sh" <<'STEPS'
#!/bin/bash
set -uo pipefail
export PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root GOPATH=/work/go GOMODCACHE=/work/go/pkg/mod GOCACHE=/work/go-build
cd /work/kiln
export GOFLAGS= GOTOOLCHAIN=$(cat hack/go-toolchain)
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  update-ca-certificates >/dev/null 2>&1 || echo "fresh-check: update-ca-certificates failed"
fi
if [ -d /work/shared/fixtures/redfish-mockups ]; then
  export KILN_REDFISH_MOCKUPS=/work/shared/fixtures/redfish-mockups
fi
mkdir -p /work/logs
: >/work/logs/failed
t0=$(date +%s)
# Packages whose tests need what a machine inside systemd-nspawn (sharing
# the host's network namespace) cannot give or must not do: network
# namespaces, bridges and nftables, nested systemd-nspawn or containerd,
# loop devices, libvirtd or VM boots. They are covered by `make test`
# (.ci/run) on a real machine; everything else runs here as root, not
# -short. The rule, so new packages fall on the right side by themselves: a
# package is left out when it is, or its tests import, one of the lab
# helpers below; a few packages that do such things directly are named.
helpers='host/netnstest|host/systemd/systemdtest|host/containerd/containerdtest|e2e/lab/(netns|nspawn|rack|libvirt)|e2e/kube|e2e/fleet'
direct='agent/lay|imagebuilder/(rootfs|disk|ociarchive)|e2e/lab/qemu'
step() {
  local name=$1; shift
  if [ -n "${KILN_FRESH_STEPS:-}" ] && ! [[ " $KILN_FRESH_STEPS " == *" $name "* ]]; then return 0; fi
  local s=$(date +%s)
  echo "fresh-check: ==== $name: $*"
  "$@" 2>&1 | tee "/work/logs/$name.log"
  local rc=${PIPESTATUS[0]}
  local dirty
  dirty=$(git status --porcelain --untracked-files=no)
  if [ -n "$dirty" ]; then
    { echo "fresh-check: $name left the clone modified:"; echo "$dirty" | head -n 10; } | tee -a "/work/logs/$name.log"
    git checkout -q -- . && git clean -qfd -e .bin -e bin
    [ "$rc" != 0 ] || rc=1
  fi
  echo "fresh-check: ==== $name: exit $rc after $(( $(date +%s) - s ))s"
  [ "$rc" = 0 ] || echo "$name" >>/work/logs/failed
}
# unprivileged runs a command as nobody, as a developer without root runs
# `make test-short` (the tier that needs no root): tests that need root
# skip with their reason instead of trying what a container cannot give.
# The throw-away Go caches are opened to it.
unprivileged() {
  mkdir -p "$GOCACHE" "$GOMODCACHE" && chmod -R a+rwX "$GOPATH" "$GOCACHE" || return 1
  # The clone is root's: git (VCS stamping of go build) trusts it only when told.
  runuser -u nobody -- env PATH="$PATH" HOME=/tmp GOPATH="$GOPATH" GOMODCACHE="$GOMODCACHE" GOCACHE="$GOCACHE" \
    GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=safe.directory GIT_CONFIG_VALUE_0='*' \
    GOFLAGS= GOTOOLCHAIN="$GOTOOLCHAIN" KILN_REDFISH_MOCKUPS="${KILN_REDFISH_MOCKUPS:-}" "$@"
}
fresh_tests() {
  local pkgs
  pkgs=$(go list -f '{{.ImportPath}} {{join .Imports " "}} {{join .TestImports " "}} {{join .XTestImports " "}}' ./... |
    sed 's#github.com/kilnhq/kiln/##g' |
    awk -v h="^($helpers|$direct)(/.*)?$" '{ for (i = 1; i <= NF; i++) if ($i ~ h) next; print "./" $1 }') || return 1
  echo "fresh-check: $(echo "$pkgs" | wc -l) packages (left out: those that are or import $helpers; and $direct)"
  # e2e/lab/qemu: every test but the VM boots (they need boot media, a
  # network namespace for PXE and minutes of TCG each).
  # shellcheck disable=SC2086
  go test -count=1 -timeout 30m $pkgs && \
    go test -count=1 -timeout 10m -skip 'Boot|Enrolls' ./e2e/lab/qemu
}
step deps ./hack/deps.sh
# generate on its own too: make check stops at go vet's first failure.
step generate make generate
step check make check
step build make build
step test-short unprivileged make test-short
step tests fresh_tests
echo "fresh-check: steps took $(( $(date +%s) - t0 ))s"
[ ! -s /work/logs/failed ]
STEPS
chmod +x "$work/src/steps.sh"

# The host's proxy settings, if any, are the network's too.
proxy_env=()
for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  [ -z "${!v:-}" ] || proxy_env+=("--setenv=$v=${!v}")
done
say "machine: systemd-nspawn on an overlay of the root, as root (output follows)"
set +e
SYSTEMD_NSPAWN_API_VFS_WRITABLE=network systemd-nspawn -q -D "$merged" -M "$machine" \
  --register=no --keep-unit --as-pid2 \
  --resolv-conf=copy-host --timezone=off --link-journal=no \
  --capability=all --system-call-filter='@keyring' \
  --bind="$work/src:/work" --bind-ro=/usr/local/go:/usr/local/go \
  --setenv=KILN_FRESH_STEPS="${KILN_FRESH_STEPS:-}" \
  "${proxy_env[@]}" \
  --chdir=/work/kiln /work/steps.sh &
nspawn_pid=$!
wait "$nspawn_pid"
rc=$?
nspawn_pid=""
set -e

# ---- the verdict -----------------------------------------------------------
logs=$work/src/logs
echo
echo "fresh-check: ---- summary ($commit, $(( $(date +%s) - start ))s)"
if [ ! -f "$logs/failed" ]; then
  echo "fresh-check: FAIL: the machine did not run the steps (systemd-nspawn exited $rc; its output is above)"
  exit 1
fi
failed=$(cat "$logs/failed")
if [ "$rc" = 0 ] && [ -z "$failed" ]; then
  echo "fresh-check: PASS: ${KILN_FRESH_STEPS:-deps generate check build test-short tests} on a fresh Debian 12 root"
  exit 0
fi
# For each failed step: the first line that names something missing, and
# the failed tests with the line after each.
pat='not found|No such file or directory|executable file not found|command not found|unknown (driver|protocol)|not installed|cannot find'
first=""
for s in $failed; do
  log=$logs/$s.log
  miss=$(grep -iE "$pat" "$log" 2>/dev/null | grep -v '^fresh-check:' | head -n 1 || true)
  [ -n "$first" ] || first=$miss
  echo "fresh-check: FAIL $s${miss:+: $miss}"
  grep -A1 -E -- '^\s*--- FAIL' "$log" 2>/dev/null | grep -v '^--$' | head -n 12 | sed 's/^/fresh-check:     /' || true
  if ! grep -qE -- '--- FAIL' "$log" 2>/dev/null; then
    grep -E -- '^(FAIL|make: \*\*\*|E: |deps: |generate: )' "$log" 2>/dev/null | head -n 3 | sed 's/^/fresh-check:     /' || true
  fi
done
[ -z "$first" ] || echo "fresh-check: first missing: $first"
exit 1
