package bootstrap

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Env is what a rank learns about its job from the environment its launcher set.
type Env struct {
	Rank, Size           int
	LocalRank, LocalSize int    // -1 when the launcher does not say
	Addr                 string // rendezvous store: host:port (rank 0 serves it), or etcd://host:port/job (see KV)
	Token                string // job secret every connection proves
	Bind                 string // host whose address listeners bind; "" = derived from Addr
	Iface                string // network interface to bind (MOEX_IFACE), alternative to Bind
	Transport            string // MOEX_TRANSPORT: auto, inproc, tcp, shm, ucx
	Timeout              time.Duration
	Launcher             string // which variables were read: moex, torchrun, openmpi, slurm
	// AddrFile, when set, replaces Addr and Token on one host: rank 0 serves the store on
	// a free loopback port and writes its address and a fresh job secret into this file
	// (mode 0600, in the launcher's private session directory); the others read them
	// there. Set for Open MPI jobs on one host that name no address (mpirun needs no
	// hand-picked port or secret then).
	AddrFile string
	// AddrNote says where Addr came from when moex chose it, not the user.
	AddrNote string
	// Registry (MOEX_REGISTRY, host:port or etcd://host:port/job) is a store that
	// outlives every rank (moex run --restarts serves it for the job's life; etcd's is
	// MOEX_ADDR's where that is etcd://): a process that takes over a dead rank says there
	// where it listens, and the live ranks find it there (coll.Comm.Admit).
	Registry string
	// Joining (MOEX_JOINING=1): this process takes over rank Rank of a running job whose
	// process died, rather than starting one (needs Registry).
	Joining bool
	// Restarted (MOEX_RESTARTED=1, set by a launcher that restarts a rank): where the job
	// meets in a store that outlives start-up (etcd), a claim refused because the rank is
	// still live (the others have not yet seen its process die) is tried again until the
	// start-up deadline, rather than failing at once.
	Restarted bool
}

// DefaultTimeout bounds every collective unless MOEX_TIMEOUT says otherwise.
const DefaultTimeout = 5 * time.Minute

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
			return 0, &transport.EnvError{Var: name, Value: v, Reason: fmt.Sprintf("want an integer >= %d", min)}
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
			return e, &transport.EnvError{Var: rankVar, Reason: "not set, but " + sizeVar + " is"}
		}
		if sizeV == "" {
			return e, &transport.EnvError{Var: sizeVar, Reason: "not set, but " + rankVar + " is"}
		}
		var err error
		if e.Rank, err = atoi(rankVar, rankV, 0); err != nil {
			return e, err
		}
		if e.Size, err = atoi(sizeVar, sizeV, 1); err != nil {
			return e, err
		}
		if e.Rank >= e.Size {
			return e, &transport.EnvError{Var: rankVar, Value: rankV, Reason: fmt.Sprintf("rank must be below %s=%d", sizeVar, e.Size)}
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
		if err := checkStoreAddr("MOEX_ADDR", v); err != nil {
			return e, err
		}
		e.Addr = v
	} else if h, p := getenv("MASTER_ADDR"), getenv("MASTER_PORT"); h != "" || p != "" {
		if h == "" || p == "" {
			return e, &transport.EnvError{Var: "MASTER_ADDR/MASTER_PORT", Reason: "set both or neither"}
		}
		port, err := atoi("MASTER_PORT", p, 1)
		if err != nil {
			return e, err
		}
		if getenv("TORCHELASTIC_USE_AGENT_STORE") == "True" {
			// torchrun's static rendezvous (--master_addr, --master_port): its agent
			// serves its own store on MASTER_PORT, so moex's takes the next port.
			if port >= 65535 {
				return e, &transport.EnvError{Var: "MASTER_PORT", Value: p, Reason: "torchrun's agent store holds it and no port follows it; set MOEX_ADDR"}
			}
			port++
			e.AddrNote = fmt.Sprintf("MASTER_PORT+1: torchrun's agent store holds MASTER_PORT=%s", p)
		}
		e.Addr = net.JoinHostPort(h, strconv.Itoa(port))
	}
	if e.Size > 1 && e.Addr == "" && e.Launcher == "openmpi" {
		if f, why := ompiAddrFile(getenv, e); f != "" {
			e.AddrFile = f
			e.AddrNote = "through " + f
		} else {
			return e, &transport.EnvError{Var: "MOEX_ADDR", Reason: "not set, and mpirun cannot be rendezvoused without it here (" + why + "): pass -x MOEX_ADDR=host:port -x MOEX_JOB_TOKEN"}
		}
	}
	if e.Size > 1 && e.Addr == "" && e.AddrFile == "" {
		return e, &transport.EnvError{Var: "MOEX_ADDR", Reason: "not set: a multi-rank job needs the rendezvous address (MOEX_ADDR=host:port, or MASTER_ADDR and MASTER_PORT)"}
	}
	e.Token = getenv("MOEX_JOB_TOKEN")
	if e.Size > 1 && e.Token == "" && e.AddrFile == "" {
		return e, &transport.EnvError{Var: "MOEX_JOB_TOKEN", Reason: "not set: every rank must share a job secret (moex run sets one; otherwise export MOEX_JOB_TOKEN=$(head -c16 /dev/urandom | xxd -p) before launching)"}
	}
	e.Bind = getenv("MOEX_BIND")
	e.Iface = getenv("MOEX_IFACE")
	e.Transport = strings.ToLower(getenv("MOEX_TRANSPORT"))
	switch e.Transport {
	case "", "auto":
		e.Transport = "auto"
	case "inproc", "tcp", "shm", "ucx":
	default:
		return e, &transport.EnvError{Var: "MOEX_TRANSPORT", Value: e.Transport, Reason: "want auto, tcp, shm or ucx"}
	}
	if v := getenv("MOEX_REGISTRY"); v != "" {
		if err := checkStoreAddr("MOEX_REGISTRY", v); err != nil {
			return e, err
		}
		e.Registry = v
	} else if IsURL(e.Addr) {
		e.Registry = e.Addr // a driver's store outlives start-up: it is the registry too
	}
	switch v := getenv("MOEX_RESTARTED"); v {
	case "", "0":
	case "1":
		e.Restarted = true
	default:
		return e, &transport.EnvError{Var: "MOEX_RESTARTED", Value: v, Reason: "want 1 or 0"}
	}
	switch v := getenv("MOEX_JOINING"); v {
	case "", "0":
	case "1":
		if e.Registry == "" || e.Size < 2 {
			return e, &transport.EnvError{Var: "MOEX_JOINING", Value: v, Reason: "a process takes over a rank of a running job of several ranks through its registry: set MOEX_REGISTRY too"}
		}
		e.Joining = true
	default:
		return e, &transport.EnvError{Var: "MOEX_JOINING", Value: v, Reason: "want 1 or 0"}
	}
	if v := getenv("MOEX_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return e, &transport.EnvError{Var: "MOEX_TIMEOUT", Value: v, Reason: "want a positive Go duration such as 30s or 5m"}
		}
		e.Timeout = d
	}
	return e, nil
}

// checkStoreAddr checks v, the value of variable (MOEX_ADDR, MOEX_REGISTRY): host:port, or
// a URL whose scheme has a driver.
func checkStoreAddr(variable, v string) error {
	if IsURL(v) {
		_, _, err := storeURL(variable, v)
		return err
	}
	if _, _, err := net.SplitHostPort(v); err != nil {
		return &transport.EnvError{Var: variable, Value: v, Reason: "want host:port, or etcd://host:port/job"}
	}
	return nil
}

// ompiAddrFile is the rendezvous file of an Open MPI job on one host: in mpirun's
// session directory for the job (private to the user), named by the job's id. It returns
// "" and why not where there is none: ranks on several hosts (no shared directory), or
// an Open MPI that says neither.
func ompiAddrFile(getenv func(string) string, e Env) (string, string) {
	if e.LocalSize != e.Size {
		return "", fmt.Sprintf("ranks on several hosts: %d of %d on this one", max(e.LocalSize, 0), e.Size)
	}
	dir := getenv("OMPI_MCA_orte_jobfam_session_dir")
	if dir == "" {
		dir = getenv("PMIX_SERVER_TMPDIR")
	}
	job := getenv("OMPI_MCA_ess_base_jobid")
	if job == "" {
		job = getenv("PMIX_NAMESPACE")
	}
	if dir == "" || job == "" || strings.ContainsAny(job, "/\x00") {
		return "", "no session directory or job id in Open MPI's environment"
	}
	return filepath.Join(dir, "moex-rendezvous-"+job), ""
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
			return "", &transport.EnvError{Var: "MOEX_IFACE", Value: e.Iface, Reason: err.Error()}
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			return "", &transport.EnvError{Var: "MOEX_IFACE", Value: e.Iface, Reason: err.Error()}
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
		return "", &transport.EnvError{Var: "MOEX_IFACE", Value: e.Iface, Reason: "interface has no address"}
	}
	if e.Addr == "" {
		return "127.0.0.1", nil
	}
	hostport := e.Addr
	if IsURL(hostport) { // the first endpoint of a driver's store (etcd://h1:p1,h2:p2/job)
		if u, err := url.Parse(hostport); err == nil {
			hostport, _, _ = strings.Cut(u.Host, ",")
		}
	}
	host, port, _ := net.SplitHostPort(hostport)
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
