#!/usr/bin/env bash
# Runs every Go fuzz target for FUZZTIME each (default 10m), one at a time
# with one worker, and prints how long each ran and what it found
# (docs/security.md, "Fuzzing"). `make test` runs only their seed corpora.
#
#   hack/fuzz.sh                      # every target, FUZZTIME each
#   FUZZTIME=2m hack/fuzz.sh          # shorter
#   hack/fuzz.sh FuzzDecode FuzzLoad  # only these
#   hack/fuzz.sh -l                   # list the targets
#
# A finding is written to PKG/testdata/fuzz/FuzzX/ by go test: fix the
# code, keep the file as a regression seed and commit both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
export GOTOOLCHAIN=$(cat hack/go-toolchain) # README, "Go version"
FUZZTIME=${FUZZTIME:-10m}
# The test binaries run at the lowest priority; the build does not.
NICE=${FUZZNICE:-19}

# package target
targets() {
	git grep -l '^func Fuzz' -- '*_test.go' | while read -r f; do
		sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(f \*testing\.F).*/\1/p' "$f" | while read -r fn; do
			echo "./$(dirname "$f") $fn"
		done
	done | sort -u
}

if [[ ${1:-} == -l ]]; then
	targets | column -t
	exit 0
fi

want=("$@")
fail=0
results=()
while read -r pkg fn; do
	if ((${#want[@]})) && [[ " ${want[*]} " != *" $fn "* ]]; then
		continue
	fi
	echo "=== $fn ($pkg, $FUZZTIME)"
	start=$(date +%s)
	set +e
	go test -vet=off -exec "nice -n $NICE" -run '^$' -fuzz "^$fn\$" -fuzztime "$FUZZTIME" -timeout 0 -parallel 1 "$pkg" 2>&1 | tee "/tmp/kiln-fuzz-$fn.log"
	rc=${PIPESTATUS[0]}
	set -e
	execs=$(grep -o 'execs: [0-9]*' "/tmp/kiln-fuzz-$fn.log" | tail -1 | cut -d' ' -f2)
	status=ok
	if ((rc != 0)); then
		status="FAILED: see /tmp/kiln-fuzz-$fn.log and $pkg/testdata/fuzz/$fn/"
		fail=1
	fi
	results+=("$(printf '%-24s %-34s %5ss %10s execs  %s' "$fn" "$pkg" "$(($(date +%s) - start))" "${execs:-0}" "$status")")
done < <(targets)

echo
echo "target                   package                            ran        execs  result"
printf '%s\n' "${results[@]}"
exit $fail
