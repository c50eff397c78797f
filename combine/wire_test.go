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

// The bytes the transports carried are the plan's: on P=1..8, in the normal and the
// low-latency modes, every wire type, partial sums and terms, each rank's data-moving
// operation of the dispatch (the AlltoAllv; the exchange) sent each peer exactly the
// block its plan says (combine.NewPlan, made from every rank's routing alone), and so did
// the combine's; the normal mode's counts all-gather (a ring) sent Schedule.Control to
// each of the P-1 others. What is counted is what crossed the transport, not what the
// executors say they sent.
func TestTransportsCarryThePlan(t *testing.T) {
	const experts, k, hid = 12, 3, 40
	for p := 1; p <= 8; p++ {
		pl, err := router.NewPlacement(router.RoundRobin, experts, p)
		require.NoError(t, err)
		tokens := make([]int, p)
		for r := range tokens {
			tokens[r] = (r*5 + 3) % 11 // 0 for some ranks at some P
		}
		rs := routings(p, experts, k, tokens, uint64(100+p))
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
			for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
				for _, back := range []combine.Config{{}, {PartialDType: dtype.BF16}, {SumAtOrigin: true}} {
					cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: wire, Placement: pl, Mode: mode, MaxTokens: 11}
					name := fmt.Sprintf("P=%d/%v/%v/%+v", p, mode, wire, back)
					checkWire(t, name, cfg, back, rs)
				}
			}
		}
	}
}

// checkWire runs one step of rs over counting transports and compares each rank's
// messages with its planned blocks.
func checkWire(t *testing.T, name string, cfg dispatch.Config, ccfg combine.Config, rs []*router.Routing) {
	t.Helper()
	p := len(rs)
	// shared false: the counting transports hide the windows, so nothing is read in place.
	plan, err := combine.NewPlan[float32](cfg, ccfg, rs, false)
	require.NoError(t, err, name)
	counters := make([]*wireCounter, p)
	ccfgLocal := coll.Config{
		Algo: map[coll.OpKind]coll.Algo{coll.OpAllGather: coll.Ring, coll.OpAlltoAllv: coll.Linear},
		Wrap: func(rank int, tr transport.Transport) transport.Transport {
			counters[rank] = &wireCounter{Transport: tr, sent: map[uint32][]int{}}
			return counters[rank]
		},
	}
	errs := onRanks(t, p, ccfgLocal, true, func(c *coll.Comm) error {
		ctx := context.Background()
		me := c.Rank()
		d, cb, err := newPairOf[float32](ctx, c, cfg, ccfg)
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		w := counters[me]
		x := make([]float32, rs[me].T*cfg.Hidden)
		w.take() // what New sent
		out, h, err := d.Dispatch(ctx, x, rs[me])
		if err != nil {
			return err
		}
		dispatched := w.take()
		y := make([]float32, out.Rows()*cfg.Hidden)
		if err := cb.Combine(ctx, h, y, make([]float32, len(x))); err != nil {
			return err
		}
		combined := w.take()
		sc := plan.Schedules[me]
		if err := sameBlocks("dispatch", me, dispatched, sc.Dispatch); err != nil {
			return err
		}
		if err := sameBlocks("combine", me, combined, sc.Combine); err != nil {
			return err
		}
		if cfg.Mode == dispatch.Normal && p > 1 {
			if len(dispatched) != 2 {
				return fmt.Errorf("the dispatch made %d operations, want the counts' all-gather and the AlltoAllv", len(dispatched))
			}
			ring := 0
			for _, n := range dispatched[0] {
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

// sameBlocks compares the bytes the last operation of a stage sent each peer with the
// stage's planned blocks (a rank's own block aside: it never crosses the transport).
func sameBlocks(stage string, me int, ops [][]int, st dispatch.Stage) error {
	p := len(st.Send)
	if p == 1 {
		return nil
	}
	if len(ops) == 0 {
		return fmt.Errorf("%s: nothing sent", stage)
	}
	sent := ops[len(ops)-1]
	want := make([]int, p)
	for q, b := range st.Send {
		if q != me {
			want[q] = b.Total()
		}
	}
	got := slices.Clone(sent)
	got[me] = 0
	if !slices.Equal(got, want) {
		return fmt.Errorf("%s: bytes to each peer %v, the plan's blocks %v", stage, got, want)
	}
	return nil
}
