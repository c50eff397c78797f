#!/usr/bin/env bash
# The slow scenarios that `go test -race ./...` leaves out (its quick cut keeps one type
# of each element size, fewer rank counts and messages up to 1 MiB): the full collective
# matrices (every element type, every rank count of the tests, 1 MiB per type), the
# transport conformance suite's 8 and 64 MiB messages, every polling and copy variant of
# the multi-process runs, and the MoE step as processes over tcp. Without the race
# detector, which would make them take several times as long; CI runs this after the
# race run.
set -euo pipefail
cd "$(dirname "$0")/.."
go test -count=1 -timeout 15m -run 'Matrix|Hier|Conformance|MultiProcessAllToAll|MultiProcessShm$|KilledRankBlamed|MoEProcesses$' "$@" \
	./coll/ ./combine/ ./transport/inproc/ ./transport/shm/ ./transport/tcp/ -args -long
