#!/usr/bin/env bash
# Regenerates the Go code of proto/ with pinned generators:
#   protoc 3.21.12 (Debian bookworm's protobuf-compiler, with the well-known
#   .proto files from libprotobuf-dev), protoc-gen-go v1.36.12,
#   protoc-gen-go-grpc v1.5.1.
# protoc writes into a temporary directory; the generated *.pb.go in proto/
# are replaced only when it succeeded, so a failure leaves the tree as it was.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$PWD/.bin"
want_protoc="libprotoc 3.21.12"
if ! command -v protoc >/dev/null; then
  echo "generate: protoc not found: need $want_protoc (apt-get install protobuf-compiler libprotobuf-dev on Debian 12, or ./hack/deps.sh)" >&2
  exit 1
fi
if [ "$(protoc --version)" != "$want_protoc" ]; then
  echo "generate: need $want_protoc (apt-get install protobuf-compiler on Debian 12), have $(protoc --version)" >&2
  exit 1
fi
# The well-known types the protos import: Debian ships them in
# libprotobuf-dev, only a recommend of protobuf-compiler.
wkt_dir=""
for d in /usr/include /usr/local/include; do
  if [ -f "$d/google/protobuf/timestamp.proto" ]; then wkt_dir=$d; break; fi
done
if [ -z "$wkt_dir" ]; then
  echo "generate: google/protobuf/timestamp.proto not found in /usr/include: apt-get install libprotobuf-dev (or ./hack/deps.sh)" >&2
  exit 1
fi
[ -x "$BIN/protoc-gen-go" ] || GOBIN="$BIN" go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
[ -x "$BIN/protoc-gen-go-grpc" ] || GOBIN="$BIN" go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
export PATH="$BIN:$PATH"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
protoc -I proto -I "$wkt_dir" \
  --go_out="$out" --go_opt=module=github.com/kilnhq/kiln \
  --go-grpc_out="$out" --go-grpc_opt=module=github.com/kilnhq/kiln \
  $(find proto -name '*.proto' | sort)
if [ ! -d "$out/proto" ]; then
  echo "generate: protoc wrote nothing under proto/ (see above); proto/ left unchanged" >&2
  exit 1
fi
# protoc succeeded: the new set replaces the old one (a removed .proto's
# code goes with it).
find proto -name '*.pb.go' -delete
(cd "$out" && find proto -name '*.pb.go' -print0) | while IFS= read -r -d '' f; do
  mkdir -p "$(dirname "$f")"
  cp "$out/$f" "$f"
done
