#!/usr/bin/env bash
# make bench: runs the Go benchmarks of every package and the comparison
# scripts in hack/bench/ (which time Kiln against dd, qemu-img, bmaptool and
# the like in one run). Results are written up in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
export GOTOOLCHAIN=$(cat hack/go-toolchain) # README, "Go version"
out=${BENCH_OUT:-$(mktemp -d)}
echo "bench: Go benchmarks -> $out/go.txt"
go test -run '^$' -bench . -benchmem -count 1 -timeout 60m ./... | tee "$out/go.txt"
for s in hack/bench/*.sh; do
  [ -e "$s" ] || continue
  echo "bench: $s"
  bash "$s" | tee "$out/$(basename "$s" .sh).txt"
done
echo "bench: results in $out"
