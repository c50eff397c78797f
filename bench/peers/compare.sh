#!/usr/bin/env bash
# moex against Open MPI on this host: MPI_Alltoall and MPI_Allreduce (f32 sum) against
# `moex bench coll --transport shm`, same ranks and sizes, the two run alternately
# (ROUNDS times each), the best time of each kept. Prints one line per (op, ranks, size)
# with both times and the ratio (Open MPI time / moex time: above 1, moex is faster), the
# medians over the rounds and their ratio (what a user running it once should expect), and
# the AlltoAll bandwidth beside memcpy of the same bytes and beside the copy floor (the
# time this host needs to copy every byte of the operation once with all its CPUs and no
# synchronisation: no implementation that moves each byte once can beat it). For the
# AlltoAll rows that go through moex's shared areas with more ranks than CPUs, it also
# runs bench/peers/twocopy (the bare two-copy exchange: no communicator, no checks)
# in the same alternation and prints its best and median times: what a design that copies
# each byte twice, through shared memory, can reach on this host.
#
# For AlltoAll it also runs moex with its send and receive buffers from obuf.Shared
# (`--shared`: shared memory the other ranks read in place, one copy per byte, as NCCL's
# registered buffers) and prints that time and its ratio to Open MPI after the others.
#
# moex's buffers come from obuf, on huge pages (madvise); mpi_coll's from malloc, which
# here (transparent huge pages on madvise) gets 4 KiB pages, on which the kernel's
# cross-memory copy runs at half speed. MPI_HUGE=1 gives Open MPI's ranks glibc's huge-page
# malloc (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) to compare on equal pages.
#
# Installs Open MPI from Debian's packages when missing (needs root for apt-get).
# MOEX_BIN names a moex binary (with twocopy beside it) to use instead of building them.
# usage: [MPI_HUGE=1] [MOEX_BIN=path] bench/peers/compare.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
# mpicc comes with openmpi-bin; its headers (mpi.h) only with libopenmpi-dev.
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null ||
	! echo '#include <mpi.h>' | mpicc -E -x c - >/dev/null 2>&1; then
	echo "# installing Open MPI (openmpi-bin, libopenmpi-dev)" >&2
	apt-get update >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/mpi_coll" bench/peers/mpi_coll.c
if [ -n "${MOEX_BIN:-}" ]; then # built elsewhere (a host without Go): moex and twocopy beside it
	cp "$MOEX_BIN" "$work/moex"
	cp "$(dirname "$MOEX_BIN")/twocopy" "$work/twocopy"
else
	go build -o "$work/moex" ./cmd/moex
	go build -o "$work/twocopy" ./bench/peers/twocopy
fi
mpirun_version=$(mpirun --version 2>&1 | head -1)
mpi_env=()
pages="malloc's pages"
if [ "${MPI_HUGE:-0}" = 1 ]; then
	mpi_env=(-x GLIBC_TUNABLES=glibc.malloc.hugetlb=1)
	pages="huge-page malloc"
fi
echo "# $mpirun_version ($pages); moex $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; $(date -u +%FT%TZ)"
printf "%-10s %5s %10s %12s %12s %8s %12s %12s %8s %10s %8s %10s %9s %s\n" op ranks bytes moex_us ompi_us ratio moex_med ompi_med ratio_med shared_us ratio_sh shared_med ratio_shm note

best() { # field of the best (lowest time) JSON line for a size, from a file of lines
	python3 -c '
import sys, json
size, field = int(sys.argv[1]), sys.argv[2]
rows = [json.loads(l) for l in open(sys.argv[3]) if l.startswith("{")]
rows = [r for r in rows if r["bytes"] == size]
if not rows: print("nan"); sys.exit()
b = min(rows, key=lambda r: r["time_us"])
print(b[field])' "$@"
}

median() { # median time of a size, from a file of JSON lines
	python3 -c '
import sys, json, statistics
size = int(sys.argv[1])
rows = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
t = [r["time_us"] for r in rows if r["bytes"] == size]
print(statistics.median(t) if t else "nan")' "$@"
}

for spec in "alltoall 65536" "alltoall 4194304" "allreduce 65536" "allreduce 4194304" "allreduce 16777216"; do
	set -- $spec
	op=$1 size=$2
	for p in 2 4 8; do
		if [ "$op" = allreduce ] && [ "$p" = 8 ] && [ "$size" -gt 4194304 ]; then continue; fi
		: >"$work/moex.json"
		: >"$work/ompi.json"
		: >"$work/twocopy.json"
		: >"$work/shared.json"
		# The bare two-copy exchange where moex copies twice (buffers up to the 1 MiB area)
		# and its ranks share CPUs (with a CPU each, moex places blocks better than it).
		floor2=no
		if [ "$op" = alltoall ] && [ "$size" -le 1048576 ] && [ "$p" -gt "$(nproc)" ]; then floor2=yes; fi
		for r in $(seq "$rounds"); do
			"$work/moex" bench coll --op "$op" --ranks "$p" --transport shm --min-bytes "$size" --max-bytes "$size" --json >>"$work/moex.json"
			mpirun --allow-run-as-root --oversubscribe "${mpi_env[@]}" -np "$p" "$work/mpi_coll" "$op" "$size" "$size" >>"$work/ompi.json" 2>/dev/null
			if [ $floor2 = yes ]; then "$work/twocopy" -ranks "$p" -bytes "$size" >>"$work/twocopy.json"; fi
			if [ "$op" = alltoall ]; then
				"$work/moex" bench coll --op "$op" --ranks "$p" --transport shm --min-bytes "$size" --max-bytes "$size" --shared --json >>"$work/shared.json"
			fi
		done
		m=$(best "$size" time_us "$work/moex.json")
		o=$(best "$size" time_us "$work/ompi.json")
		note=""
		if [ "$op" = allreduce ] && [ "$size" -ge 1048576 ]; then
			fl=$(best "$size" floor_us "$work/moex.json")
			note=$(python3 -c "print(f'copy floor {float(\"$fl\"):.0f} us: moex at {float(\"$fl\")/float(\"$m\")*100:.0f}% of it, Open MPI at {float(\"$fl\")/float(\"$o\")*100:.0f}%; 2x Open MPI needs {float(\"$o\")/2:.0f} us')")
		fi
		if [ "$op" = alltoall ]; then
			bw=$(best "$size" algbw_gbs "$work/moex.json")
			mc=$(best "$size" memcpy_gbs "$work/moex.json")
			fl=$(best "$size" floor_us "$work/moex.json")
			note=$(python3 -c "print(f'moex algbw {float(\"$bw\"):.1f} GB/s = {float(\"$bw\")/float(\"$mc\")*100:.0f}% of memcpy ({float(\"$mc\"):.1f} GB/s); copy floor {float(\"$fl\"):.0f} us, 2x Open MPI needs {float(\"$o\")/2:.0f} us')")
			if [ $floor2 = yes ]; then
				tc=$(best "$size" time_us "$work/twocopy.json")
				tcm=$(median "$size" "$work/twocopy.json")
				note="$note; bare two-copy exchange $(python3 -c "print(f'{float(\"$tc\"):.1f} us (median {float(\"$tcm\"):.1f})')")"
			fi
		fi
		ratio=$(python3 -c "print(f'{float(\"$o\")/float(\"$m\"):.2f}x')")
		mm=$(median "$size" "$work/moex.json")
		om=$(median "$size" "$work/ompi.json")
		ratio_med=$(python3 -c "print(f'{float(\"$om\")/float(\"$mm\"):.2f}x')")
		sh=- shr=- shm=- shmr=-
		if [ "$op" = alltoall ]; then
			sh=$(python3 -c "print(f'{float(\"$(best "$size" time_us "$work/shared.json")\"):.1f}')")
			shm=$(python3 -c "print(f'{float(\"$(median "$size" "$work/shared.json")\"):.1f}')")
			shr=$(python3 -c "print(f'{float(\"$o\")/float(\"$sh\"):.2f}x')")
			shmr=$(python3 -c "print(f'{float(\"$om\")/float(\"$shm\"):.2f}x')")
		fi
		printf "%-10s %5s %10s %12.1f %12.1f %8s %12.1f %12.1f %8s %10s %8s %10s %9s %s\n" "$op" "$p" "$size" "$m" "$o" "$ratio" "$mm" "$om" "$ratio_med" "$sh" "$shr" "$shm" "$shmr" "$note"
	done
done
