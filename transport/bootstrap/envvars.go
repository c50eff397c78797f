package bootstrap

import (
	"strconv"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/tcp"
)

func us(d time.Duration) string { return strconv.FormatInt(d.Microseconds(), 10) }

// envVars are the variables the bootstrap reads: the job, the rendezvous, the transport
// choice, CPU placement, and the poller's (busypoll's, which it reads on the poller's
// behalf).
var envVars = []transport.EnvVar{
	{Name: "MOEX_RANK", Default: "RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID", Meaning: "this process's rank", Owner: "bootstrap"},
	{Name: "MOEX_WORLD_SIZE", Default: "WORLD_SIZE, OMPI_COMM_WORLD_SIZE, SLURM_NTASKS", Meaning: "number of ranks", Owner: "bootstrap"},
	{Name: "MOEX_LOCAL_RANK", Default: "LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID", Meaning: "rank among the ranks of this host", Owner: "bootstrap"},
	{Name: "MOEX_LOCAL_SIZE", Default: "LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE", Meaning: "ranks on this host", Owner: "bootstrap"},
	{Name: "MOEX_ADDR", Default: "MASTER_ADDR:MASTER_PORT", Meaning: "rendezvous store: host:port, served by rank 0; or etcd://host[:port][,host:port...]/job (the program imports transport/bootstrap/etcd; the moex command does), which is the registry too", Owner: "bootstrap"},
	{Name: "MOEX_REGISTRY", Default: "unset (moex run --restarts sets it)", Meaning: "host:port (or etcd://host:port/job) of a store that outlives every rank, where a process that takes over a dead rank is found (coll.Comm.Admit)", Owner: "bootstrap"},
	{Name: "MOEX_RESTARTED", Default: "0", Meaning: "1 (set by moex run --rdzv for a rank it restarts): a claim refused because the rank still looks live in etcd is tried again until the start-up deadline", Owner: "bootstrap", Internal: true},
	{Name: "MOEX_JOINING", Default: "0", Meaning: "1: this process takes over rank MOEX_RANK of a running job whose process died (coll.Init joins through MOEX_REGISTRY)", Owner: "bootstrap"},
	{Name: "MOEX_JOB_TOKEN", Default: "none (required when ranks > 1)", Meaning: "job secret; every connection proves it with an HMAC challenge", Owner: "bootstrap"},
	{Name: "MOEX_BIND", Default: "the local address that reaches MOEX_ADDR", Meaning: "host or IP that listeners bind", Owner: "bootstrap"},
	{Name: "MOEX_IFACE", Default: "unset", Meaning: "network interface whose first address listeners bind", Owner: "bootstrap"},
	{Name: "MOEX_TRANSPORT", Default: "auto", Meaning: "auto (shm on one host; between hosts UCX when built and RDMA is there, else tcp), tcp, shm or ucx", Owner: "bootstrap"},
	{Name: "MOEX_POLL", Default: "adaptive", Meaning: "how receivers wait: adaptive, spin or block", Owner: "busypoll"},
	{Name: "MOEX_SPIN_US", Default: us(busypoll.DefaultMaxSpin), Meaning: "longest adaptive spin before yielding, in microseconds (0: never spin)", Owner: "busypoll"},
	{Name: "MOEX_YIELD_US", Default: us(busypoll.DefaultYieldSpin), Meaning: "when ranks outnumber cores: how long a waiter yields and polls before parking, in microseconds (0: park at once, the default of tcp's socket readers)", Owner: "busypoll"},
	{Name: "MOEX_HOLD_P", Default: "0", Meaning: "removed; 1 is an error: where tcp or ucx ranks share CPUs, MOEX_GOMAXPROCS=auto (or GOMAXPROCS at each rank's share of them) instead", Owner: "busypoll"},
	{Name: "MOEX_CPU_BIND", Default: "none (moex run and moex bench set auto)", Meaning: "auto: a core per rank when the host has enough; numa: the CPUs and memory of the NUMA node of the rank's GPU or NIC; none: leave placement to the kernel (or the launcher)", Owner: "transport/bootstrap"},
	{Name: "MOEX_GOMAXPROCS", Default: "keep (moex run and moex bench set auto)", Meaning: "auto: where ranks share the host's CPUs over tcp or ucx, GOMAXPROCS is each rank's share of them (a GOMAXPROCS in the environment wins); keep: the Go runtime's own choice", Owner: "transport/bootstrap"},
}

// EnvVars lists the variables of the bootstrap, the poller and every transport it opens,
// in the order a reader meets them.
func EnvVars() []transport.EnvVar {
	out := append([]transport.EnvVar(nil), envVars...)
	out = append(out, shm.EnvVars...)
	out = append(out, tcp.EnvVars...)
	return append(out, transport.EnvVars...)
}
