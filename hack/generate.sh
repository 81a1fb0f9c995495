#!/usr/bin/env bash
# Regenerates the Go code of proto/ with pinned generators:
#   protoc 3.21.12 (Debian bookworm's protobuf-compiler),
#   protoc-gen-go v1.36.12, protoc-gen-go-grpc v1.5.1.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$PWD/.bin"
want_protoc="libprotoc 3.21.12"
if [ "$(protoc --version)" != "$want_protoc" ]; then
  echo "generate: need $want_protoc (apt-get install protobuf-compiler on Debian 12), have $(protoc --version)" >&2
  exit 1
fi
[ -x "$BIN/protoc-gen-go" ] || GOBIN="$BIN" go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
[ -x "$BIN/protoc-gen-go-grpc" ] || GOBIN="$BIN" go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
export PATH="$BIN:$PATH"
find proto -name '*.pb.go' -delete
protoc -I proto \
  --go_out=. --go_opt=module=github.com/kilnhq/kiln \
  --go-grpc_out=. --go-grpc_opt=module=github.com/kilnhq/kiln \
  $(find proto -name '*.proto' | sort)
