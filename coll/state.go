package coll

import (
	"context"
	"github.com/moex-ai/moex/transport/bootstrap"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moex-ai/moex/coll/algos"
	"github.com/moex-ai/moex/coll/health"
	"github.com/moex-ai/moex/coll/shared"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// The state a communicator keeps, and the types of its parts: the other files hold what
// it does with them.

// Config tunes communicators. The zero value takes everything from defaults.
type Config struct {
	// Timeout bounds every operation: no progress for this long aborts the communicator
	// (default bootstrap.DefaultTimeout, MOEX_TIMEOUT).
	Timeout time.Duration
	// InitTimeout bounds Init: every rank of the job must have started and connected
	// within it (default MOEX_INIT_TIMEOUT, else Timeout).
	InitTimeout time.Duration
	// Algo overrides the cost model per operation (MOEX_ALGO).
	Algo map[OpKind]Algo
	// Link overrides the cost-model parameters (default: by transport; with ranks on
	// several hosts, those of the network between them).
	Link *LinkCost
	// HostLink overrides the cost-model parameters between ranks of one host when the
	// ranks span hosts (default: shared memory's).
	HostLink *LinkCost
	// NetGbits is the speed of the network between hosts, in Gbit/s, for the cost model
	// when the ranks span hosts and Link is not set (MOEX_NET_GBITS; default: CostNet's
	// 24 Gbit/s). A link slower than the model believes makes it undervalue the
	// algorithms that cross it less (hierarchical, two-level).
	NetGbits float64
	// Logger receives INFO lines (transport per peer, algorithm per operation) when
	// enabled; default: slog to stderr at the MOEX_DEBUG level, else discarded.
	Logger *slog.Logger
	// Pool provides scratch buffers (default obuf.Default).
	Pool *obuf.Pool
	// Poll is the waiting policy (default MOEX_POLL / adaptive).
	Poll *busypoll.Config
	// Verify makes every operation first check, with one small all-gather, that all ranks
	// issued the same operation (catches what per-message signatures cannot, such as two
	// ranks that both think they are the root), and that every rank fails in the same
	// call when one has a bad argument. Costs one extra round trip per op. Broadcast,
	// Reduce, Gather and Scatter of VerifyRootedMin bytes and more verify unless
	// NoRootedVerify is set; smaller ones leave their send-only ranks to learn of a
	// failure in their next operation, which then starts with the agreement unless every
	// rank hears from every rank in it (an AllReduce, say).
	Verify         bool
	NoRootedVerify bool
	// Profile measures, for every operation, how long this rank waited for the others to
	// arrive and how long the operation itself took, and which rank arrived last
	// (Comm.Profile; MOEX_PROFILE=1). Costs one small all-gather per operation; an
	// exchange costs nothing more (its blocks say when their senders entered).
	Profile bool
	// TraceDir makes Close write this rank's operations to a Chrome-trace JSON file in
	// that directory (MOEX_TRACE=dir; see TracePath): each op with its algorithm and
	// bytes, split into waiting for the last rank and moving. It turns Profile on.
	TraceDir string
	// Hosts assigns ranks of Local communicators to pretend hosts (tests of hierarchical
	// code); nil: one host.
	Hosts []int
	// NoWindows makes Exchanges (the MoE low-latency mode) send every block as a message,
	// even to ranks whose memory the transport could write directly (MOEX_WINDOWS=0).
	NoWindows bool
	// Wrap, when set, wraps each rank's transport before the communicator uses it: for
	// tests that inject faults (transporttest.Faulty) or trace messages. A wrapper that
	// hides the transport's optional capabilities (windows, shared areas) turns them off.
	Wrap func(rank int, tr transport.Transport) transport.Transport
}

// Comm is a communicator: a group of ranks that run collectives together.
type Comm struct {
	tr    transport.Transport
	ranks []int // comm rank -> transport rank
	rank  int
	size  int
	id    uint32
	hosts []int // comm rank -> host index
	topo  algos.Topology
	cfg   Config
	link  LinkCost // the cost model's link: the slowest (between hosts when ranks span hosts)
	intra LinkCost // between ranks of one host
	why   string   // why the transport was chosen
	log   *slog.Logger
	pool  *obuf.Pool

	issueMu sync.Mutex
	seq     uint32
	splits  uint32
	// unconfirmed (under issueMu): the last operation was a rooted one that did not
	// verify, so the next may have to (Comm.confirms).
	unconfirmed bool
	shrinks     uint32
	grows       uint32
	closed      atomic.Bool

	planMu   sync.Mutex
	plans    map[algos.PlanKey]*algos.Plan
	vplans   map[vkey]*vcached // variable-size plans for the counts seen last
	vmu      sync.Mutex        // held while a variable-size op is planned
	vscratch algos.Blocks      // its blocks

	actx       context.Context // cancelled on abort or close; every wait uses it
	acancel    context.CancelCauseFunc
	abortOnce  sync.Once
	watchers   sync.WaitGroup
	watchMu    sync.Mutex // orders sendCtl's Add against Close's Wait
	ctlStopped bool       // under watchMu: Close waits for the watchers, sendCtl sends nothing
	ctlBufs    [][]byte

	// lost[q] is closed when peer q's watcher has seen the transport report q gone (and
	// so that no abort notice came from q before it left: see awaitNotice).
	lost []chan struct{}

	probeMu sync.Mutex
	probeCh chan health.Reply // replies to this rank's stall probe, while one runs

	dog  *health.Watchdog // no progress for the timeout aborts the communicator
	pend []atomic.Int32   // per peer: transfers posted and not yet waited for (who a stuck op waits for)

	ctxMu   sync.Mutex
	lastCtx context.Context
	stopCtx func() bool

	execPool sync.Pool

	verifyOnce    sync.Once
	verifyPlan    *algos.Plan // the all-gather of Config.Verify
	verifyScratch sync.Pool   // of *verifyScratch
	async         workers
	stats         Stats
	prof          profiler

	owned        *owner // the transport and rendezvous (Init, Local, and what Shrink made of them)
	splitFrom    *Comm  // the communicator Split made this one from
	kidsMu       sync.Mutex
	kids         map[*Comm]struct{} // communicators split from this one, not closed yet
	parent       []int              // rank in the communicator this one was made from (Split, Shrink)
	closeBarrier bool               // Close waits for every rank first (communicators from Init)
	direct       *shared.Direct     // the collectives through the shared areas (Shared), when every rank is on this host over shm
	crowded      bool               // this host's ranks outnumber its CPUs (Init)
	// registry is the job's registry (MOEX_REGISTRY), where Admit finds the processes
	// waiting to take over ranks; shared by what is made from the communicator.
	registry bootstrap.KV
	// registryDown: until when Admit does not ask the registry again (it did not answer).
	registryDown time.Time
}

// Stats counts a communicator's work.
type Stats struct {
	Ops       atomic.Uint64 // operations completed
	BytesSent atomic.Uint64 // bytes this rank sent in them
}

// Link describes how this rank reaches one peer.
type Link struct {
	Peer      int    // rank in the communicator
	Host      int    // host index (ranks with equal Host share memory)
	Transport string // the transport's name ("shm", "tcp", "ucx", "shm+tcp" ...)
	Path      string // the path the transport reports for the peer (lanes, copies)
	Why       string // why this transport was chosen
}

// owner holds what the communicators made by Init or Local own, and what Shrink makes
// of them share: the transport and the rendezvous, closed by the last one's Close.
type owner struct {
	refs    atomic.Int32
	closers []func() error
}

// workers run the non-blocking operations: a pool that grows to the number in flight at
// once and is stopped, and waited for, by Close. Starting no goroutine per operation
// keeps the non-blocking forms free of allocation.
type workers struct {
	jobs chan *job
	stop chan struct{}
	idle atomic.Int32 // workers waiting for a job that no submission has claimed
	wg   sync.WaitGroup
	mu   sync.Mutex
	free []*job
}

// Handle is a non-blocking operation in flight. Operations run in issue order on every
// rank; several in flight at once proceed concurrently. Wait for a Handle from one
// goroutine at a time. The operation's buffers are its own until Wait returns, as in
// MPI: its send buffer must not be written (other ranks may read it where it is), nor
// its receive buffer used.
type Handle struct {
	ev   busypoll.Event // set when the operation completes
	err  error
	busy atomic.Bool // in flight (for handles reused by the With forms)
}

// job is a non-blocking operation waiting for, or running on, one of the
// communicator's workers.
type job struct {
	pl    *algos.Plan
	seq   uint32
	cl    call
	after func()
	h     *Handle
}

// execState is the scratch of one running operation (pooled: operations allocate nothing
// in steady state).
type execState struct {
	reqs  []transport.Request
	wants []int // expected length of each receive in reqs (-1 for sends)
	xs    []algos.Xfer
}

// call describes one invocation.
type call struct {
	op    OpKind
	dt    dtype.Type
	redop dtype.Op
	count int // elements, as the planner expects
	root  int
	send  []byte
	recv  []byte
	turn  uint64 // Shared: the operation's place in the shared areas' order
	// verify: the operation starts with the all-gather of Config.Verify (or of the
	// rooted operations' automatic check, VerifyRootedMin).
	verify bool
}

// verifyScratch is one verification's buffer and call.
type verifyScratch struct {
	all []int64
	cl  call
}

// OpProfile is what profiling measured for one kind of operation on this rank.
type OpProfile struct {
	Op    OpKind // the operation
	Count int    // how many ran
	// Wait is the time from entering operations until every rank had entered them (as
	// the arrival all-gather saw it, its own latency included); Move is the time of the
	// operations after that.
	Wait, Move time.Duration
	// Skew sums, over the operations, the spread of the ranks' entry times (latest
	// minus earliest), read from their clocks: exact between ranks of one host, as good
	// as the clocks' synchronisation between hosts.
	Skew time.Duration
	// Last[q] counts the operations that rank q entered last. For exchanges (OpExchange,
	// under the MoE low-latency mode), which add no arrival all-gather, it counts those
	// whose last block to arrive while this rank waited was rank q's.
	Last []int
	// WaitFor[q] is the part of Wait spent waiting for rank q: for an operation, all of it
	// for the rank that entered last; for an exchange, from the arrival of the block before
	// q's (or the start of XOp.Wait) to the arrival of q's. It sums to Wait, and names the
	// ranks a slow step waited for.
	WaitFor []time.Duration
}

type profiler struct {
	mu      sync.Mutex
	ops     [algos.OpKindEnd]OpProfile
	plan    *algos.Plan  // the arrival all-gather
	events  []traceEvent // with Config.TraceDir
	dropped int          // operations not recorded (beyond maxTraceEvents)
}

type traceEvent struct {
	op         OpKind
	algo       Algo
	bytes      int
	start      int64 // unix ns when this rank entered
	wait, move time.Duration
	skew       time.Duration
	last       int
	// An exchange: move is from Begin to Wait (this rank's sends, and whatever its
	// caller did meanwhile), then wait; waitFor[q] is the wait charged to rank q.
	exchange bool
	waitFor  map[string]float64
}

// vkey identifies a cached variable-size plan: the operation, and a hash of its blocks.
type vkey struct {
	algos.PlanKey
	h uint64
}

type vcached struct {
	pl *algos.Plan
	bl *algos.Blocks
}
