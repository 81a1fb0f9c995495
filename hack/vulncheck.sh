#!/usr/bin/env bash
# Known-vulnerability check (docs/security.md, "Known vulnerabilities").
# govulncheck (golang.org/x/vuln, pinned) against a database read from a
# pinned golang.org/x/vulndb module: the public endpoint vuln.go.dev cannot
# be reached from CI, but the Go module proxy serves the vulndb repository,
# whose data/osv directory govulncheck reads as a local database. Fails when
# a vulnerable symbol is reachable from Kiln's code; findings in modules or
# packages Kiln requires but never calls are listed by `-show verbose` and do
# not fail.
#
#   hack/vulncheck.sh             # the whole module
#   hack/vulncheck.sh ./agent/... # some packages
#
# To refresh the database, set VULNDB_VERSION to a newer pseudo-version
# (`go list -m -versions golang.org/x/vulndb` lists none; ask the proxy with
# `go list -m golang.org/x/vulndb@master`), run this script and commit.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
# The toolchain the project builds with (README); govulncheck judges the
# standard library by the Go that runs it.
export GOTOOLCHAIN=$(cat hack/go-toolchain)

GOVULNCHECK_VERSION=v1.9.0
VULNDB_VERSION=v0.0.0-20261105234957-e22db6528018

dir=$(go mod download -json "golang.org/x/vulndb@$VULNDB_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
if [[ -z $dir || ! -d $dir/data/osv ]]; then
	echo "vulncheck: golang.org/x/vulndb@$VULNDB_VERSION has no data/osv (download failed?)" >&2
	exit 1
fi
echo "vulncheck: govulncheck $GOVULNCHECK_VERSION, $(go env GOVERSION), database golang.org/x/vulndb@$VULNDB_VERSION ($(ls "$dir/data/osv" | wc -l) entries)"
exec go run "golang.org/x/vuln/cmd/govulncheck@$GOVULNCHECK_VERSION" -db "file://$dir/data/osv" "${@:-./...}"
