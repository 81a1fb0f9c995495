#!/bin/sh
# Run by acpid when the power button is pressed: stop the agent, power off.
exec >/dev/console 2>&1
echo "kiln-init: power button, shutting down"
kill -TERM $(pidof kiln-agent) 2>/dev/null
sleep 1
sync
poweroff -f
