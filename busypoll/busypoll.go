// Package busypoll is moex's progress engine: the policy that decides, while a receiver
// waits, whether to spin on completion state, yield the CPU, or park until woken.
//
// It owns the spin/yield/park policy, its adaptive spin budget and its counters. It does
// not know what is being waited for: callers pass a condition (a ring index, a request
// flag, a socket that returned EAGAIN) and an Event or a park function of their own.
//
// Why adaptive: a receiver that parks in the kernel adds a wake-up (microseconds) to every
// message, and a receiver that spins burns a core; with more ranks than cores (8 ranks on
// 2 cores is a normal test) spinning waiters steal the CPU that the ranks they wait for
// need, and everything slows down. The adaptive mode spins for a budget that follows what
// recent waits needed: waits that finished while spinning keep the budget, waits that had
// to park shrink it, so an oversubscribed machine converges to parking almost at once and
// a machine with idle cores converges to spinning.
package busypoll

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// Mode selects the waiting policy.
type Mode int

const (
	// Adaptive spins for a learned budget, yields a few times, then parks.
	Adaptive Mode = iota
	// Spin never parks (until the context ends): lowest latency, one busy core per waiter.
	Spin
	// Block parks at once, like a blocking receive in the kernel.
	Block
)

func (m Mode) String() string {
	switch m {
	case Adaptive:
		return "adaptive"
	case Spin:
		return "spin"
	case Block:
		return "block"
	}
	return "mode(" + strconv.Itoa(int(m)) + ")"
}

// ParseMode parses "adaptive", "spin" or "block".
func ParseMode(s string) (Mode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "adaptive", "auto":
		return Adaptive, nil
	case "spin", "poll":
		return Spin, nil
	case "block", "blocking", "off":
		return Block, nil
	}
	return 0, fmt.Errorf("busypoll: unknown mode %q (want adaptive, spin or block)", s)
}

// Config tunes a Poller. The zero value is adaptive with the default budgets.
type Config struct {
	Mode Mode // spin, adaptive or block (default adaptive)
	// MaxSpin is the longest an adaptive waiter spins before yielding (0: 1ms; negative:
	// never spin).
	MaxSpin time.Duration
	// Yields is how many times a waiter yields the CPU before parking (default 4).
	Yields int
	// Oversubscribed says that more ranks than CPUs share this host. Then a waiter that
	// spins takes the CPU from the rank it waits for, so the adaptive budget is capped at
	// OversubscribedSpin; instead the waiter polls between yields of the CPU to the
	// kernel (sched_yield, which runs another rank at once) for up to YieldSpin, then
	// parks.
	Oversubscribed bool
	// YieldSpin bounds the yield-polling of oversubscribed waiters (0: 200µs; negative:
	// none, park at once).
	YieldSpin time.Duration
}

const (
	// DefaultMaxSpin is about what a park costs where it costs most: a waiter that parks
	// leaves its CPU idle, and on a virtual machine the wake-up then waits for the host
	// to run that CPU again. Measured on this 2-CPU VM (moex bench coll --op alltoall
	// --ranks 2 --transport shm, 64 KiB, a rank per CPU): each park of the shared-area
	// wait lasted 0.6-1 ms, where the peer arrives within microseconds when both run;
	// with 50 µs budgets, halved at every park, runs of 1000 operations had median 23 us
	// (4-58) against 9.5 (4-13) with 1 ms (Open MPI, which never parks: 6.7). A rank that
	// waits for a straggler burns at most this much of its own CPU before parking.
	DefaultMaxSpin   = time.Millisecond
	DefaultYieldSpin = 200 * time.Microsecond
	defaultYields    = 4
	minSpin          = 0
	probeEvery       = 64 // an adaptive poller with a collapsed budget re-probes this often
	// OversubscribedSpin caps the adaptive budget when ranks outnumber CPUs. Measured with
	// 8 processes on 2 cores (BenchmarkAllToAll8Procs in transport/tcp): a 2µs spin plus
	// yields made an all-to-all 40% slower than parking at once; zero matches blocking.
	OversubscribedSpin = 0
)

// spinning counts the goroutines of this process that are spinning right now, across all
// Pollers. At most maxSpinners() of them spin at once; the others park at once: a spinning
// goroutine holds a P, and with every P spinning nothing else runs (not even the Go
// netpoller, which the scheduler consults only when a P is idle).
var spinning atomic.Int32

func maxSpinners() int32 { return int32(max(1, runtime.GOMAXPROCS(0)-1)) }

// ConfigFromEnv reads MOEX_POLL (adaptive|spin|block), MOEX_YIELD_US and MOEX_SPIN_US.
// MOEX_HOLD_P=1, which an earlier release read, is an error (see ErrHoldPRemoved).
func ConfigFromEnv(getenv func(string) string) (Config, error) {
	var c Config
	m, err := ParseMode(getenv("MOEX_POLL"))
	if err != nil {
		return c, err
	}
	c.Mode = m
	if s := getenv("MOEX_YIELD_US"); s != "" {
		us, err := strconv.Atoi(s)
		if err != nil || us < 0 {
			return c, fmt.Errorf("busypoll: MOEX_YIELD_US=%q: want a non-negative integer", s)
		}
		c.YieldSpin = time.Duration(us) * time.Microsecond
		if us == 0 {
			c.YieldSpin = -1
		}
	}
	switch s := getenv("MOEX_HOLD_P"); s {
	case "", "0":
	default:
		return c, fmt.Errorf("%w (MOEX_HOLD_P=%q)", ErrHoldPRemoved, s)
	}
	if s := getenv("MOEX_SPIN_US"); s != "" {
		us, err := strconv.Atoi(s)
		if err != nil || us < 0 {
			return c, fmt.Errorf("busypoll: MOEX_SPIN_US=%q: want a non-negative integer", s)
		}
		c.MaxSpin = time.Duration(us) * time.Microsecond
		if us == 0 {
			c.MaxSpin = -1
		}
	}
	return c, nil
}

// ErrHoldPRemoved is ConfigFromEnv's error where MOEX_HOLD_P asks for waiters that sleep
// holding their Ps. That mode is gone: its gain came from a background waiter that held
// one P of the process for good, which is GOMAXPROCS one lower, and where ranks share
// CPUs over tcp or ucx a GOMAXPROCS of the rank's share of them gives that gain without
// the hazard (docs/PERFORMANCE.md).
var ErrHoldPRemoved = errors.New("busypoll: MOEX_HOLD_P is no longer supported; where tcp or ucx ranks share CPUs, set MOEX_GOMAXPROCS=auto (or GOMAXPROCS to each rank's share of them)")

// Stats are a Poller's counters. All counts are of waits, except Spins and Yields.
type Stats struct {
	Waits     uint64        // waits that did not find the condition true at once
	Spins     uint64        // polls of the condition while spinning
	Yields    uint64        // CPU yields
	Parks     uint64        // waits that parked
	SpinHits  uint64        // waits satisfied while spinning or yielding
	SpinTime  time.Duration // wall time spent spinning and yielding (CPU burnt polling)
	BudgetNow time.Duration // current adaptive spin budget
}

func (s Stats) String() string {
	return fmt.Sprintf("waits=%d spins=%d yields=%d parks=%d spin-hits=%d spin-time=%v budget=%v",
		s.Waits, s.Spins, s.Yields, s.Parks, s.SpinHits, s.SpinTime, s.BudgetNow)
}

// Poller holds a policy, its adaptive state and its counters. It is safe for concurrent use;
// one Poller per transport (or per rank) is the usual arrangement.
type Poller struct {
	mode      Mode
	maxSpin   int64
	yieldSpin int64 // oversubscribed: poll between sched_yields this long before parking
	yields    int
	budget    atomic.Int64 // adaptive spin budget in ns
	probe     atomic.Uint64

	waits, spins, yieldsN, parks, hits atomic.Uint64
	spinNS                             atomic.Int64
}

// New returns a Poller for c.
func New(c Config) *Poller {
	p := &Poller{mode: c.Mode, maxSpin: int64(c.MaxSpin), yields: c.Yields}
	switch {
	case p.maxSpin == 0:
		p.maxSpin = int64(DefaultMaxSpin)
	case p.maxSpin < 0:
		p.maxSpin = 0
	}
	if p.yields <= 0 {
		p.yields = defaultYields
	}
	if c.Oversubscribed {
		p.maxSpin = min(p.maxSpin, int64(OversubscribedSpin))
		switch {
		case c.YieldSpin == 0:
			p.yieldSpin = int64(DefaultYieldSpin)
		case c.YieldSpin > 0:
			p.yieldSpin = int64(c.YieldSpin)
		}
	}
	p.budget.Store(p.maxSpin)
	return p
}

// Default is a shared adaptive Poller for callers that have none of their own.
var Default = New(Config{Oversubscribed: runtime.NumCPU() < 2})

// Mode returns the policy in use.
func (p *Poller) Mode() Mode { return p.mode }

// Stats returns a snapshot of the counters.
func (p *Poller) Stats() Stats {
	return Stats{
		Waits: p.waits.Load(), Spins: p.spins.Load(), Yields: p.yieldsN.Load(),
		Parks: p.parks.Load(), SpinHits: p.hits.Load(),
		SpinTime: time.Duration(p.spinNS.Load()), BudgetNow: time.Duration(p.budget.Load()),
	}
}

// Spinner is the state of one wait. Use it as:
//
//	s := p.Begin()
//	for !ready() {
//		if s.Idle() { park; break }
//	}
//	s.End()
type Spinner struct {
	p        *Poller
	start    int64
	budget   int64
	n        int
	yielded  int
	parked   bool
	counted  bool
	spinSlot bool // holds one of the process's spinner slots
	osOnly   bool // yield to other processes only (BeginProcess)
}

var epoch = time.Now()

func nanotime() int64 { return int64(time.Since(epoch)) }

// Begin starts a wait.
func (p *Poller) Begin() Spinner {
	s := Spinner{p: p}
	switch p.mode {
	case Spin:
		s.budget = -1
	case Block:
		s.budget = 0
	default:
		s.budget = p.budget.Load()
		if s.budget < p.maxSpin/8 && p.probe.Add(1)%probeEvery == 0 {
			s.budget = p.maxSpin // look again whether spinning pays
		}
	}
	return s
}

// BeginProcess starts a wait for other processes only: nothing of this process's own
// will make the condition true (the waiting goroutine reads shared memory that other
// ranks write), so the waiter yields the CPU to the kernel alone. runtime.Gosched would
// hand it to this process's other goroutines, of which there are none to run, and wake
// an idle thread of the Go runtime to look for them: a context switch that takes the CPU
// from the ranks the waiter waits for.
func (p *Poller) BeginProcess() Spinner {
	s := p.Begin()
	s.osOnly = true
	return s
}

// acquire takes a spinner slot, or reports that enough goroutines spin already.
func (s *Spinner) acquire() bool {
	if spinning.Add(1) > maxSpinners() {
		spinning.Add(-1)
		return false
	}
	s.spinSlot = true
	return true
}

func (s *Spinner) release() {
	if s.spinSlot {
		s.spinSlot = false
		spinning.Add(-1)
	}
}

// Idle is called after a poll found nothing. It spins or yields and returns false, or
// returns true when the caller should park.
func (s *Spinner) Idle() bool {
	if s.parked {
		return true
	}
	if !s.counted {
		s.counted = true
		s.start = nanotime()
		s.p.waits.Add(1)
		if s.budget > 0 && !s.acquire() {
			s.budget = 0 // others spin already: park
		}
	}
	s.n++
	if s.budget < 0 { // Spin mode: never park, yield now and then so Go can preempt
		if s.n&63 == 0 && !s.osOnly {
			runtime.Gosched()
		}
		return false
	}
	if s.budget > 0 {
		if s.n&15 != 0 {
			return false
		}
		if nanotime()-s.start < s.budget {
			if s.osOnly {
				return false
			}
			// A goroutine this one woke (by completing its request) waits in this P's run
			// queue, and nothing preempts a spinning goroutine for milliseconds: let it run.
			runtime.Gosched()
			return false
		}
	}
	if s.yielded < s.p.yields && s.budget > 0 {
		s.yielded++
		if s.osOnly {
			osYield()
		} else {
			yield(s.yielded)
		}
		return false
	}
	if s.p.yieldSpin > 0 && s.p.mode == Adaptive && nanotime()-s.start < s.p.yieldSpin {
		// Oversubscribed: let another rank run (likely the one we wait for), then look
		// again: a goroutine of this process (ranks as goroutines, or the transport's own
		// goroutines) through Go's scheduler, another process through the kernel's.
		s.yielded++
		if s.yielded&1 == 0 && !s.osOnly {
			runtime.Gosched()
		} else {
			osYield()
		}
		return false
	}
	s.parked = true
	s.release()
	return true
}

// osYield is sched_yield as a raw system call: it returns as soon as the kernel runs this
// thread again, so the Go runtime need not know (Syscall would mark the P as in a system
// call, and sysmon may hand it to another thread: one more thread woken on a host whose
// CPUs are all taken). Measured with moex bench coll, AlltoAll 64 KiB over shm, 10
// rounds alternating: P=4 on 2 CPUs 21.6 us best (median 25.3) against 22.9 (30.6), P=8
// 71.4 (78.7) against 79.3 (87.7).
func osYield() { syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) }

// OSYield gives the CPU to another thread of any process (sched_yield).
func OSYield() { osYield() }

// End records how the wait went and adapts the budget.
func (s *Spinner) End() {
	if !s.counted {
		return // satisfied on the first look
	}
	s.release()
	p := s.p
	elapsed := nanotime() - s.start
	if s.budget < 0 {
		p.spins.Add(uint64(s.n))
		p.spinNS.Add(elapsed)
		p.hits.Add(1)
		return
	}
	spun := int64(s.n - s.yielded)
	if s.parked {
		spun-- // the call that decided to park did not spin
	}
	p.spins.Add(uint64(spun))
	p.yieldsN.Add(uint64(s.yielded))
	if s.parked {
		p.parks.Add(1)
		if s.budget > 0 {
			p.spinNS.Add(min(elapsed, s.budget))
		}
		if p.mode == Adaptive {
			// Spinning did not pay: halve the budget.
			b := p.budget.Load()
			p.budget.CompareAndSwap(b, max(b/2, minSpin))
		}
		return
	}
	p.hits.Add(1)
	p.spinNS.Add(elapsed)
	if p.mode == Adaptive {
		// Spinning paid: make sure the budget covers twice what this wait needed.
		want := min(max(2*elapsed, 2*int64(time.Microsecond)), p.maxSpin)
		if b := p.budget.Load(); b < want {
			p.budget.CompareAndSwap(b, want)
		}
	}
}

// yield gives up the CPU: first to other goroutines of this process, then to other
// processes (sched_yield), which is what matters when ranks are processes.
func yield(i int) {
	if i&1 == 1 {
		runtime.Gosched()
		return
	}
	osYield()
}

// Wait polls ready under the policy until it returns true, parking on ev when the policy
// says so. ev must be set by whoever makes ready true. It returns ctx's error if ctx ends
// first.
func (p *Poller) Wait(ctx context.Context, ev *Event, ready func() bool) error {
	if ready() {
		return nil
	}
	s := p.Begin()
	for !ready() {
		if s.Idle() {
			err := ev.Park(ctx, ready)
			s.End()
			return err
		}
		if s.n&255 == 0 && ctx.Err() != nil {
			s.End()
			return ctx.Err()
		}
	}
	s.End()
	return nil
}

// Event is a one-shot flag with a single waiter that can spin on it or park until it is
// set. Reset makes it reusable, so an Event lives inside pooled request structs and waiting
// on one allocates nothing.
type Event struct {
	state  atomic.Uint32 // 1 once set
	parked atomic.Uint32 // 1 while a waiter sleeps
	ch     chan struct{}
}

const parkedChan = 1

// Init prepares e; call it once before first use.
func (e *Event) Init() {
	if e.ch == nil {
		e.ch = make(chan struct{}, 1)
	}
}

// Set marks the event and wakes a parked waiter. It reports whether it woke one, so that
// a spinning completer (a socket reader) can hand its CPU to the waiter (runtime.Gosched):
// the woken goroutine is queued on the completer's P and would otherwise wait for it.
func (e *Event) Set() (woke bool) {
	e.state.Store(1)
	switch e.parked.Load() {
	case parkedChan:
		select {
		case e.ch <- struct{}{}:
			return true
		default:
		}
	}
	return false
}

// IsSet reports whether Set was called since the last Reset.
func (e *Event) IsSet() bool { return e.state.Load() != 0 }

// Reset clears the event for reuse. No waiter may be parked on it.
func (e *Event) Reset() {
	e.state.Store(0)
	e.parked.Store(0)
	select {
	case <-e.ch:
	default:
	}
}

// Kick wakes a parked waiter without setting the event, so that it re-checks its
// condition (for conditions other than the event itself).
func (e *Event) Kick() {
	switch e.parked.Load() {
	case parkedChan:
		select {
		case e.ch <- struct{}{}:
		default:
		}
	}
}

// WaitSet blocks until the event is set or ctx ends (Park on the event itself, without
// a condition to pass).
func (e *Event) WaitSet(ctx context.Context) error {
	for {
		e.parked.Store(parkedChan)
		if e.state.Load() != 0 {
			e.parked.Store(0)
			return nil
		}
		select {
		case <-e.ch:
		case <-ctx.Done():
			e.parked.Store(0)
			if e.state.Load() != 0 {
				return nil
			}
			return ctx.Err()
		}
	}
}

// Park blocks until ready() is true (re-checked after every wake-up) or ctx ends.
func (e *Event) Park(ctx context.Context, ready func() bool) error {
	for {
		e.parked.Store(parkedChan)
		if ready() {
			e.parked.Store(0)
			return nil
		}
		select {
		case <-e.ch:
		case <-ctx.Done():
			e.parked.Store(0)
			if ready() {
				return nil
			}
			return ctx.Err()
		}
	}
}

// LocalRanks guesses how many ranks share this host from the launcher's environment
// (MOEX_LOCAL_SIZE, LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE);
// 1 when none is set.
func LocalRanks() int {
	for _, k := range []string{"MOEX_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"} {
		if n, err := strconv.Atoi(os.Getenv(k)); err == nil && n > 0 {
			return n
		}
	}
	return 1
}

// Oversubscribed reports whether ranks (busy waiters) outnumber the CPUs this process may use.
func Oversubscribed(ranks int) bool { return ranks > runtime.NumCPU() }
