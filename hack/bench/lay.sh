#!/usr/bin/env bash
# Benchmark of image laying: agent/lay (kiln's LayImage, fetching from an
# HTTP server on loopback) against dd, dd conv=sparse, qemu-img convert,
# bmaptool copy and zstd reading the same images locally, all onto the
# same target file and all ending with an fsync.
#
#   hack/bench/lay.sh [SIZE_BYTES] [RUNS]
#
# ONLY=sparse20 runs only the cases of that image (dense, sparse20,
# sparse20.zst). LAYBENCH_B=FILE adds the case sparse20/kiln-lay-blockmap-B:
# the same lay with another build of laybench (e.g. of an earlier commit:
# `mkdir /tmp/old && git archive COMMIT | tar -x -C /tmp/old && (cd /tmp/old
# && go build -o /tmp/laybench-old ./hack/bench/laybench)`), interleaved
# with the others, for before/after comparisons.
#
# Needs: qemu-utils, bmap-tools, zstd, coreutils. Writes a markdown table
# on stdout. Uses a temporary directory on the filesystem of $TMPDIR
# (default /var/tmp) and removes it at the end.
set -euo pipefail
export PATH=/usr/local/go/bin:$PATH
export GOTOOLCHAIN=$(cat "$(dirname "$0")/../go-toolchain") # README, "Go version"
cd "$(dirname "$0")/../.."

size=${1:-1073741824}
runs=${2:-3}
dir=$(mktemp -d "${TMPDIR:-/var/tmp}/kiln-laybench.XXXXXX")
trap 'rm -rf "$dir"' EXIT

go build -o "$dir/laybench" ./hack/bench/laybench
"$dir/laybench" gen -dir "$dir" -size "$size" -data 20 >&2
zstd -q -T0 -3 "$dir/sparse.raw" -o "$dir/sparse.raw.zst"
bmaptool -q create -o "$dir/sparse.bmap" "$dir/sparse.raw"
dense_sha=$(sha256sum "$dir/dense.raw" | cut -d' ' -f1)
sparse_sha=$(sha256sum "$dir/sparse.raw" | cut -d' ' -f1)
zst_sha=$(sha256sum "$dir/sparse.raw.zst" | cut -d' ' -f1)
# Warm the page cache with every source, as each tool below reads them.
cat "$dir"/dense.raw "$dir"/sparse.raw "$dir"/sparse.raw.zst >/dev/null

tgt="$dir/target.img"

# once NAME CMD...: runs CMD once on a fresh target and appends
# "NAME SECONDS CPU_SECONDS" (wall clock; user+system time of CMD and its
# children) to the results.
once() {
	local name=$1; shift
	[[ -z ${ONLY:-} || ${name%%/*} == "$ONLY" ]] || return 0
	rm -f "$tgt"; sync
	local TIMEFORMAT='%3R %3U %3S' wall user sys
	{ time "$@" >/dev/null 2>"$dir/err" || { cat "$dir/err" >&2; echo "$name failed" >&2; exit 1; }; } 2>"$dir/time"
	read -r wall user sys <"$dir/time"
	echo "$name $wall $(echo "$user + $sys" | bc)" | tee -a "$dir/times" >&2
}

lay() { "$dir/laybench" lay -target "$tgt" "$@"; }
dd_plain() { dd if="$1" of="$tgt" bs=4M conv=fsync status=none; }
dd_sparse() { dd if="$1" of="$tgt" bs=4M conv=sparse,fsync status=none; }
# qemu-img convert's default cache mode for the target is "unsafe" (it
# never flushes), hence the sync; -t none -W is its fastest durable form:
# O_DIRECT, out-of-order writes from 8 coroutines, fdatasync at the end.
qemu() { qemu-img convert -f raw -O raw "$1" "$tgt" && sync "$tgt"; }
qemu_direct() { qemu-img convert -t none -W -f raw -O raw "$1" "$tgt"; }
bmap() { bmaptool -q copy --bmap "$dir/sparse.bmap" "$1" "$tgt"; }
unzst() { zstd -q -d -f --sparse "$1" -o "$tgt" && sync "$tgt"; }

# run_case I: the I-th case, once.
ncases=16
[[ -z ${LAYBENCH_B:-} ]] || ncases=17
run_case() {
	case $1 in
	0) once "dense/dd" dd_plain "$dir/dense.raw" ;;
	1) once "dense/dd-sparse" dd_sparse "$dir/dense.raw" ;;
	2) once "dense/qemu-img" qemu "$dir/dense.raw" ;;
	3) once "dense/qemu-img-t-none-W" qemu_direct "$dir/dense.raw" ;;
	4) once "dense/kiln-lay-stream" lay -image "$dir/dense.raw" -sha256 "$dense_sha" -raw-size "$size" ;;
	5) once "dense/kiln-lay-blockmap" lay -image "$dir/dense.raw" -manifest "$dir/dense.json" ;;
	6) once "sparse20/dd" dd_plain "$dir/sparse.raw" ;;
	7) once "sparse20/dd-sparse" dd_sparse "$dir/sparse.raw" ;;
	8) once "sparse20/qemu-img" qemu "$dir/sparse.raw" ;;
	9) once "sparse20/qemu-img-t-none-W" qemu_direct "$dir/sparse.raw" ;;
	10) once "sparse20/bmaptool" bmap "$dir/sparse.raw" ;;
	11) once "sparse20/kiln-lay-stream" lay -image "$dir/sparse.raw" -sha256 "$sparse_sha" -raw-size "$size" ;;
	12) once "sparse20/kiln-lay-blockmap" lay -image "$dir/sparse.raw" -manifest "$dir/sparse.json" ;;
	13) once "sparse20.zst/zstd-d" unzst "$dir/sparse.raw.zst" ;;
	14) once "sparse20.zst/kiln-lay" lay -image "$dir/sparse.raw.zst" -format raw.zst -sha256 "$zst_sha" -raw-size "$size" ;;
	# The disk's part of a block-map lay alone: the same writes, from memory.
	15) once "sparse20/writes-only" "$dir/laybench" writes -manifest "$dir/sparse.json" -target "$tgt" ;;
	16) once "sparse20/kiln-lay-blockmap-B" "$LAYBENCH_B" lay -target "$tgt" -image "$dir/sparse.raw" -manifest "$dir/sparse.json" ;;
	esac
}

# Each round runs every case once, starting at a different case, so that
# load from other users of the machine (and the writeback left by the
# previous case) spreads over all tools rather than hitting one.
sync; sleep 2
load0=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq 0 $((runs - 1))); do
	for i in $(seq 0 $((ncases - 1))); do
		run_case $(( (i + r * 5) % ncases ))
	done
done

# NAME MEDIAN MEDIAN_CPU RUN1 RUN2 ..., sorted by case.
awk '{ if (!($1 in n)) order[k++] = $1; j = n[$1]++; t[$1, j] = $2; c[$1, j] = $3 }
function median(arr, m,   a, b, x) {
	for (a = 0; a < m; a++) for (b = a + 1; b < m; b++) if (arr[b] < arr[a]) { x = arr[a]; arr[a] = arr[b]; arr[b] = x }
	return arr[int((m - 1) / 2)]
}
END {
	for (i = 0; i < k; i++) {
		name = order[i]; m = n[name]; line = ""
		for (j = 0; j < m; j++) { v[j] = t[name, j]; u[j] = c[name, j]; line = line " " sprintf("%.2f", v[j]) }
		printf "%s %.2f %.2f%s\n", name, median(v, m), median(u, m), line
	}
}' "$dir/times" | sort -t/ -k1,1 -s >"$dir/results"

echo
echo "load average before/after: $load0 / $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| case | tool | median s | median CPU s | runs (s) |"
echo "|---|---|---|---|---|"
while read -r name median cpu rest; do
	echo "| ${name%%/*} | ${name#*/} | $median | $cpu | $rest |"
done <"$dir/results"
echo
# Ratios of medians, as the targets state them: >1 means kiln-lay is faster.
awk '{ m[$1] = $2 }
function r(a, b) { return (m[a] > 0 && m[b] > 0) ? sprintf("%.2f", m[a] / m[b]) : "n/a" }
END {
	print "- dense: kiln-lay stream is " r("dense/dd", "dense/kiln-lay-stream") "x and block map " r("dense/dd", "dense/kiln-lay-blockmap") "x as fast as dd (target >= 0.9)"
	print "- sparse20: kiln-lay block map is " r("sparse20/bmaptool", "sparse20/kiln-lay-blockmap") "x as fast as bmaptool, " r("sparse20/qemu-img", "sparse20/kiln-lay-blockmap") "x qemu-img, " r("sparse20/qemu-img-t-none-W", "sparse20/kiln-lay-blockmap") "x qemu-img -t none -W (target > 1)"
	if ("sparse20/kiln-lay-blockmap-B" in m) print "- sparse20: kiln-lay block map is " r("sparse20/kiln-lay-blockmap-B", "sparse20/kiln-lay-blockmap") "x as fast as build B (LAYBENCH_B)"
	print "- sparse20.zst: kiln-lay raw.zst takes " r("sparse20.zst/kiln-lay", "sparse20/kiln-lay-stream") "x the time of the raw stream (target <= 1.3)"
}' "$dir/results"
echo
ls -ls "$dir"/dense.raw "$dir"/sparse.raw "$dir"/sparse.raw.zst >&2
