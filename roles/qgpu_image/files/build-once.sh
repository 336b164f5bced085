#!/bin/bash
# build-once.sh DIR [--compile PYTHON] -- COMMAND...
# Builds the cache entry DIR once: runs COMMAND with every "@PARTIAL@" in its arguments replaced by
# DIR.partial, optionally byte-compiles the result (hash-based .pyc: valid whatever the file times
# in the image), then renames DIR.partial to DIR. A lock serialises concurrent builds of the same
# entry; an interrupted build leaves only DIR.partial, which the next run discards.
# Prints "built DIR" or "cached DIR" (the role's changed_when reads it).
set -euo pipefail
dir=$1; shift
compile=""
if [ "${1:-}" = "--compile" ]; then compile=$2; shift 2; fi
[ "${1:-}" = "--" ] || { echo "build-once.sh: expected -- before the command, got '${1:-}'" >&2; exit 2; }
shift
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ -d "$dir" ]; then echo "cached $dir"; exit 0; fi
partial=$dir.partial
rm -rf "$partial"
mkdir -p "$partial"
"${@//@PARTIAL@/$partial}"
if [ -n "$compile" ]; then
  "$compile" -m compileall -q -j 0 --invalidation-mode unchecked-hash "$partial" >/dev/null \
    || echo "build-once.sh: some files did not byte-compile; they stay source-only" >&2
fi
mv "$partial" "$dir"
echo "built $dir"
