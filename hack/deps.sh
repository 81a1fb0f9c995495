#!/usr/bin/env bash
# Installs the Debian packages Kiln's checks, tests, lab and benchmarks need
# (make check, make test, make lab, make bench), as root, without starting
# any of their system services. Used by .ci/run and make lab.
#
# Packages are installed with --no-install-recommends, so everything a step
# uses is listed here, recommends included (libprotobuf-dev is only a
# recommend of protobuf-compiler, qemu-block-extra only of qemu-system-x86).
# make fresh-check proves the list on a fresh Debian 12 root (docs/ci.md).
set -euo pipefail
say() { echo "deps: $*"; }
pkgs=(
  # generation and checks: protoc and the well-known .proto files
  # (google/protobuf/timestamp.proto, ...) it compiles against
  protobuf-compiler libprotobuf-dev openssl
  # the C headers cgo needs: with gcc on PATH, go builds runtime/cgo (the
  # agent's dependency test, go vet) and fails without them (libc6-dev is
  # only a recommend of gcc)
  libc6-dev
  # BMC peers
  openipmi ipmitool
  # host operations, namespaces, systemd hosts
  iproute2 nftables kmod procps util-linux dbus systemd-container debootstrap
  containerd runc containernetworking-plugins iptables conntrack socat ethtool ebtables
  # disks and images
  zstd bmap-tools qemu-utils dosfstools mtools fdisk e2fsprogs xorriso cpio busybox-static
  grub-pc-bin grub-efi-amd64-bin grub-common
  # metrics tests: promtool (check metrics, check rules) lints the
  # controller's and the agent's scrapes and docs/observability/kiln-alerts.yaml
  prometheus
  # dashboard browser tests (cmd/kilnctl/internal/dashboard): headless
  # Chromium driven by chromedp; fonts-dejavu-core so pages render text
  # without recommends
  chromium fonts-dejavu-core
  # make bench: hack/bench/lay.sh (with qemu-utils, bmap-tools, zstd above)
  # sums CPU times with bc
  bc
  # VMs and PXE; qemu-block-extra holds QEMU's curl block driver (media
  # inserted by URL); libvirtd for the libvirt backend (tests run a private one)
  qemu-system-x86 qemu-block-extra ovmf ipxe-qemu seabios dnsmasq-base syslinux syslinux-common
  libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients
)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${#missing[@]} packages (1-4 min on a fresh machine): ${missing[*]}"
  apt-get update -qq
  # No package may start its system service (containerd, libvirtd, ...): the
  # tests start their own instances and stop them by PID.
  own_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ -z "$own_policy" ] || rm -f /usr/sbin/policy-rc.d
fi
say "packages ready"
