package transport

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"
)

// Env is what a rank learns about its job from the environment its launcher set.
type Env struct {
	Rank, Size           int
	LocalRank, LocalSize int    // -1 when the launcher does not say
	Addr                 string // rendezvous store, host:port (rank 0 serves it)
	Token                string // job secret every connection proves
	Bind                 string // host whose address listeners bind; "" = derived from Addr
	Iface                string // network interface to bind (MOEX_IFACE), alternative to Bind
	Transport            string // MOEX_TRANSPORT: auto, inproc, tcp, shm, ucx
	Timeout              time.Duration
	Launcher             string // which variables were read: moex, torchrun, openmpi, slurm
}

// EnvVar documents one environment variable moex reads.
type EnvVar struct{ Name, Meaning string }

// EnvVars lists the variables FromEnv reads, in the order they take precedence.
var EnvVars = []EnvVar{
	{"MOEX_RANK", "this process's rank (else RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID)"},
	{"MOEX_WORLD_SIZE", "number of ranks (else WORLD_SIZE, OMPI_COMM_WORLD_SIZE, SLURM_NTASKS)"},
	{"MOEX_LOCAL_RANK", "rank among the ranks on this host (else LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID)"},
	{"MOEX_LOCAL_SIZE", "ranks on this host (else LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE)"},
	{"MOEX_ADDR", "rendezvous store host:port, served by rank 0 (else MASTER_ADDR:MASTER_PORT)"},
	{"MOEX_JOB_TOKEN", "job secret; every connection proves it with an HMAC challenge (required when ranks > 1)"},
	{"MOEX_BIND", "host or IP that listeners bind (default: the local address that reaches MOEX_ADDR)"},
	{"MOEX_IFACE", "network interface whose first address listeners bind"},
	{"MOEX_TRANSPORT", "auto (default: shm on one host; between hosts UCX when built and RDMA is there, else tcp), tcp, shm or ucx"},
	{"MOEX_TIMEOUT", "deadline for every collective, as a Go duration (default 5m)"},
	{"MOEX_INIT_TIMEOUT", "deadline of start-up (coll.Init): every rank must have started and connected within it (default: MOEX_TIMEOUT)"},
	{"MOEX_POLL", "receiver waiting policy: adaptive (default), spin or block"},
	{"MOEX_CPU_BIND", "auto (default): bind each rank to a core of its own when the host has enough cores; numa: to the CPUs and memory of the NUMA node of its GPU or NIC; none: leave placement to the kernel"},
	{"MOEX_NET_GBITS", "the network's speed between hosts in Gbit/s, for the cost model (default: the NIC's, from sysfs, else 24)"},
	{"MOEX_SHM_CMA", "auto (default), 1 or 0: large shared-memory messages with process_vm_readv, or through the rings"},
	{"MOEX_SHM_REWIND", "auto (default: when ranks outnumber cores), 1 or 0: a producer that finds its shared-memory ring empty starts again at the ring's first slot"},
	{"MOEX_WINDOWS", "auto (default) or 0: exchanges (the MoE low-latency mode) write each block straight into the memory of same-host peers; 0: as messages"},
	{"MOEX_SPIN_US", "longest adaptive spin before yielding, in microseconds (default 50)"},
	{"MOEX_YIELD_US", "when ranks outnumber cores: how long a waiter yields and polls before parking, in microseconds (default 200; 0: park at once)"},
	{"MOEX_TCP_STREAMS", "TCP connections per peer (default 1)"},
	{"MOEX_BUSY_POLL_US", "SO_BUSY_POLL value for TCP sockets in microseconds (default 50; 0 disables)"},
	{"MOEX_CHECKSUM", "1: carry an xxhash64 of every TCP payload and verify it"},
	{"MOEX_ALGO", "algorithm overrides, op:algo[,op:algo] (for example allreduce:ring)"},
	{"MOEX_DEBUG", "log level: INFO logs transports per peer and algorithms per op"},
	{"MOEX_TRACE", "directory: at Close every rank writes a Chrome-trace JSON file of its collectives (Perfetto), each split into waiting for the last rank and moving, naming that rank (turns MOEX_PROFILE on)"},
	{"MOEX_PROFILE", "1: time every collective's wait for the last rank apart from the operation itself, and name the rank that arrived last (one small all-gather per op; logged at Close with MOEX_DEBUG=INFO)"},
	{"MOEX_HOST_ID", "override the host identity (hostname/boot id) that decides which ranks share a host"},
}

// DefaultTimeout bounds every collective unless MOEX_TIMEOUT says otherwise.
const DefaultTimeout = 5 * time.Minute

// EnvError reports a missing or malformed variable.
type EnvError struct {
	Var    string
	Value  string
	Reason string
}

func (e *EnvError) Error() string {
	if e.Value == "" {
		return fmt.Sprintf("transport: %s: %s", e.Var, e.Reason)
	}
	return fmt.Sprintf("transport: %s=%q: %s", e.Var, e.Value, e.Reason)
}

// FromEnv reads the job description from the process environment.
func FromEnv() (Env, error) { return ParseEnv(os.Getenv) }

// ParseEnv reads the job description through getenv: moex's own variables first, then
// torchrun's, Open MPI's and Slurm's.
func ParseEnv(getenv func(string) string) (Env, error) {
	e := Env{LocalRank: -1, LocalSize: -1, Timeout: DefaultTimeout}
	pick := func(names ...string) (string, string) {
		for _, n := range names {
			if v := getenv(n); v != "" {
				return n, v
			}
		}
		return names[0], ""
	}
	atoi := func(name, v string, min int) (int, error) {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < min {
			return 0, &EnvError{Var: name, Value: v, Reason: fmt.Sprintf("want an integer >= %d", min)}
		}
		return n, nil
	}
	rankVar, rankV := pick("MOEX_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
	sizeVar, sizeV := pick("MOEX_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
	switch rankVar {
	case "MOEX_RANK":
		e.Launcher = "moex"
	case "RANK":
		e.Launcher = "torchrun"
	case "OMPI_COMM_WORLD_RANK":
		e.Launcher = "openmpi"
	case "SLURM_PROCID":
		e.Launcher = "slurm"
	}
	if rankV == "" && sizeV == "" {
		e.Rank, e.Size, e.Launcher = 0, 1, "none"
	} else {
		if rankV == "" {
			return e, &EnvError{Var: rankVar, Reason: "not set, but " + sizeVar + " is"}
		}
		if sizeV == "" {
			return e, &EnvError{Var: sizeVar, Reason: "not set, but " + rankVar + " is"}
		}
		var err error
		if e.Rank, err = atoi(rankVar, rankV, 0); err != nil {
			return e, err
		}
		if e.Size, err = atoi(sizeVar, sizeV, 1); err != nil {
			return e, err
		}
		if e.Rank >= e.Size {
			return e, &EnvError{Var: rankVar, Value: rankV, Reason: fmt.Sprintf("rank must be below %s=%d", sizeVar, e.Size)}
		}
	}
	if n, v := pick("MOEX_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"); v != "" {
		r, err := atoi(n, v, 0)
		if err != nil {
			return e, err
		}
		e.LocalRank = r
	}
	if n, v := pick("MOEX_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"); v != "" {
		r, err := atoi(n, v, 1)
		if err != nil {
			return e, err
		}
		e.LocalSize = r
	}
	if v := getenv("MOEX_ADDR"); v != "" {
		if _, _, err := net.SplitHostPort(v); err != nil {
			return e, &EnvError{Var: "MOEX_ADDR", Value: v, Reason: "want host:port"}
		}
		e.Addr = v
	} else if h, p := getenv("MASTER_ADDR"), getenv("MASTER_PORT"); h != "" || p != "" {
		if h == "" || p == "" {
			return e, &EnvError{Var: "MASTER_ADDR/MASTER_PORT", Reason: "set both or neither"}
		}
		if _, err := atoi("MASTER_PORT", p, 1); err != nil {
			return e, err
		}
		e.Addr = net.JoinHostPort(h, p)
	}
	if e.Size > 1 && e.Addr == "" {
		return e, &EnvError{Var: "MOEX_ADDR", Reason: "not set: a multi-rank job needs the rendezvous address (MOEX_ADDR=host:port, or MASTER_ADDR and MASTER_PORT)"}
	}
	e.Token = getenv("MOEX_JOB_TOKEN")
	if e.Size > 1 && e.Token == "" {
		return e, &EnvError{Var: "MOEX_JOB_TOKEN", Reason: "not set: every rank must share a job secret (moex run sets one; otherwise export MOEX_JOB_TOKEN=$(head -c16 /dev/urandom | xxd -p) before launching)"}
	}
	e.Bind = getenv("MOEX_BIND")
	e.Iface = getenv("MOEX_IFACE")
	e.Transport = strings.ToLower(getenv("MOEX_TRANSPORT"))
	switch e.Transport {
	case "", "auto":
		e.Transport = "auto"
	case "inproc", "tcp", "shm", "ucx":
	default:
		return e, &EnvError{Var: "MOEX_TRANSPORT", Value: e.Transport, Reason: "want auto, tcp, shm or ucx"}
	}
	if v := getenv("MOEX_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return e, &EnvError{Var: "MOEX_TIMEOUT", Value: v, Reason: "want a positive Go duration such as 30s or 5m"}
		}
		e.Timeout = d
	}
	return e, nil
}

// BindHost returns the host that this rank's listeners should bind: MOEX_BIND, else the
// first address of MOEX_IFACE, else the local address that routes to the store (found
// with a UDP connect, which sends nothing), else loopback.
func (e Env) BindHost() (string, error) {
	if e.Bind != "" {
		return e.Bind, nil
	}
	if e.Iface != "" {
		ifc, err := net.InterfaceByName(e.Iface)
		if err != nil {
			return "", &EnvError{Var: "MOEX_IFACE", Value: e.Iface, Reason: err.Error()}
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			return "", &EnvError{Var: "MOEX_IFACE", Value: e.Iface, Reason: err.Error()}
		}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
				return ipn.IP.String(), nil
			}
		}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok {
				return ipn.IP.String(), nil
			}
		}
		return "", &EnvError{Var: "MOEX_IFACE", Value: e.Iface, Reason: "interface has no address"}
	}
	if e.Addr == "" {
		return "127.0.0.1", nil
	}
	host, port, _ := net.SplitHostPort(e.Addr)
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() || host == "localhost" {
		return "127.0.0.1", nil
	}
	c, err := net.Dial("udp", net.JoinHostPort(host, port))
	if err != nil {
		return "", fmt.Errorf("transport: finding the local address that reaches %s: %w", e.Addr, err)
	}
	defer c.Close()
	return c.LocalAddr().(*net.UDPAddr).IP.String(), nil
}

// HostID identifies the machine: ranks with equal HostIDs share memory. MOEX_HOST_ID
// overrides it (tests use that to pretend ranks are on different hosts).
func HostID() string {
	if v := os.Getenv("MOEX_HOST_ID"); v != "" {
		return v
	}
	h, _ := os.Hostname()
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return h + "/" + strings.TrimSpace(string(boot))
}
