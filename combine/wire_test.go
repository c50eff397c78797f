package combine_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"
)

// wireCounter is a rank's transport as a test sees it: every message it sends, counted
// by the operation it belongs to (its sequence number) and the peer it goes to. It hides
// the transport's windows and shared areas, so that every byte goes as a message.
type wireCounter struct {
	transport.Transport
	mu   sync.Mutex
	seqs []uint32         // operations, in the order of their first message
	sent map[uint32][]int // per operation, bytes to each peer
}

func (w *wireCounter) Isend(peer int, tag transport.Tag, buf []byte) (transport.Request, error) {
	w.mu.Lock()
	if w.sent[tag.Seq] == nil {
		w.sent[tag.Seq] = make([]int, w.Size())
		w.seqs = append(w.seqs, tag.Seq)
	}
	w.sent[tag.Seq][peer] += len(buf)
	w.mu.Unlock()
	return w.Transport.Isend(peer, tag, buf)
}

// take returns, and forgets, what was sent since the last take: per operation in order,
// bytes to each peer.
func (w *wireCounter) take() [][]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out [][]int
	for _, s := range w.seqs {
		out = append(out, w.sent[s])
	}
	w.seqs, w.sent = nil, map[uint32][]int{}
	return out
}

// The bytes the transports carried are those the routing and the wire formats imply:
// on P=1..8, in the normal, low-latency and Auto modes (Auto's steps low-latency, or
// grown), every wire type, partial sums and terms, each rank's data-moving operation
// of the dispatch (the AlltoAllv; the exchange) sent each peer exactly the block that
// wireFromRouting computes from the routing, the placement and the documented formats
// (dispatch.Format's RowBytes and MetaBytes, combine.Format's Block), not from any
// schedule; so did the combine's, and both equal the plan's blocks. The normal mode's
// counts all-gather (a ring) sent Schedule.Control to each of the P-1 others. What is
// counted is what crossed the transport, not what the executors say they sent.
func TestTransportsCarryThePlan(t *testing.T) {
	const experts, k, hid = 12, 3, 40
	for p := 1; p <= 8; p++ {
		pl, rs, _ := wireRouting(t, p, experts, k, uint64(100+p))
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Auto} {
			for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
				for _, back := range []combine.Config{{}, {PartialDType: dtype.BF16}, {SumAtOrigin: true}} {
					cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: wire, Placement: pl, Mode: mode, MaxTokens: 11}
					if mode == dispatch.Auto && p%2 == 0 {
						cfg.MaxTokens = 4 // some ranks' tokens do not fit: the step grows
					}
					name := fmt.Sprintf("P=%d/%v/%v/%+v", p, mode, wire, back)
					checkWire(t, name, cfg, back, rs)
				}
			}
		}
	}
}

// wireRouting is the routing of the wire tests on p ranks: experts placed round-robin,
// (r*5+3) mod 11 tokens on rank r (none on some ranks at some P), each choosing k.
func wireRouting(t *testing.T, p, experts, k int, seed uint64) (*router.Placement, []*router.Routing, []int) {
	t.Helper()
	pl, err := router.NewPlacement(router.RoundRobin, experts, p)
	require.NoError(t, err)
	tokens := make([]int, p)
	for r := range tokens {
		tokens[r] = (r*5 + 3) % 11
	}
	return pl, routings(p, experts, k, tokens, seed), tokens
}

// checkWire runs one step of rs over counting transports and compares each rank's
// messages with its planned blocks.
func checkWire(t *testing.T, name string, cfg dispatch.Config, ccfg combine.Config, rs []*router.Routing) {
	t.Helper()
	p := len(rs)
	// shared false: the counting transports hide the windows, so nothing is read in place.
	plan, err := combine.NewPlan[float32](cfg, ccfg, rs, false)
	require.NoError(t, err, name)
	algos := map[coll.OpKind]coll.Algo{coll.OpAllGather: coll.Ring, coll.OpAlltoAllv: coll.Linear}
	errs := countedStep(t, cfg, ccfg, rs, algos, noWindows, func(me int, mode dispatch.Mode, ds, cs stageWire) error {
		dispatched, combined := ds.msgs, cs.msgs
		sc := plan.Schedules[me]
		wantD, wantC := wireFromRouting(plan.Format, plan.CombineFormat, cfg.Placement, rs, me, mode)
		if err := sameBytes("dispatch", me, dispatched, wantD, sc.Dispatch); err != nil {
			return err
		}
		if err := sameBytes("combine", me, combined, wantC, sc.Combine); err != nil {
			return err
		}
		if mode == dispatch.Normal && p > 1 {
			// The counts' all-gather and the AlltoAllv, after Auto's low-latency exchange
			// whose headers said a rank's tokens do not fit.
			want := 2
			if cfg.Mode == dispatch.Auto {
				want = 3
			}
			if len(dispatched) != want {
				return fmt.Errorf("the dispatch made %d operations, want %d: the counts' all-gather and the AlltoAllv", len(dispatched), want)
			}
			ring := 0
			for _, n := range dispatched[want-2] {
				ring += n
			}
			if ring != (p-1)*sc.Control {
				return fmt.Errorf("the counts' all-gather sent %d bytes, want %d ranks x %d", ring, p-1, sc.Control)
			}
		}
		return nil
	})
	for r, err := range errs {
		assert.NoError(t, err, "%s: rank %d", name, r)
	}
}

// wireFromRouting is what rank me sends each rank in one step, from the routing and
// the formats alone: in the dispatch, a block per rank of a 32-byte header and the rows
// of me's tokens with a choice there (a token once per rank), each with the metadata of
// its choices there; in the combine, a block per rank of a header and the answers to
// the rows that rank sent me.
func wireFromRouting(f dispatch.Format, cf combine.Format, pl *router.Placement, rs []*router.Routing, me int, mode dispatch.Mode) (dispatched, combined []int) {
	const header = 32
	p := len(rs)
	rows, choices := routed(pl, rs)
	dispatched, combined = make([]int, p), make([]int, p)
	for q := 0; q < p; q++ {
		dispatched[q] = header
		combined[q] = header + cf.Block(rows[q][me], choices[q][me])
	}
	for _, on := range choicesOf(pl, rs[me], me, p) {
		for q, m := range on {
			switch {
			case m == 0:
			case mode == dispatch.Normal:
				dispatched[q] += f.RowBytes(m)
			default:
				dispatched[q] += f.MetaBytes(m) + f.Payload + 4*f.Scales
			}
		}
	}
	return dispatched, combined
}

// routed is, from the routing alone, rows[o][q]: the rows rank o sends rank q (a token
// once per rank with a choice there), and choices[o][q]: their choices there.
func routed(pl *router.Placement, rs []*router.Routing) (rows, choices [][]int) {
	p := len(rs)
	rows, choices = make([][]int, p), make([][]int, p)
	for o, r := range rs {
		rows[o], choices[o] = make([]int, p), make([]int, p)
		for _, on := range choicesOf(pl, r, o, p) {
			for q, m := range on {
				if m > 0 {
					rows[o][q]++
					choices[o][q] += m
				}
			}
		}
	}
	return rows, choices
}

// choicesOf is, for each of rank o's tokens, its choices on each of p ranks.
func choicesOf(pl *router.Placement, r *router.Routing, o, p int) [][]int {
	out := make([][]int, r.T)
	for t := range out {
		out[t] = make([]int, p)
		for j := 0; j < r.K; j++ {
			if e := r.Experts[t*r.K+j]; e >= 0 {
				out[t][pl.RankOf(int(e), o, t)]++
			}
		}
	}
	return out
}

// sameBytes checks that one operation of a stage (the data-moving one; Auto's grown
// combine makes its new exchange's agreement in the same call) sent each peer the bytes
// of want (from wireFromRouting), and that the stage's planned blocks say the same (a
// rank's own block aside: it never crosses the transport).
func sameBytes(stage string, me int, ops [][]int, want []int, st dispatch.Stage) error {
	p := len(st.Send)
	if p == 1 {
		return nil
	}
	if len(ops) == 0 {
		return fmt.Errorf("%s: nothing sent", stage)
	}
	planned := make([]int, p)
	want = slices.Clone(want)
	for q, b := range st.Send {
		planned[q] = b.Total()
	}
	want[me], planned[me] = 0, 0
	found := false
	for _, op := range ops {
		got := slices.Clone(op)
		got[me] = 0
		found = found || slices.Equal(got, want)
	}
	if !found {
		return fmt.Errorf("%s: bytes to each peer %v (operation by operation), the routing and the formats say %v", stage, ops, want)
	}
	if !slices.Equal(planned, want) {
		return fmt.Errorf("%s: the plan's blocks %v, the routing and the formats say %v", stage, planned, want)
	}
	return nil
}

// The gathered mode's all-gathers and reduce-scatter relay blocks along a ring, so a
// rank's bytes to a peer are not its own block; summed over every rank they are: each
// rank's tokens (their routing, rows and scales: dispatch.Format's GatheredMeta, Payload
// and Scales) cross P-1 links in the dispatch, and each rank's tokens' partial sums
// (combine.Format's Row) P-1 links in the combine, beside the control all-gathers: the
// counts before the dispatch (Schedule.Control a rank, each to P-1 others) and the three
// status words (code, fingerprint, generation) beside the reduce-scatter. Counted at the
// transports, computed from the routing and the formats.
func TestGatheredCarriesEveryToken(t *testing.T) {
	const experts, k, hid = 12, 3, 40
	for p := 2; p <= 8; p++ {
		pl, rs, tokens := wireRouting(t, p, experts, k, uint64(200+p))
		for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3} {
			for _, back := range []combine.Config{{}, {PartialDType: dtype.BF16}} {
				cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: wire, Placement: pl, Mode: dispatch.Gathered}
				plan, err := combine.NewPlan[float32](cfg, back, rs, false)
				require.NoError(t, err)
				f, cf := plan.Format, plan.CombineFormat
				all := 0
				for _, n := range tokens {
					all += n
				}
				wantD := p*(p-1)*plan.Schedules[0].Control + (p-1)*all*(f.GatheredMeta()+f.Payload+4*f.Scales)
				wantC := p*(p-1)*3*8 + (p-1)*all*cf.Row
				gotD, gotC := gatheredWire(t, cfg, back, rs)
				name := fmt.Sprintf("P=%d/%v/%+v", p, wire, back)
				assert.Equal(t, wantD, gotD, "%s: the dispatch's bytes over every link", name)
				assert.Equal(t, wantC, gotC, "%s: the combine's", name)
			}
		}
	}
}

// gatheredWire runs one gathered step of rs over counting transports (the all-gathers and
// the reduce-scatter as rings) and returns the bytes every rank sent, summed, in the
// dispatch and in the combine.
func gatheredWire(t *testing.T, cfg dispatch.Config, ccfg combine.Config, rs []*router.Routing) (dispatched, combined int) {
	t.Helper()
	sums := make([][2]int, len(rs))
	ring := map[coll.OpKind]coll.Algo{coll.OpAllGather: coll.Ring, coll.OpAllGatherv: coll.Ring, coll.OpReduceScatterv: coll.Ring}
	errs := countedStep(t, cfg, ccfg, rs, ring, noWindows, func(me int, _ dispatch.Mode, d, c stageWire) error {
		sums[me] = [2]int{total(d.msgs), total(c.msgs)}
		return nil
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
	for _, s := range sums {
		dispatched += s[0]
		combined += s[1]
	}
	return dispatched, combined
}

// stageWire is what a rank moved in one stage of a step: msgs, per operation in order,
// the bytes of its messages to each peer; puts, per one-sided exchange in order, the
// bytes of the block it put into each peer's window (its record aside); gets, the bytes
// it read from peers' windows; and the stage's Stats.
type stageWire struct {
	msgs, puts [][]int
	gets       int
	d          dispatch.Stats
	c          combine.Stats
}

// windowsAs is how a counted step's ranks reach each other's windows.
type windowsAs int

const (
	noWindows       windowsAs = iota // none: every byte is a message
	oneSidedWindows                  // by puts, gets and signals (transporttest.NewRMA), counted
	mappedWindows                    // by loads and stores (inproc's own windows and spans)
)

// mapped counts a rank's messages and keeps its transport's windows and spans.
type mapped struct {
	*wireCounter
	st transport.SpanTransport
}

func (m mapped) NewWindow(size int) (transport.Window, []byte, error) { return m.st.NewWindow(size) }
func (m mapped) NewSpanWindow(size int) (transport.SpanWindow, []byte, error) {
	return m.st.NewSpanWindow(size)
}

// countedStep runs one step of rs (a dispatch of zeros and its combine) on ranks whose
// transports count every message, with the collectives' algorithms algos, and hands
// check, on each rank, the mode the step ran in and what the rank moved in the dispatch
// and in the combine. With oneSidedWindows the ranks' windows are one-sided
// (transporttest.NewRMA, as ucx's are), so every byte into a peer's window is a counted
// put or get; with mappedWindows they are stored into, and read, uncounted.
func countedStep(t *testing.T, cfg dispatch.Config, ccfg combine.Config, rs []*router.Routing, algos map[coll.OpKind]coll.Algo, windows windowsAs,
	check func(me int, mode dispatch.Mode, dispatched, combined stageWire) error) []error {
	t.Helper()
	counters := make([]*wireCounter, len(rs))
	rmas := make([]*transporttest.RMA, len(rs))
	wrap := func(rank int, tr transport.Transport) transport.Transport {
		counters[rank] = &wireCounter{Transport: tr, sent: map[uint32][]int{}}
		switch windows {
		case oneSidedWindows:
			rmas[rank] = transporttest.NewRMA(counters[rank], tr.(transport.WindowTransport))
			return rmas[rank]
		case mappedWindows:
			return mapped{counters[rank], tr.(transport.SpanTransport)}
		}
		return counters[rank]
	}
	return onRanks(t, len(rs), coll.Config{Algo: algos, Wrap: wrap}, true, func(c *coll.Comm) error {
		ctx := context.Background()
		me := c.Rank()
		d, cb, err := newPairOf[float32](ctx, c, cfg, ccfg)
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		take := func() (st stageWire, err error) {
			st.msgs = counters[me].take()
			if windows == oneSidedWindows {
				st.puts, st.gets, err = oneSided(rmas[me].Take(), len(rs))
			}
			return st, err
		}
		x := make([]float32, rs[me].T*cfg.Hidden)
		if _, err := take(); err != nil { // what New moved
			return err
		}
		out, h, err := d.Dispatch(ctx, x, rs[me])
		if err != nil {
			return err
		}
		dispatched, err := take()
		if err != nil {
			return err
		}
		dispatched.d = d.Stats()
		y := make([]float32, out.Rows()*cfg.Hidden)
		if err := cb.Combine(ctx, h, y, make([]float32, len(x))); err != nil {
			return err
		}
		combined, err := take()
		if err != nil {
			return err
		}
		combined.c = cb.Stats()
		return check(me, d.Stats().Mode, dispatched, combined)
	})
}

// total is every byte of every operation.
func total(ops [][]int) int {
	n := 0
	for _, op := range ops {
		for _, b := range op {
			n += b
		}
	}
	return n
}
