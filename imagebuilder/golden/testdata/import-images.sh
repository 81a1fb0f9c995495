#!/bin/sh
# kiln-import-images: imports a Kiln golden image's offline Kubernetes
# image archives into containerd (namespace k8s.io), then writes the
# marker kiln-agent's preflight check offline-images waits for. Progress
# and errors go to stdout (the journal) and to the log that check quotes.
# kiln-import-images.service runs it and restarts it when it fails; each
# retry of the same boot waits longer.
set -u
root=${KILN_ROOT:-}
dir=$root/var/lib/kiln/images
log=$root/var/lib/kiln/images/.import.log
attempts=$root/run/kiln/import-images.attempts
backoff=${KILN_IMPORT_BACKOFF:-10}
limit=${KILN_IMPORT_TIMEOUT:-20m}

say() {
	echo "$*"
	echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $*" >>"$log"
}

mkdir -p "${attempts%/*}"
n=$(cat "$attempts" 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" >"$attempts"
if [ "$n" -gt 1 ]; then
	delay=$backoff
	i=2
	while [ "$i" -lt "$n" ] && [ "$delay" -lt 300 ]; do
		delay=$((delay * 2))
		i=$((i + 1))
	done
	[ "$delay" -gt 300 ] && delay=300
	say "attempt $n: retrying in ${delay}s"
	sleep "$delay"
fi

set -- "$dir"/*.tar
if [ ! -e "$1" ]; then
	say "no image archives in $dir"
	touch "$dir/.imported"
	rm -f "$attempts"
	exit 0
fi
total=$#
i=0
say "attempt $n: importing $total archives"
for f in "$@"; do
	i=$((i + 1))
	name=${f##*/}
	say "importing $i/$total $name"
	out=$(timeout "$limit" ctr -n k8s.io images import "$f" 2>&1)
	rc=$?
	if [ "$rc" -ne 0 ]; then
		[ -n "$out" ] && printf '%s\n' "$out" | tail -n 5 | while IFS= read -r line; do say "  $line"; done
		if [ "$rc" -eq 124 ]; then
			say "failed: importing $name did not finish within $limit"
		else
			say "failed: importing $name: ctr exited $rc"
		fi
		exit 1
	fi
	[ -n "$out" ] && echo "$out"
done
touch "$dir/.imported"
say "imported $total archives"
rm -f "$attempts"
