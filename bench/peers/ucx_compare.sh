#!/usr/bin/env bash
# moex's UCX transport beside moex's own transports and UCX's own benchmark, on this host,
# in one run: point-to-point bandwidth at 1 MiB and 16 MiB (two processes) for
#   ucx (UCX_TLS=tcp), ucx (UCX_TLS=sm), moex tcp, moex shm   (moex bench p2p)
#   ucx_perftest -t tag_bw with UCX_TLS=tcp and sm, one send in flight (-O 1, as moex's
#   p2p bench sends) and with UCX's default window
# and AlltoAll at P=4 (moex bench coll --op alltoall) over the four moex paths.
#
# Needs libucx-dev and ucx-utils (installed with apt-get when missing; root).
# usage: bench/peers/ucx_compare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! pkg-config --exists ucx || ! command -v ucx_perftest >/dev/null; then
	echo "# installing UCX (libucx-dev, ucx-utils)" >&2
	apt-get update >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libucx-dev ucx-utils pkg-config >/dev/null
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
go build -tags ucx -o "$work/moex" ./cmd/moex
echo "# UCX $(pkg-config --modversion ucx); moex $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; $(date -u +%FT%TZ)"

field() { # field of the JSON line with bytes == size
	python3 -c '
import sys, json
size, field = int(sys.argv[1]), sys.argv[2]
for l in open(sys.argv[3]):
    if l.startswith("{"):
        r = json.loads(l)
        if r["bytes"] == size:
            print(r[field]); break
else:
    print("nan")' "$@"
}

perftest() { # tls size extra-args... -> GB/s (overall)
	local tls=$1 size=$2
	shift 2
	local port=$((20000 + RANDOM % 20000))
	UCX_TLS=$tls ucx_perftest -p "$port" "$@" >/dev/null 2>&1 &
	local srv=$!
	sleep 0.5
	local mbs
	mbs=$(UCX_TLS=$tls ucx_perftest 127.0.0.1 -p "$port" -t tag_bw -s "$size" -n 400 -w 40 "$@" 2>/dev/null | awk '/^Final:/ {print $7}')
	wait "$srv" 2>/dev/null || true
	# ucx_perftest's MB/s is 2^20 bytes per second.
	python3 -c "import sys; print('%.2f' % (float(sys.argv[1]) * 1048576 / 1e9))" "${mbs:-nan}"
}

printf "\n%-26s %12s %12s\n" "p2p bandwidth (GB/s)" 1MiB 16MiB
run_p2p() { # label transport env...
	local label=$1 tr=$2
	shift 2
	env "$@" "$work/moex" bench p2p --transport "$tr" --min-bytes 1048576 --max-bytes 16777216 --factor 16 --json >"$work/p2p.json"
	printf "%-26s %12.2f %12.2f\n" "$label" "$(field 1048576 bandwidth_gbs "$work/p2p.json")" "$(field 16777216 bandwidth_gbs "$work/p2p.json")"
}
run_p2p "moex ucx (UCX_TLS=tcp)" ucx UCX_TLS=tcp
run_p2p "moex ucx (UCX_TLS=sm)" ucx UCX_TLS=sm
run_p2p "moex tcp" tcp
run_p2p "moex shm" shm
for tls in tcp sm; do
	printf "%-26s %12s %12s\n" "ucx_perftest $tls -O 1" "$(perftest $tls 1048576 -O 1)" "$(perftest $tls 16777216 -O 1)"
	printf "%-26s %12s %12s\n" "ucx_perftest $tls" "$(perftest $tls 1048576)" "$(perftest $tls 16777216)"
done

printf "\n%-26s %12s %12s %12s\n" "alltoall P=4 (us)" 64KiB 1MiB 4MiB
run_a2a() { # label transport env...
	local label=$1 tr=$2
	shift 2
	env "$@" "$work/moex" bench coll --op alltoall --ranks 4 --transport "$tr" --min-bytes 65536 --max-bytes 4194304 --factor 4 --json >"$work/a2a.json"
	printf "%-26s %12.1f %12.1f %12.1f\n" "$label" "$(field 65536 time_us "$work/a2a.json")" "$(field 1048576 time_us "$work/a2a.json")" "$(field 4194304 time_us "$work/a2a.json")"
}
run_a2a "moex ucx (UCX_TLS=tcp)" ucx UCX_TLS=tcp
run_a2a "moex ucx (UCX_TLS=sm)" ucx UCX_TLS=sm
run_a2a "moex tcp" tcp
run_a2a "moex shm" shm
