#!/bin/busybox sh
# Kiln boot-media init: mount the kernel filesystems, load the modules in
# dependency order, bring up a NIC with DHCP and run the agent in boot mode.
# The agent reads kiln.controller=, kiln.token=, kiln.ca_hash=, kiln.host=
# and kiln.boot= from /proc/cmdline itself.
/bin/busybox mkdir -p /proc /sys /dev /run /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t tmpfs -o mode=0755 run /run
log() { echo "kiln-init: $* (uptime $(cut -d' ' -f1 /proc/uptime))"; }
log "start, kernel $(uname -r)"

for m in $(cat /etc/kiln/modules); do
  insmod "/lib/modules/$m" 2>/dev/null || log "insmod $m failed"
done
log "modules loaded"

bootif= host= shell= addr= gw= dns=
for a in $(cat /proc/cmdline); do
  case "$a" in
    BOOTIF=*) bootif=$(echo "${a#BOOTIF=}" | sed 's/^01-//; s/-/:/g' | tr 'A-F' 'a-f') ;;
    kiln.mac=*) bootif=$(echo "${a#kiln.mac=}" | tr 'A-F' 'a-f') ;;
    kiln.ip=*) addr=${a#kiln.ip=} ;;
    kiln.gateway=*) gw=${a#kiln.gateway=} ;;
    kiln.dns=*) dns=${a#kiln.dns=} ;;
    kiln.host=*) host=${a#kiln.host=} ;;
    kiln.shell) shell=1 ;;
  esac
done
[ -n "$host" ] && hostname "$host"
ip link set lo up

# Power button (ACPI, e.g. a BMC's graceful shutdown): /etc/acpi/PWRF/00000080.
acpid -c /etc/acpi -l /dev/null 2>/dev/null

up=
# Static address (kiln.ip=ADDR/PREFIX kiln.gateway=GW kiln.mac=MAC): racks
# without DHCP, where the BMC's virtual media is the only way in.
if [ -n "$addr" ]; then
  for try in 1 2 3 4 5 6 7 8 9 10; do
    for d in /sys/class/net/*; do
      i=${d##*/}
      [ "$i" = lo ] && continue
      if [ -n "$bootif" ] && [ "$(cat $d/address)" != "$bootif" ]; then continue; fi
      ip addr add "$addr" dev "$i" && ip link set "$i" up && up=$i && break 2
    done
    sleep 1
  done
  if [ -n "$up" ]; then
    [ -n "$gw" ] && ip route add default via "$gw" dev "$up"
    for d in $(echo "$dns" | tr ',' ' '); do echo "nameserver $d" >> /etc/resolv.conf; done
    log "net static $up $addr gateway ${gw:-none}"
  fi
fi
for try in 1 2 3 4 5 6 7 8 9 10; do
  [ -n "$up" ] && break
  for d in /sys/class/net/*; do
    i=${d##*/}
    [ "$i" = lo ] && continue
    if [ -n "$bootif" ] && [ "$(cat $d/address)" != "$bootif" ]; then continue; fi
    ip link set "$i" up
    if udhcpc -i "$i" -n -q -t 4 -T 2 -s /etc/kiln/udhcpc.script >/dev/null 2>&1; then up=$i; break 2; fi
  done
  sleep 1
done
if [ -n "$up" ]; then
  log "net up $up $(ip -4 -o addr show dev $up | awk '{print $4}' | tr '\n' ' ')"
else
  log "no DHCP lease on any NIC"
fi
[ -n "$shell" ] && setsid cttyhack sh

mkdir -p /run/kiln-agent
n=0
# The controller's Reboot RPC (after the image is laid: boot from disk)
# and power off: busybox's, straight to the kernel (sync first; there is
# no init to go through, and nothing else to stop).
while :; do
  log "agent up"
  /sbin/kiln-agent run --data-dir /run/kiln-agent --reboot-command "reboot -f" --poweroff-command "poweroff -f"
  rc=$?
  n=$((n+1))
  log "agent exited rc=$rc; restart $n in 5s"
  sleep 5
done
