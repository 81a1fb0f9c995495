#!/usr/bin/env bash
# Installs the Debian packages Kiln's tests and lab need (as root), without
# starting any of their system services. Used by .ci/run and make lab.
set -euo pipefail
say() { echo "deps: $*"; }
pkgs=(
  # generation and checks
  protobuf-compiler openssl
  # BMC peers
  openipmi ipmitool
  # host operations, namespaces, systemd hosts
  iproute2 nftables kmod procps util-linux dbus systemd-container debootstrap
  containerd runc containernetworking-plugins iptables conntrack socat ethtool ebtables
  # disks and images
  zstd bmap-tools qemu-utils dosfstools mtools fdisk e2fsprogs xorriso cpio busybox-static
  grub-pc-bin grub-efi-amd64-bin grub-common
  # VMs and PXE; libvirtd for the libvirt backend (tests run a private one)
  qemu-system-x86 ovmf ipxe-qemu dnsmasq-base syslinux syslinux-common
  libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients
)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
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
