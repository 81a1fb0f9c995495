#!/usr/bin/env bash
# Benchmark of image laying: agent/lay (kiln's LayImage, fetching from an
# HTTP server on loopback) against dd, dd conv=sparse, qemu-img convert,
# bmaptool copy and zstd reading the same images locally, all onto the
# same target file and all ending with an fsync.
#
#   hack/bench/lay.sh [SIZE_BYTES] [RUNS]
#
# Needs: qemu-utils, bmap-tools, zstd, coreutils. Writes a markdown table
# on stdout. Uses a temporary directory on the filesystem of $TMPDIR
# (default /var/tmp) and removes it at the end.
set -euo pipefail
export PATH=/usr/local/go/bin:$PATH
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

# measure NAME CMD...: runs CMD $runs times on a fresh target, prints the
# median seconds.
measure() {
	local name=$1; shift
	local times=()
	for _ in $(seq "$runs"); do
		rm -f "$tgt"; sync
		local t0 t1
		t0=$(date +%s.%N)
		"$@" >/dev/null 2>"$dir/err" || { cat "$dir/err" >&2; echo "$name failed" >&2; exit 1; }
		t1=$(date +%s.%N)
		times+=("$(echo "$t1 - $t0" | bc)")
	done
	local median
	median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n "$(( (runs + 1) / 2 ))p")
	echo "$name $median ${times[*]}"
}

lay() { "$dir/laybench" lay -target "$tgt" "$@"; }
dd_plain() { dd if="$1" of="$tgt" bs=4M conv=fsync status=none; }
dd_sparse() { dd if="$1" of="$tgt" bs=4M conv=sparse,fsync status=none; }
qemu() { qemu-img convert -f raw -O raw "$1" "$tgt" && sync "$tgt"; }
bmap() { bmaptool -q copy --bmap "$dir/sparse.bmap" "$1" "$tgt"; }
unzst() { zstd -q -d -f --sparse "$1" -o "$tgt" && sync "$tgt"; }

{
measure "dense/dd" dd_plain "$dir/dense.raw"
measure "dense/dd-sparse" dd_sparse "$dir/dense.raw"
measure "dense/qemu-img" qemu "$dir/dense.raw"
measure "dense/kiln-lay-stream" lay -image "$dir/dense.raw" -sha256 "$dense_sha" -raw-size "$size"
measure "dense/kiln-lay-blockmap" lay -image "$dir/dense.raw" -manifest "$dir/dense.json"
measure "sparse20/dd" dd_plain "$dir/sparse.raw"
measure "sparse20/dd-sparse" dd_sparse "$dir/sparse.raw"
measure "sparse20/qemu-img" qemu "$dir/sparse.raw"
measure "sparse20/bmaptool" bmap "$dir/sparse.raw"
measure "sparse20/kiln-lay-stream" lay -image "$dir/sparse.raw" -sha256 "$sparse_sha" -raw-size "$size"
measure "sparse20/kiln-lay-blockmap" lay -image "$dir/sparse.raw" -manifest "$dir/sparse.json"
measure "sparse20.zst/zstd-d" unzst "$dir/sparse.raw.zst"
measure "sparse20.zst/kiln-lay" lay -image "$dir/sparse.raw.zst" -format raw.zst -sha256 "$zst_sha" -raw-size "$size"
} | tee "$dir/results" >&2

echo
echo "| case | tool | median s | runs (s) |"
echo "|---|---|---|---|"
while read -r name median rest; do
	echo "| ${name%%/*} | ${name#*/} | $median | $rest |"
done <"$dir/results"
echo
ls -ls "$dir"/dense.raw "$dir"/sparse.raw "$dir"/sparse.raw.zst >&2
