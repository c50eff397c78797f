#!/usr/bin/env bash
# Reruns every figure of docs/PERFORMANCE.md on the current build and rewrites the file
# (bench/perfdoc: it builds moex and runs each `moex bench`). Takes about half an hour on
# two CPUs. usage: docs/perf.sh [-quick] [-against COMMIT] [-only SECTION,...]
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./bench/perfdoc -out docs/PERFORMANCE.md "$@"
