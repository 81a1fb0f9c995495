#!/usr/bin/env bash
# Rebuilds the "Details" part of docs/benchmarks.md from docs/bench/*.md
# (each area keeps its own measured numbers and reproduce commands there).
set -euo pipefail
cd "$(dirname "$0")/.."
doc=docs/benchmarks.md
head=$(sed '/^<!-- details -->$/q' "$doc")
{
  printf '%s\n\n' "$head"
  for f in docs/bench/*.md; do
    # demote headings one level so each area is a section of this page
    sed -e 's/^#/##/' "$f"
    printf '\n'
  done
} > "$doc.tmp"
mv "$doc.tmp" "$doc"
