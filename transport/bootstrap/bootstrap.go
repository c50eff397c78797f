// Package bootstrap sets a rank up from its launcher's environment: it reads the job
// description that torchrun, mpirun, Slurm or moex run set (FromEnv), joins the job's
// rendezvous store, which checks the job secret (Join), learns which ranks share a host,
// binds the rank to CPUs
// when asked (MOEX_CPU_BIND), finds the network's speed, and opens the transport to every
// peer, choosing per peer and saying why: inproc in one process, shm on one host, and
// across hosts UCX when built and every rank reaches its remote peers over RDMA, else tcp
// (with shm for the peers on the host, through a transport.Mux). When asked
// (MOEX_GOMAXPROCS=auto) it sets GOMAXPROCS to the rank's share of the host's CPUs where
// that transport needs it (ProcsShare).
//
// It is the one package that knows the concrete transports; coll.Init calls it and sees
// the transport contract it returns.
package bootstrap

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/inproc"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/tcp"
	"github.com/moex-ai/moex/transport/topo"
)

// Class is the kind of link a transport gives: what a cost model should assume.
type Class int

const (
	Inproc Class = iota // ranks of one process
	Shm                 // ranks of one host, through shared memory
	Net                 // ranks across hosts (tcp, ucx)
)

// Result is a rank's set-up.
type Result struct {
	Transport transport.Transport
	Why       string // why this transport ("shm: every rank on this host (...)", "tcp: UCX not built", ...)
	Class     Class  // the link between hosts, or within the host when there is one host
	// Hosts gives, per rank, the index of its host (in order of first appearance).
	Hosts []int
	// Poll is the waiting policy given, with Oversubscribed set when the ranks of this
	// host outnumber its CPUs.
	Poll busypoll.Config
	// NetGbits is the speed of the NIC that carries this rank's traffic between hosts,
	// when the ranks span hosts and sysfs says (0: unknown).
	NetGbits float64
}

// ArgError is a bad setting in the environment (MOEX_TRANSPORT, MOEX_CPU_BIND).
type ArgError = transport.ArgError

// Open sets this rank up (see the package doc). Every rank of the job calls it: the
// exchanges inside are collective through rv. poll is the waiting policy to start from.
func Open(ctx context.Context, env Env, rv *Rendezvous, poll busypoll.Config, log *slog.Logger) (*Result, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ids, err := rv.AllGather(ctx, []byte(transport.HostID()))
	if err != nil {
		return nil, err
	}
	res := &Result{Hosts: make([]int, env.Size)}
	index := map[string]int{}
	for r, id := range ids {
		h, ok := index[string(id)]
		if !ok {
			h = len(index)
			index[string(id)] = h
		}
		res.Hosts[r] = h
	}
	localSize, localRank := 0, 0
	for q, h := range res.Hosts {
		if h == res.Hosts[env.Rank] {
			localSize++
			if q < env.Rank {
				localRank++
			}
		}
	}
	poll, autoProcs, err := hostPolicy(env, localRank, localSize, poll, log)
	if err != nil {
		return nil, err
	}
	res.Poll = poll
	if len(index) > 1 {
		// The network's speed for a cost model: the NIC that carries this rank's traffic,
		// when the host says.
		if host, err := env.BindHost(); err == nil {
			name := env.Iface
			if name == "" {
				name = topo.InterfaceOf(host)
			}
			if n := topo.Discover(topo.Options{Logger: log}).NIC(name); n != nil && n.Speed > 0 {
				res.NetGbits = float64(n.Speed) / 1000
			}
		}
	}
	if err := rv.Stage(ctx, "transport"); err != nil {
		return nil, err
	}
	res.Transport, res.Why, res.Class, err = openTransport(ctx, env, rv, res.Hosts, poll, log)
	if err != nil {
		return nil, err
	}
	if autoProcs {
		shareProcs(env, res.Transport.Name(), localSize, log)
	}
	return res, nil
}

// hostPolicy is what a rank takes from the ranks of its host, the localRank-th of
// localSize: the waiting policy (oversubscribed where they outnumber the CPUs), its CPU
// binding (MOEX_CPU_BIND), and whether GOMAXPROCS is to be its share of the CPUs once the
// transport is known (MOEX_GOMAXPROCS=auto). Open and JoinerPolicy both apply it, so that
// a process taking over a rank runs as the one that started did.
func hostPolicy(env Env, localRank, localSize int, poll busypoll.Config, log *slog.Logger) (busypoll.Config, bool, error) {
	poll.Oversubscribed = poll.Oversubscribed || busypoll.Oversubscribed(localSize)
	autoProcs, err := procsPolicy()
	if err != nil {
		return poll, false, err
	}
	return poll, autoProcs, bindCPUs(env, localRank, localSize, log)
}

// procsPolicy reads MOEX_GOMAXPROCS: keep (the default for a library: the runtime's
// own choice) or auto (moex run and moex bench set it; see ProcsShare).
func procsPolicy() (auto bool, err error) {
	switch v := os.Getenv("MOEX_GOMAXPROCS"); v {
	case "", "keep":
		return false, nil
	case "auto":
		return true, nil
	default:
		return false, &ArgError{Arg: "MOEX_GOMAXPROCS", Reason: fmt.Sprintf("%q (want auto or keep)", v)}
	}
}

// shareProcs sets GOMAXPROCS to ProcsShare's value where it gives one, unless the
// environment sets GOMAXPROCS: a value the user chose wins.
func shareProcs(env Env, transportName string, localSize int, log *slog.Logger) {
	// The runtime's choice is at most the CPUs it may use (affinity, a cgroup's quota).
	procs := runtime.GOMAXPROCS(0)
	n := ProcsShare(transportName, procs, min(procs, runtime.NumCPU()), localSize)
	switch {
	case n == 0:
	case os.Getenv("GOMAXPROCS") != "":
		log.Info("moex: GOMAXPROCS kept as the environment sets it", "rank", env.Rank, "gomaxprocs", procs, "share", n)
	default:
		runtime.GOMAXPROCS(n)
		log.Info("moex: GOMAXPROCS set to this rank's share of the host's CPUs", "rank", env.Rank, "gomaxprocs", n,
			"ranks", localSize, "cpus", min(procs, runtime.NumCPU()), "transport", transportName)
	}
}

// ProcsShare returns the GOMAXPROCS that a rank should run with where hostRanks ranks of
// a job share the cpus CPUs of their host, talk over the transport named, and have
// procs Ps each; 0 where procs is right as it is.
//
// Over tcp and ucx every message passes from a goroutine of the transport (a socket
// reader, a progress loop) to the one waiting for it. With more Ps than the rank's share
// of the CPUs, every such hand-off finds a P idle and wakes a thread of the runtime to
// look for work, on CPUs the other ranks need; at the share (at least 1) it does not.
// Over shm, where waiters poll shared memory while the transport's goroutines run beside
// them, the Ps stay (see bindToCPU), and so they do where some peers are over shm. One
// rank alone on its host keeps its Ps.
func ProcsShare(transportName string, procs, cpus, hostRanks int) int {
	share := max(1, cpus/max(1, hostRanks))
	overNet := strings.Contains(transportName, "tcp") || strings.Contains(transportName, "ucx")
	if !overNet || strings.Contains(transportName, "shm") || hostRanks < 2 || procs <= share {
		return 0
	}
	return share
}

// bindCPUs binds this rank as MOEX_CPU_BIND says: none (the default for a library: the
// launcher's policy), auto or core (a core of its own when the host has enough; moex run
// and moex bench set it), numa (the CPUs and memory of the NUMA node of its GPU or NIC).
func bindCPUs(env Env, localRank, localSize int, log *slog.Logger) error {
	switch bind := os.Getenv("MOEX_CPU_BIND"); bind {
	case "", "none":
	case "auto", "core":
		// Measured: P=2 AlltoAll of 64 KiB over shm took 5-7us bound, and 7-37us
		// (bimodal) unbound, as both busy ranks landed on one core now and then.
		if localSize > 1 && localSize <= runtime.NumCPU() {
			if cpu, err := bindToCPU(localRank); err != nil {
				log.Warn("moex: binding to a core failed", "err", err)
			} else {
				log.Info("moex: bound to a core", "rank", env.Rank, "cpu", cpu)
			}
		}
	case "numa":
		tp := topo.Discover(topo.Options{Logger: log})
		node, why := tp.NodeFor(localRank, env.Iface)
		if n := tp.Node(node); n == nil {
			log.Warn("moex: not bound to a NUMA node", "rank", env.Rank, "why", why)
		} else if err := bindToNode(node, n.CPUs); err != nil {
			log.Warn("moex: binding to a NUMA node failed", "rank", env.Rank, "node", node, "err", err)
		} else {
			log.Info("moex: bound to a NUMA node", "rank", env.Rank, "node", node, "why", why)
		}
	default:
		return &ArgError{Arg: "MOEX_CPU_BIND", Reason: fmt.Sprintf("%q: want none, auto, core or numa", bind)}
	}
	return nil
}

// Local returns the endpoints of n ranks in this process (inproc), for coll.Local.
func Local(n int, poller *busypoll.Poller, pool *obuf.Pool) []transport.Transport {
	eps := inproc.New(n, inproc.Config{Poller: poller, Pool: pool})
	out := make([]transport.Transport, n)
	for i, e := range eps {
		out[i] = e
	}
	return out
}

// openTransport picks and connects the transport (see the package doc). MOEX_TRANSPORT
// forces a choice.
func openTransport(ctx context.Context, env Env, rv *Rendezvous, hosts []int, poll busypoll.Config, log *slog.Logger) (transport.Transport, string, Class, error) {
	if env.Size == 1 {
		return inproc.New(1, inproc.Config{})[0], "inproc: single rank", Inproc, nil
	}
	me := hosts[env.Rank]
	local := make([]bool, env.Size)
	remote := make([]bool, env.Size)
	nHosts := 0
	seen := map[int]bool{}
	for q, h := range hosts {
		local[q] = h == me
		remote[q] = !local[q]
		if !seen[h] {
			seen[h] = true
			nHosts++
		}
	}
	switch env.Transport {
	case "inproc":
		return nil, "", 0, &ArgError{Arg: "MOEX_TRANSPORT", Reason: "inproc needs every rank in one process (use coll.Local)"}
	case "shm":
		if nHosts > 1 {
			return nil, "", 0, &ArgError{Arg: "MOEX_TRANSPORT", Reason: fmt.Sprintf("shm needs every rank on one host; the ranks span %d hosts", nHosts)}
		}
	case "ucx":
		t, why, err := openOptional(ctx, env, rv, nil, true, poll, log)
		if err != nil {
			return nil, "", 0, err
		}
		class := Net
		if nHosts == 1 {
			class = Shm
		}
		return t, why, class, nil
	}
	// Every rank takes part in each set-up (their exchanges are collective), even when it
	// has no peer to use one of them for.
	useShm := env.Transport != "tcp"
	var sh *shm.Transport
	if useShm {
		scfg := shm.Config{Rank: env.Rank, Size: env.Size, Local: local, Exchange: rv.AllGather, Logger: log}
		if err := scfg.ConfigFromEnv(os.Getenv); err != nil {
			return nil, "", 0, err
		}
		scfg.Poll = poll
		var err error
		if sh, err = shm.New(ctx, scfg); err != nil {
			return nil, "", 0, err
		}
		if nHosts == 1 {
			return sh, "shm: every rank on this host (" + sh.Mode() + ")", Shm, nil
		}
	}
	var net transport.Transport
	var netWhy string
	if env.Transport == "tcp" {
		netWhy = "MOEX_TRANSPORT=tcp"
	} else {
		u, why, err := openOptional(ctx, env, rv, remote, false, poll, log)
		if err != nil {
			closeIf(sh)
			return nil, "", 0, err
		}
		net, netWhy = u, why
	}
	if net == nil {
		bind, err := env.BindHost()
		if err != nil {
			closeIf(sh)
			return nil, "", 0, err
		}
		cfg := tcp.Config{Rank: env.Rank, Size: env.Size, Exchange: rv.AllGather, Bind: bind, Token: []byte(env.Token), Logger: log}
		if err := cfg.ConfigFromEnv(os.Getenv); err != nil {
			closeIf(sh)
			return nil, "", 0, err
		}
		cfg.Poll = poll
		t, err := tcp.New(ctx, cfg)
		if err != nil {
			closeIf(sh)
			return nil, "", 0, err
		}
		net = t
		netWhy = "tcp: " + netWhy
	}
	if sh == nil {
		return net, netWhy, Net, nil
	}
	by := make([]transport.Transport, env.Size)
	for q := range by {
		if local[q] {
			by[q] = sh
		} else {
			by[q] = net
		}
	}
	m, err := transport.NewMux("shm+"+net.Name(), by)
	if err != nil {
		sh.Close()
		net.Close()
		return nil, "", 0, err
	}
	return m, "shm for the ranks on this host; for the others " + netWhy, Net, nil
}

func closeIf(t *shm.Transport) {
	if t != nil {
		t.Close()
	}
}

// openOptional opens UCX (in builds with -tags ucx; see ucx.go) for the ranks in peers
// (nil: all). With force it must succeed; otherwise it returns a nil transport and the
// reason tcp is used instead when UCX is missing or offers no RDMA to some rank. Every
// rank calls it with the same force, so the exchanges inside stay collective.
var openOptional = func(ctx context.Context, env Env, rv *Rendezvous, peers []bool, force bool, poll busypoll.Config, log *slog.Logger) (transport.Transport, string, error) {
	if force {
		return nil, "", &ArgError{Arg: "MOEX_TRANSPORT", Reason: "ucx: this binary was not built with -tags ucx"}
	}
	return nil, "UCX not built (build with -tags ucx for RDMA)", nil
}
