package coll

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"sort"
	"sync/atomic"
	"time"

	"github.com/moex-ai/moex/coll/algos"
	"github.com/moex-ai/moex/coll/health"
	"github.com/moex-ai/moex/coll/shared"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// Communicators made and ended: from the environment (Init), as goroutines (Local), by
// splitting another (Split, SplitHosts), as a model without ranks (NewModel), and Close.

// newComm builds a communicator over tr. The caller finishes setting it up and then calls
// listen; nothing else runs before that, so the fields set in between need no lock.
func newComm(tr transport.Transport, id uint32, ranks, hosts []int, rank int, cfg Config, link LinkCost) *Comm {
	c := &Comm{
		tr: tr, ranks: ranks, rank: rank, size: len(ranks), id: id, hosts: hosts, cfg: cfg,
		link: link, log: cfg.Logger, pool: cfg.Pool, plans: map[algos.PlanKey]*algos.Plan{}, vplans: map[vkey]*vcached{},
	}
	c.async.init()
	if cfg.Link != nil {
		c.link = *cfg.Link
	}
	c.intra = c.link
	if cfg.Link == nil && cfg.NetGbits > 0 && slices.Max(hosts) > 0 {
		c.link.Beta = 8 / (cfg.NetGbits * 1e9)
	}
	if cfg.HostLink != nil {
		c.intra = *cfg.HostLink
	}
	c.topo = algos.NewTopology(hosts)
	if cfg.Profile {
		c.prof.plan = algos.PlanAllGatherBruck(algos.Shape{P: c.size, Rank: rank, Es: 8, Count: 1})
		c.prof.plan.Sig = algos.Signature(OpAllGather, Bruck, 8, 1, -2)
	}
	c.pend = make([]atomic.Int32, c.size)
	c.actx, c.acancel = context.WithCancelCause(context.Background())
	c.dog = health.NewWatchdog(cfg.Timeout, WarnAfter, func() bool { return c.actx.Err() != nil }, c.stalled, c.stalling)
	c.execPool.New = func() any { return &execState{} }
	return c
}

// Close releases the communicator: its watchers stop, and the transport and rendezvous
// (for the communicator Init or Local created) are closed. Pending operations fail with
// ErrClosed. Close does not talk to other ranks; they see this rank leave.
//
// For the communicator Init returned, Close is collective: it first waits (for at most the
// timeout, or 30 s) until every rank has reached Close, so that a rank that finishes early
// does not fail the last operation of a slower one by leaving.
//
// Deferred directly (defer c.Close()) in a function that panics, Close reports the panic
// before the panic goes on: it aborts the communicator with a *PanicError naming this
// rank (every other rank's pending and next operations fail with it, and a launcher such
// as moex run names this rank as the one that panicked), closes without waiting for the
// others, and panics again with the same value, so that the message and the stack print
// as they would have. Deferred any other way (inside a closure), it cannot see the
// panic, and the others learn of this rank's end as of a dead peer.
func (c *Comm) Close() error {
	if r := recover(); r != nil {
		c.abortLocal(&PanicError{Rank: c.ranks[c.rank], Value: panicText(r)})
		_ = c.close()
		panic(r)
	}
	return c.close()
}

// panicText is a panic's value as a PanicError carries it: its text, cut to what an
// abort notice carries.
func panicText(r any) string {
	s := fmt.Sprint(r)
	if len(s) > health.MaxReason/2 {
		s = s[:health.MaxReason/2] + "..."
	}
	return s
}

func (c *Comm) close() error {
	if c.closeBarrier && !c.closed.Load() && c.Err() == nil && c.size > 1 {
		ctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.Timeout, 30*time.Second))
		if err := Barrier(ctx, c); err != nil {
			c.log.Warn("moex: not every rank reached Close", "rank", c.rank, "err", err)
		}
		cancel()
	}
	if c.closed.Swap(true) {
		return nil
	}
	if pa := c.splitFrom; pa != nil {
		pa.kidsMu.Lock()
		delete(pa.kids, c)
		pa.kidsMu.Unlock()
	}
	var errs []error
	if c.cfg.Profile {
		for _, p := range c.Profile() {
			c.log.Info("moex: profile", "comm", c.id, "rank", c.rank, "profile", p.String())
		}
		if err := c.writeTrace(); err != nil {
			c.log.Warn("moex: trace not written", "rank", c.rank, "err", err)
			errs = append(errs, err)
		}
	}
	c.abortOnce.Do(func() { c.acancel(ErrClosed) })
	c.acancel(ErrClosed)
	c.dog.Stop()
	c.ctxMu.Lock()
	if c.stopCtx != nil {
		c.stopCtx()
	}
	c.ctxMu.Unlock()
	// A sendCtl under way has added its watcher once this lock is taken; later ones send
	// nothing and add none.
	c.watchMu.Lock()
	c.ctlStopped = true
	c.watchMu.Unlock()
	c.watchers.Wait()
	close(c.async.stop)
	c.async.wg.Wait()
	errs = append(errs, c.owned.release())
	return errors.Join(errs...)
}

// Local returns n communicators whose ranks are goroutines of this process, connected by
// the inproc transport.
func Local(n int, cfg Config) ([]*Comm, error) {
	if n < 1 {
		return nil, &ArgError{Arg: "n", Reason: fmt.Sprintf("%d ranks", n)}
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	if cfg.Hosts != nil && len(cfg.Hosts) != n {
		return nil, &ArgError{Arg: "Hosts", Reason: fmt.Sprintf("%d entries for %d ranks", len(cfg.Hosts), n)}
	}
	// The ranks are goroutines: with no P to spare, a spinning rank takes the P another
	// rank needs (measured: P=2 on GOMAXPROCS=2, 64 KiB AllReduce, adaptive spinning 10.9us
	// against 8.3us parking).
	poller := busypoll.New(busypoll.Config{Mode: cfg.Poll.Mode, MaxSpin: cfg.Poll.MaxSpin,
		Oversubscribed: cfg.Poll.Oversubscribed || n >= runtime.GOMAXPROCS(0)})
	eps := bootstrap.Local(n, poller, cfg.Pool)
	ranks := make([]int, n)
	for i := range ranks {
		ranks[i] = i
	}
	hosts := cfg.Hosts
	if hosts != nil {
		hosts = hostsDense(hosts)
	} else {
		hosts = make([]int, n)
	}
	cs := make([]*Comm, n)
	for i, e := range eps {
		tr := e
		if cfg.Wrap != nil {
			tr = cfg.Wrap(i, e)
		}
		cs[i] = newComm(tr, 1, ranks, hosts, i, cfg, CostInproc)
		cs[i].why = "inproc: every rank in this process (Local)"
		cs[i].owned = newOwner(tr.Close)
		cs[i].listen()
	}
	return cs, nil
}

// New returns the communicator of the ranks that t connects, on t: this rank is
// t.Rank() of t.Size(). It is how a transport of the caller's (one that implements
// transport.Transport) runs moex's collectives without the bootstrap; New itself does
// not talk to the other ranks, each of which calls it on its own endpoint. cfg.Hosts, if
// set, says which ranks share a host (for the hierarchical algorithms); cfg.Link is the
// cost of the transport's links (default: CostNet, a network). The communicator does not
// own t: close t after the communicator.
func New(t transport.Transport, cfg Config) (*Comm, error) {
	if t == nil {
		return nil, &ArgError{Arg: "t", Reason: "no transport"}
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	n := t.Size()
	if n < 1 || t.Rank() < 0 || t.Rank() >= n {
		return nil, &ArgError{Arg: "t", Reason: fmt.Sprintf("rank %d of %d ranks", t.Rank(), n)}
	}
	hosts := make([]int, n)
	if cfg.Hosts != nil {
		if len(cfg.Hosts) != n {
			return nil, &ArgError{Arg: "Hosts", Reason: fmt.Sprintf("%d entries for %d ranks", len(cfg.Hosts), n)}
		}
		hosts = hostsDense(cfg.Hosts)
	}
	ranks := make([]int, n)
	for i := range ranks {
		ranks[i] = i
	}
	if cfg.Wrap != nil {
		t = cfg.Wrap(t.Rank(), t)
	}
	c := newComm(t, 1, ranks, hosts, t.Rank(), cfg, CostNet)
	c.why = t.Name() + ": the caller's transport (coll.New)"
	c.direct = sharedAreas(t)
	c.owned = newOwner()
	return c.listen(), nil
}

// sharedAreas is the collectives through t's shared areas, nil where t has none.
func sharedAreas(t transport.Transport) *shared.Direct {
	if ss, ok := t.(transport.SharedSegment); ok {
		if a := ss.Areas(); a != nil {
			return shared.New(a, t.Rank(), t.Size())
		}
	}
	return nil
}

// joinInit is Init for a process that takes over a rank of a running job
// (MOEX_JOINING=1): set by grow.go.
var joinInit func(ctx context.Context, env bootstrap.Env, cfg Config) (*Comm, error)

// Init joins the job described by the environment (MOEX_*, torchrun, Open MPI or Slurm
// variables; see moex env): rendezvous at rank 0's store, exchange host
// identities, connect a transport to every rank, and return the world communicator.
func Init(ctx context.Context, cfg Config) (*Comm, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	env, err := bootstrap.FromEnv()
	if err != nil {
		return nil, err
	}
	if env.Timeout > 0 && os.Getenv("MOEX_TIMEOUT") != "" {
		cfg.Timeout = env.Timeout
	}
	return InitEnv(ctx, env, cfg)
}

// InitEnv is Init with the job description given.
func InitEnv(ctx context.Context, env bootstrap.Env, cfg Config) (*Comm, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if env.Joining {
		return joinInit(ctx, env, cfg)
	}
	health.ReportJoin(env.Rank, health.Joining)
	// Start-up is an operation like any other: one deadline (MOEX_INIT_TIMEOUT, else the
	// communicator's timeout), and on failure every rank says which ranks it never heard
	// from and how far each got (*bootstrap.StartupError).
	ictx, cancelInit := context.WithTimeout(ctx, cfg.InitTimeout)
	defer cancelInit()
	rv, err := bootstrap.Join(ictx, env, log)
	for backoff := 50 * time.Millisecond; env.Restarted && errors.Is(err, bootstrap.ErrRankLive); backoff = min(2*backoff, time.Second) {
		// Restarted for a rank whose process died: the live ranks have not yet removed
		// its entry (they remove it once they have shrunk past it), or its lease lives on.
		select {
		case <-ictx.Done():
			return nil, fmt.Errorf("coll: rank %d, restarted, was still live in the job's store at the start-up deadline: %w", env.Rank, err)
		case <-time.After(backoff):
		}
		rv, err = bootstrap.Join(ictx, env, log)
	}
	if errors.Is(err, bootstrap.ErrJobRunning) {
		// A store that outlives start-up (etcd) says the job runs without this rank: this
		// process was started again for a rank whose process died, and takes it over.
		log.Info("moex: the job runs without this rank; taking it over", "rank", env.Rank, "registry", env.Registry)
		env.Joining = true
		return joinInit(ctx, env, cfg)
	}
	if err != nil {
		return nil, err
	}
	if env.AddrNote != "" {
		log.Info("moex: rendezvous", "rank", env.Rank, "store", rv.Env.Addr, "chosen", env.AddrNote)
	}
	sctx, stopWatch := rv.Watch(ictx) // ends as soon as the store learns the start-up failed
	fail := func(err error) (*Comm, error) {
		stopWatch()
		var se *bootstrap.StartupError
		switch cause := context.Cause(sctx); {
		case errors.As(cause, &se):
			err = se // a rank left or was claimed twice: the root, not its symptom here
		case !errors.As(err, &se) && ictx.Err() != nil:
			err = rv.Explain(err) // the deadline: the store says who is missing
		}
		rv.Close()
		return nil, err
	}
	ctx = sctx
	// Hosts, CPU binding, the network's speed and the transport to every peer.
	bs, err := bootstrap.Open(ctx, env, rv, *cfg.Poll, log)
	if err != nil {
		var tae *transport.ArgError
		if errors.As(err, &tae) {
			err = &ArgError{Arg: tae.Arg, Reason: tae.Reason}
		}
		return fail(err)
	}
	tr, why, hosts, poll := bs.Transport, bs.Why, bs.Hosts, bs.Poll
	link := map[bootstrap.Class]LinkCost{bootstrap.Inproc: CostInproc, bootstrap.Shm: CostShm, bootstrap.Net: CostNet}[bs.Class]
	if bs.NetGbits > 0 && cfg.Link == nil && cfg.NetGbits == 0 {
		// The network's speed for the cost model: the NIC's (MOEX_NET_GBITS overrides).
		cfg.NetGbits = bs.NetGbits
		log.Info("moex: network speed for the cost model", "rank", env.Rank, "gbits", cfg.NetGbits)
	}
	ranks := make([]int, env.Size)
	for i := range ranks {
		ranks[i] = i
	}
	if cfg.Wrap != nil {
		tr = cfg.Wrap(env.Rank, tr)
	}
	c := newComm(tr, 1, ranks, hosts, env.Rank, cfg, link)
	c.why = why
	c.direct = sharedAreas(tr) // the shared-area collectives (shm, every rank on this host)
	if c.topo.Hosts > 1 && cfg.HostLink == nil && env.Transport != "tcp" {
		c.intra = CostShm // the ranks of a host talk through shared memory
	}
	c.crowded = poll.Oversubscribed
	if c.direct != nil && poll.Oversubscribed && cfg.Link == nil {
		// One host, more ranks than CPUs: every step that waits for a peer costs
		// context switches (see CrowdedAlpha).
		c.link.Alpha *= CrowdedAlpha
		c.intra.Alpha *= CrowdedAlpha
	}
	rv.SetTransport(bs.Transport.Name())
	if err := rv.Ready(ctx); err != nil { // every rank is set up; the store closes
		tr.Close()
		return fail(err)
	}
	stopWatch()
	closers := []func() error{rv.Close, tr.Close}
	if env.Registry != "" { // where the processes that take over dead ranks are found (Admit)
		reg, err := bootstrap.DialRegistry(ictx, env.Registry, []byte(env.Token))
		if err != nil {
			tr.Close()
			rv.Close()
			return nil, err
		}
		c.registry = reg
		closers = append(closers, reg.Close)
	}
	health.ReportJoin(env.Rank, health.Joined)
	c.owned = newOwner(closers...)
	c.closeBarrier = true
	c.listen()
	if log.Enabled(ctx, slog.LevelInfo) {
		pr, _ := tr.(transport.PathReporter)
		for q := 0; q < env.Size; q++ {
			path := why
			if pr != nil {
				path = pr.Path(q)
			}
			log.Info("moex: transport to peer", "rank", env.Rank, "peer", q, "host", hosts[q], "transport", tr.Name(), "why", why, "path", path)
		}
		log.Info("moex: initialised", "rank", env.Rank, "size", env.Size, "hosts", c.topo.Hosts, "launcher", env.Launcher,
			"transport", tr.Name(), "poll", poll.Mode.String(), "oversubscribed", poll.Oversubscribed, "timeout", cfg.Timeout)
	}
	return c, nil
}

// Split partitions the communicator: ranks that pass the same color form a new
// communicator, ordered by key (then by rank). A negative color (Undefined) returns nil.
// Split is collective: every rank must call it. Aborting c aborts what was split from
// it (and, for their ranks, tells their peers), so that no rank waits in a child for a
// rank that gave up on the parent.
func (c *Comm) Split(ctx context.Context, color, key int) (*Comm, error) {
	mine := []int64{int64(color), int64(key)}
	all := make([]int64, 2*c.size)
	if err := AllGather(ctx, c, mine, all); err != nil {
		return nil, err
	}
	c.issueMu.Lock()
	c.splits++
	n := c.splits
	c.issueMu.Unlock()
	if color < 0 {
		return nil, nil
	}
	type member struct{ key, rank int }
	var ms []member
	for r := 0; r < c.size; r++ {
		if int(all[2*r]) == color {
			ms = append(ms, member{int(all[2*r+1]), r})
		}
	}
	sort.SliceStable(ms, func(i, j int) bool {
		if ms[i].key != ms[j].key {
			return ms[i].key < ms[j].key
		}
		return ms[i].rank < ms[j].rank
	})
	ranks := make([]int, len(ms))
	hosts := make([]int, len(ms))
	me := -1
	for i, m := range ms {
		ranks[i] = c.ranks[m.rank]
		hosts[i] = c.hosts[m.rank]
		if m.rank == c.rank {
			me = i
		}
	}
	id := algos.Signature(OpKind(0xff), 0, int(c.id), int(n), color)
	if id >= 0xFFFFFFF0 || id <= 1 {
		id ^= 0x5a5a5a5a
	}
	sub := newComm(c.tr, id, ranks, hostsDense(hosts), me, c.cfg, c.link)
	sub.why = c.why
	if sub.topo.Hosts == 1 {
		sub.link = c.intra // every link of this one is within a host
	}
	sub.intra = c.intra
	sub.parent = make([]int, len(ms))
	for i, m := range ms {
		sub.parent[i] = m.rank
	}
	sub.splitFrom = c
	sub.registry = c.registry
	c.kidsMu.Lock()
	if c.kids == nil {
		c.kids = map[*Comm]struct{}{}
	}
	c.kids[sub] = struct{}{}
	c.kidsMu.Unlock()
	if err := c.Err(); err != nil { // aborted while splitting: so is the child
		sub.listen()
		sub.abortLocal(fmt.Errorf("%w: the communicator it was split from aborted: %v", ErrAborted, err))
		return sub, nil
	}
	return sub.listen(), nil
}

func hostsDense(h []int) []int {
	idx := map[int]int{}
	out := make([]int, len(h))
	for i, x := range h {
		if _, ok := idx[x]; !ok {
			idx[x] = len(idx)
		}
		out[i] = idx[x]
	}
	return out
}

// SplitHosts returns the intra-host communicator (ranks on this rank's host) and the
// inter-host communicator of the ranks with the same local index on every host (nil when
// hosts have different numbers of ranks and this rank has no counterpart on some host).
func (c *Comm) SplitHosts(ctx context.Context) (intra, inter *Comm, err error) {
	local := 0
	for r := 0; r < c.rank; r++ {
		if c.hosts[r] == c.hosts[c.rank] {
			local++
		}
	}
	intra, err = c.Split(ctx, c.hosts[c.rank], c.rank)
	if err != nil {
		return nil, nil, err
	}
	inter, err = c.Split(ctx, local, c.hosts[c.rank])
	if err != nil {
		intra.Close()
		return nil, nil, err
	}
	return intra, inter, nil
}

// Model is the cost model and the planners of a communicator of p ranks on the given
// hosts, without a transport: the algorithm an operation would run with and the schedule
// every rank would follow (moex flow, capacity planning). Its links are those a job on
// that placement sees (cfg.Link and cfg.HostLink, or shared memory within hosts and the
// network between them). It does not model the shared-memory areas, which need the
// ranks' segments: a job over shm may choose them where the model does not.
type Model struct {
	cs []*Comm
}

// NewModel returns the model of p ranks on hosts (nil: one host).
func NewModel(p int, hosts []int, cfg Config) (*Model, error) {
	if p < 1 || p > MaxModelRanks {
		return nil, &ArgError{Arg: "p", Reason: fmt.Sprintf("%d ranks (want 1..%d)", p, MaxModelRanks)}
	}
	if hosts != nil && len(hosts) != p {
		return nil, &ArgError{Arg: "hosts", Reason: fmt.Sprintf("%d entries for %d ranks", len(hosts), p)}
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	if hosts == nil {
		hosts = make([]int, p)
	}
	hosts = hostsDense(hosts)
	link := CostShm
	if slices.Max(hosts) > 0 {
		link = CostNet
		if cfg.HostLink == nil {
			cfg.HostLink = &CostShm
		}
	}
	ranks := make([]int, p)
	for i := range ranks {
		ranks[i] = i
	}
	m := &Model{cs: make([]*Comm, p)}
	for r := range m.cs {
		m.cs[r] = newComm(nil, 0, ranks, hosts, r, cfg, link)
	}
	return m, nil
}

// Comm is rank's communicator of the model: no transport, for planning questions
// (Size, Host, LinkCosts, Algorithm), not for operations.
func (m *Model) Comm(rank int) *Comm { return m.cs[rank] }

// Algorithm is the algorithm op runs with for bytes (see Comm.Algorithm).
func (m *Model) Algorithm(op OpKind, bytes int) Algo { return m.cs[0].Algorithm(op, bytes) }

// Hosts is the number of hosts.
func (m *Model) Hosts() int { return m.cs[0].Hosts() }

// Host is rank r's host index.
func (m *Model) Host(r int) int { return m.cs[0].Host(r) }

// AlltoAllv plans an AlltoAllv of counts[i][j] units of unit bytes from rank i to rank j
// (as Comm.PlanAlltoAllv) and returns its algorithm and rank's schedule.
func (m *Model) AlltoAllv(rank int, counts [][]int, unit int) (Algo, string, error) {
	if rank < 0 || rank >= len(m.cs) {
		return 0, "", &ArgError{Arg: "rank", Reason: fmt.Sprintf("%d of %d", rank, len(m.cs))}
	}
	c := m.cs[rank]
	var vp VPlan
	if err := c.ReplanAlltoAllv(&vp, counts, unit); err != nil {
		return 0, "", err
	}
	return vp.Algo, vp.Describe(c), nil
}

// Describe writes rank's schedule of op on count elements of dt (see Comm.Describe).
func (m *Model) Describe(rank int, op OpKind, dt dtype.Type, count, root int) string {
	return m.cs[rank].Describe(op, dt, count, root)
}
