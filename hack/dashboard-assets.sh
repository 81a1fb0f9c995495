#!/usr/bin/env bash
# Refreshes the browser libraries `kilnctl dashboard` embeds (htmx and its
# SSE extension) from the npm registry, reproducibly: `npm ci` installs
# exactly what cmd/kilnctl/internal/dashboard/web/package-lock.json pins
# (versions and sha512 integrity), with no install scripts, in a temporary
# directory; the minified files and their licenses are copied to
# cmd/kilnctl/internal/dashboard/static/vendor/, which go:embed compiles
# into kilnctl. No node_modules is left in the tree.
#
#   hack/dashboard-assets.sh          copy the files the lock file pins
#   hack/dashboard-assets.sh --check  fail if the committed files differ
#
# To move to newer versions: edit the versions in web/package.json, run
# `npm install --package-lock-only --ignore-scripts` in web/ to rewrite
# the lock file, then run this script and commit all three (docs/dashboard.md).
set -euo pipefail
cd "$(dirname "$0")/.."
web=cmd/kilnctl/internal/dashboard/web
vendor=cmd/kilnctl/internal/dashboard/static/vendor
check=
[ "${1:-}" = --check ] && check=1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$web/package.json" "$web/package-lock.json" "$tmp/"
(cd "$tmp" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)

out="$tmp/vendor"
mkdir -p "$out"
cp "$tmp/node_modules/htmx.org/dist/htmx.min.js" "$out/htmx.min.js"
cp "$tmp/node_modules/htmx.org/LICENSE" "$out/htmx.LICENSE"
cp "$tmp/node_modules/htmx-ext-sse/dist/sse.min.js" "$out/sse.min.js"
cp "$tmp/node_modules/htmx-ext-sse/LICENSE" "$out/htmx-ext-sse.LICENSE"

if [ -n "$check" ]; then
  if ! diff -r "$out" "$vendor"; then
    echo "dashboard-assets: $vendor differs from what $web/package-lock.json pins: run hack/dashboard-assets.sh" >&2
    exit 1
  fi
  echo "dashboard-assets: $vendor matches the lock file"
  exit 0
fi
rm -rf "$vendor"
mkdir -p "$(dirname "$vendor")"
cp -r "$out" "$vendor"
echo "dashboard-assets: copied $(ls "$vendor" | tr '\n' ' ')to $vendor"
