package main

// The one registry of the environment variables moex reads: name, default, meaning and
// the package that reads it. `moex env` prints it, the README's table is generated from
// it (moex env --markdown), and a test fails when the code reads a MOEX_ variable that is
// not registered here, or registers one that nothing reads. It lives with the command,
// the one package that may import every package that owns a variable.

import (
	"fmt"
	"strconv"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/transport/bootstrap"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/tcp"
)

// varKind says who sets a variable.
type varKind int

const (
	// User variables are set by whoever starts the job: what moex, its launchers and
	// its tuning read.
	User varKind = iota
	// Internal variables are set by moex for its own child processes (the launcher, the
	// benchmark's ranks) or by developers profiling moex; users leave them alone.
	Internal
)

// envVar is one registered variable.
type envVar struct {
	Name    string
	Default string // what applies when it is unset, from the code's constant where there is one
	Meaning string
	Owner   string // the package that reads it
	Kind    varKind
}

func us(d time.Duration) string { return strconv.FormatInt(d.Microseconds(), 10) }

// envVars lists every variable, user ones first, in the order a reader meets them.
var envVars = []envVar{
	{"MOEX_RANK", "RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID", "this process's rank", "bootstrap", User},
	{"MOEX_WORLD_SIZE", "WORLD_SIZE, OMPI_COMM_WORLD_SIZE, SLURM_NTASKS", "number of ranks", "bootstrap", User},
	{"MOEX_LOCAL_RANK", "LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID", "rank among the ranks of this host", "bootstrap", User},
	{"MOEX_LOCAL_SIZE", "LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE", "ranks on this host", "bootstrap", User},
	{"MOEX_ADDR", "MASTER_ADDR:MASTER_PORT", "rendezvous store host:port, served by rank 0", "bootstrap", User},
	{"MOEX_JOB_TOKEN", "none (required when ranks > 1)", "job secret; every connection proves it with an HMAC challenge", "bootstrap", User},
	{"MOEX_BIND", "the local address that reaches MOEX_ADDR", "host or IP that listeners bind", "bootstrap", User},
	{"MOEX_IFACE", "unset", "network interface whose first address listeners bind", "bootstrap", User},
	{"MOEX_TRANSPORT", "auto", "auto (shm on one host; between hosts UCX when built and RDMA is there, else tcp), tcp, shm or ucx", "bootstrap", User},
	{"MOEX_TIMEOUT", bootstrap.DefaultTimeout.String(), "no-progress deadline of every operation, a Go duration; after 30 s without progress a warning names the ranks waited for", "coll", User},
	{"MOEX_INIT_TIMEOUT", "MOEX_TIMEOUT", "deadline of start-up (coll.Init): every rank must have started and connected within it", "coll", User},
	{"MOEX_POLL", "adaptive", "how receivers wait: adaptive, spin or block", "busypoll", User},
	{"MOEX_SPIN_US", us(busypoll.DefaultMaxSpin), "longest adaptive spin before yielding, in microseconds (0: never spin)", "busypoll", User},
	{"MOEX_YIELD_US", us(busypoll.DefaultYieldSpin), "when ranks outnumber cores: how long a waiter yields and polls before parking, in microseconds (0: park at once, the default of tcp's socket readers)", "busypoll", User},
	{"MOEX_HOLD_P", "0", "removed; 1 is an error: where tcp or ucx ranks share CPUs, MOEX_GOMAXPROCS=auto (or GOMAXPROCS at each rank's share of them) instead", "busypoll", User},
	{"MOEX_CPU_BIND", "none (moex run and moex bench set auto)", "auto: a core per rank when the host has enough; numa: the CPUs and memory of the NUMA node of the rank's GPU or NIC; none: leave placement to the kernel (or the launcher)", "transport/bootstrap", User},
	{"MOEX_GOMAXPROCS", "keep (moex run and moex bench set auto)", "auto: where ranks share the host's CPUs over tcp or ucx, GOMAXPROCS is each rank's share of them (a GOMAXPROCS in the environment wins); keep: the Go runtime's own choice", "transport/bootstrap", User},
	{"MOEX_NET_GBITS", fmt.Sprintf("the NIC's speed from sysfs, else %g", 8/coll.CostNet.Beta/1e9), "the network's speed between hosts in Gbit/s, for the cost model", "coll", User},
	{"MOEX_ALGO", "unset (the cost model chooses)", "algorithm overrides, op:algo[,op:algo] (for example alltoall:hier)", "coll", User},
	{"MOEX_WINDOWS", "auto", "auto or 0: exchanges (the MoE low-latency mode) write each block straight into the memory of same-host peers; 0: as messages", "coll", User},
	{"MOEX_SHM_CMA", "auto", "auto, 1 or 0: large shared-memory messages with process_vm_readv, or through the rings", "transport/shm", User},
	{"MOEX_SHM_REWIND", "auto (on when ranks outnumber cores)", "auto, 1 or 0: a producer that finds its shared-memory ring empty starts again at its first slot", "transport/shm", User},
	{"MOEX_SHM_STREAM", "auto (when an operation touches more than the last-level cache)", "auto, 1 or 0: copy blocks read in place with non-temporal stores", "transport/shm", User},
	{"MOEX_SHM_AREA", strconv.Itoa(shm.DefaultAreaBytes >> 10), "KiB: the largest send buffer a shared-area collective takes (0: no area)", "transport/shm", User},
	{"MOEX_TCP_STREAMS", strconv.Itoa(tcp.DefaultStreams), fmt.Sprintf("TCP connections per peer (1 to %d)", tcp.MaxStreams), "transport/tcp", User},
	{"MOEX_BUSY_POLL_US", strconv.Itoa(tcp.DefaultBusyPollUS), "SO_BUSY_POLL of TCP sockets in microseconds (0: off)", "transport/tcp", User},
	{"MOEX_CHECKSUM", "0", "1: carry an xxhash64 of every TCP payload and verify it", "transport/tcp", User},
	{"MOEX_DEBUG", "unset (silent)", "log level: INFO logs transports per peer and algorithms per op; DEBUG, WARN, ERROR", "coll", User},
	{"MOEX_PROFILE", "0", "1: time every collective's wait for the last rank apart from the operation, and name that rank (one small all-gather per op; the MoE low-latency exchanges at no extra cost)", "coll", User},
	{"MOEX_TRACE", "unset", "directory: at Close every rank writes a Chrome-trace JSON file of its collectives (turns MOEX_PROFILE on)", "coll", User},
	{"MOEX_HOST_ID", "hostname and boot id", "the host identity that decides which ranks share memory", "transport", User},
	{"MOEX_LAUNCH_REPORT", "set by moex run", "directory where ranks say whom they blame for an abort, so that the launcher names the root cause", "coll", Internal},
	{"MOEX_BENCH_WORKER", "set by moex bench", "1 in the rank processes a benchmark launches", "cmd/moex", Internal},
	{"MOEX_CPUPROFILE", "unset", "directory: every moex process writes a CPU profile there", "cmd/moex", Internal},
	{"MOEX_TCP_WAIT_SPIN", "0", "1: with MOEX_POLL=spin, tcp senders spin on their completions too (an experiment)", "transport/tcp", Internal},
}

// lookupVar returns the registered variable name.
func lookupVar(name string) (envVar, bool) {
	for _, v := range envVars {
		if v.Name == name {
			return v, true
		}
	}
	return envVar{}, false
}
