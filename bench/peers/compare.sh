#!/usr/bin/env bash
# moex against two MPIs on this host: Open MPI and MPICH, each one's MPI_Allreduce (f32
# sum), MPI_Reduce_scatter_block (f32 sum), MPI_Allgather and MPI_Alltoall
# (bench/peers/mpi_coll.c, built with each one's mpicc) against `moex bench coll
# --transport shm`, the same ranks and sizes, the three run in turn ROUNDS times. One line
# per (op, ranks, size): each one's median time over the rounds, the ratio of the better
# MPI's median to moex's (above 1, moex is faster), moex's best, and the copy floor (the
# time this host needs to read and write once, with all its CPUs and no synchronisation,
# the bytes the operation must move: docs/PERFORMANCE.md says which) with the fraction of
# it each side reaches. Where twice the better MPI would be faster than the floor, the
# note says that "2x" is out of reach rather than quoting it.
#
# For AlltoAll it also runs moex with its buffers from obuf.Shared (`--shared`: shared
# memory the other ranks read in place, as NCCL's registered buffers) and, where moex's
# ranks share CPUs and blocks go through its shared areas (up to 1 MiB), the bare two-copy
# exchange (bench/peers/twocopy: what copying each byte twice through shared memory can
# reach here).
#
# Each side runs on equal pages, twice: moex with its obuf buffers (2 MiB pages from 256
# KiB) against each MPI with its buffers on 2 MiB pages (MPI_COLL_HUGE=1), and moex on Go
# slices (--heap, 4 KiB pages) against each MPI on malloc'd buffers (4 KiB pages here, THP
# being "madvise"): vs_mpi_huge and vs_mpi_malloc are the better MPI's median over moex's
# (above 1, moex is faster). MPICH busy-polls: with more ranks than CPUs its ranks take the
# CPU from each other. Installs Open MPI and MPICH from Debian's packages when missing
# (needs root for apt-get). MOEX_BIN names a moex binary (with twocopy beside it) to use instead of
# building them. OPS, SIZES and RANKS narrow the sweep.
# usage: [OPS="allreduce ..."] [SIZES="65536 ..."] [RANKS="2 4 8"] bench/peers/compare.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
ops=${OPS:-allreduce reducescatter allgather alltoall}
sizes=${SIZES:-65536 1048576 4194304 16777216 67108864}
ranks=${RANKS:-2 4 8}
need=()
command -v mpicc.openmpi >/dev/null && echo '#include <mpi.h>' | mpicc.openmpi -E -x c - >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
command -v mpicc.mpich >/dev/null && echo '#include <mpi.h>' | mpicc.mpich -E -x c - >/dev/null 2>&1 || need+=(mpich libmpich-dev)
if [ ${#need[@]} -gt 0 ]; then
	echo "# installing ${need[*]}" >&2
	apt-get update >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc.openmpi -O2 -o "$work/mpi_ompi" bench/peers/mpi_coll.c
mpicc.mpich -O2 -o "$work/mpi_mpich" bench/peers/mpi_coll.c
if [ -n "${MOEX_BIN:-}" ]; then # built elsewhere (a host without Go): moex and twocopy beside it
	cp "$MOEX_BIN" "$work/moex"
	cp "$(dirname "$MOEX_BIN")/twocopy" "$work/twocopy"
else
	go build -o "$work/moex" ./cmd/moex
	go build -o "$work/twocopy" ./bench/peers/twocopy
fi
echo "# $(mpirun.openmpi --version 2>&1 | head -1); MPICH $(mpichversion 2>/dev/null | awk '/Version/ {print $3}'); moex $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; $(date -u +%FT%TZ); medians of $rounds rounds"
printf "%-13s %5s %9s %10s %10s %10s %11s %10s %10s %10s %13s %9s %6s %6s %s\n" op ranks bytes moex_med ompi_huge mpich_huge vs_mpi_huge moex_heap ompi_mlc mpich_mlc vs_mpi_malloc floor_us moex_f mpi_f note

for op in $ops; do
	for size in $sizes; do
		for p in $ranks; do
			for f in moex heap ompi ompih mpich mpichh shared twocopy; do : >"$work/$f.json"; done
			twocopy=no
			if [ "$op" = alltoall ] && [ "$size" -le 1048576 ] && [ "$p" -gt "$(nproc)" ]; then twocopy=yes; fi
			for r in $(seq "$rounds"); do
				"$work/moex" bench coll --op "$op" --ranks "$p" --transport shm --min-bytes "$size" --max-bytes "$size" --json >>"$work/moex.json"
				"$work/moex" bench coll --op "$op" --ranks "$p" --transport shm --min-bytes "$size" --max-bytes "$size" --heap --json >>"$work/heap.json"
				mpirun.openmpi --allow-run-as-root --oversubscribe -np "$p" "$work/mpi_ompi" "$op" "$size" "$size" >>"$work/ompi.json" 2>/dev/null
				mpirun.openmpi --allow-run-as-root --oversubscribe -x MPI_COLL_HUGE=1 -np "$p" "$work/mpi_ompi" "$op" "$size" "$size" >>"$work/ompih.json" 2>/dev/null
				mpirun.mpich -n "$p" "$work/mpi_mpich" "$op" "$size" "$size" >>"$work/mpich.json" 2>/dev/null
				mpirun.mpich -genv MPI_COLL_HUGE 1 -n "$p" "$work/mpi_mpich" "$op" "$size" "$size" >>"$work/mpichh.json" 2>/dev/null
				if [ "$op" = alltoall ]; then
					"$work/moex" bench coll --op "$op" --ranks "$p" --transport shm --min-bytes "$size" --max-bytes "$size" --shared --json >>"$work/shared.json"
				fi
				if [ $twocopy = yes ]; then "$work/twocopy" -ranks "$p" -bytes "$size" >>"$work/twocopy.json"; fi
			done
			python3 - "$op" "$p" "$size" "$work" <<'PY'
import json, statistics, sys
op, p, size, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def rows(name):
    try:
        return [r for r in (json.loads(l) for l in open(f"{work}/{name}.json") if l.startswith("{")) if r.get("bytes", size) == size]
    except FileNotFoundError:
        return []
def med(rs): return statistics.median(r["time_us"] for r in rs) if rs else float("nan")
moex, ompi, mpich = rows("moex"), rows("ompih"), rows("mpichh")
heap, ompim, mpichm = rows("heap"), rows("ompi"), rows("mpich")
mm, om, cm = med(moex), med(ompi), med(mpich)
hm, omm, cmm = med(heap), med(ompim), med(mpichm)
def better(a, b): return min(x for x in (a, b) if x == x) if (a == a or b == b) else float("nan")
best_mpi, best_malloc = better(om, cm), better(omm, cmm)
floor = max((r.get("floor_us", 0) for r in moex), default=0)
notes = []
if any(r.get("wrong", 0) for r in moex + ompi + mpich + heap + ompim + mpichm):
    notes.append("WRONG RESULTS")
if floor > 0:
    if best_mpi / 2 < floor:
        notes.append(f"2x the better MPI ({best_mpi/2:.0f} us) would pass the floor")
    else:
        notes.append(f"2x the better MPI needs {best_mpi/2:.0f} us")
sh = rows("shared")
if sh:
    notes.append(f"moex --shared {med(sh):.1f} us ({best_mpi/med(sh):.2f}x)")
tc = rows("twocopy")
if tc:
    notes.append(f"bare two-copy exchange {med(tc):.1f} us")
frac = lambda t: f"{floor/t*100:.0f}%" if floor > 0 and t == t else "-"
moex_best = min((r["time_us"] for r in moex), default=float("nan"))
notes.append(f"moex best {moex_best:.1f} us")
print(f"{op:<13} {p:5d} {size:9d} {mm:10.1f} {om:10.1f} {cm:10.1f} {best_mpi/mm:10.2f}x {hm:10.1f} {omm:10.1f} {cmm:10.1f} {best_malloc/hm:12.2f}x {floor:9.0f} {frac(mm):>6} {frac(best_mpi):>6} {'; '.join(notes)}")
PY
		done
	done
done
