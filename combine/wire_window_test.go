package combine_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport/transporttest"
)

// Where windows are one-sided (ucx's: puts, a fence and a signal; here emulated over
// inproc's windows and counted at the transport), the low-latency mode's blocks are the
// bytes put into each peer's window: on P=2..8, every wire type, partial sums and terms,
// each rank's dispatch put into each peer's window exactly the block wireFromRouting
// computes from the routing and the formats, and so did its combine; nothing was read
// from a peer's window (the plan reads nothing in place: one-sided windows are not
// addressed), and no message carried data. The Auto mode's steps whose tokens fit do the
// same (where they do not, Auto runs the normal mode's messages: the rows are not read
// in place, so it does not grow; TestTransportsCarryThePlan counts those).
func TestOneSidedCarriesThePlan(t *testing.T) {
	const experts, k, hid = 12, 3, 40
	for p := 2; p <= 8; p++ {
		pl, rs, _ := wireRouting(t, p, experts, k, uint64(300+p))
		for _, mode := range []dispatch.Mode{dispatch.LowLatency, dispatch.Auto} {
			for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
				for _, back := range []combine.Config{{}, {PartialDType: dtype.BF16}, {SumAtOrigin: true}} {
					cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: wire, Placement: pl, Mode: mode, MaxTokens: 11}
					name := fmt.Sprintf("P=%d/%v/%v/%+v", p, mode, wire, back)
					checkOneSided(t, name, cfg, back, rs)
				}
			}
		}
	}
}

// checkOneSided runs one step of rs over one-sided windows and compares each rank's
// puts with the blocks the routing implies and with its planned blocks.
func checkOneSided(t *testing.T, name string, cfg dispatch.Config, ccfg combine.Config, rs []*router.Routing) {
	t.Helper()
	plan, err := combine.NewPlan[float32](cfg, ccfg, rs, false)
	require.NoError(t, err, name)
	errs := countedStep(t, cfg, ccfg, rs, nil, oneSidedWindows, func(me int, mode dispatch.Mode, ds, cs stageWire) error {
		if mode != dispatch.LowLatency {
			return fmt.Errorf("the step ran in the %v mode", mode)
		}
		sc := plan.Schedules[me]
		wantD, wantC := wireFromRouting(plan.Format, plan.CombineFormat, cfg.Placement, rs, me, mode)
		if err := sameBytes("dispatch's puts", me, ds.puts, wantD, sc.Dispatch); err != nil {
			return err
		}
		if err := sameBytes("combine's puts", me, cs.puts, wantC, sc.Combine); err != nil {
			return err
		}
		if ds.gets+cs.gets != 0 {
			return fmt.Errorf("%d bytes read from peers' windows, the plan reads none", ds.gets+cs.gets)
		}
		if cfg.Mode == dispatch.LowLatency {
			if n := total(ds.msgs) + total(cs.msgs); n != 0 {
				return fmt.Errorf("%d bytes of messages beside the puts (dispatch %v, combine %v)", n, ds.msgs, cs.msgs)
			}
		}
		return nil
	})
	for r, err := range errs {
		assert.NoError(t, err, "%s: rank %d", name, r)
	}
}

// oneSided reads a rank's one-sided operations as coll's exchange documents them: a
// block for a peer is put into its window field by field, then its record (the put
// before the fence), then the record's epoch is signalled. It returns, per exchange,
// the block's bytes to each of p peers (every exchange sends every peer a block), and
// the bytes got. A fence after no put, or a block whose signal goes to another peer, is
// an error: the protocol was not followed.
func oneSided(ops []transporttest.RMAOp, p int) (puts [][]int, gets int, err error) {
	blocks := make([][]int, p) // per peer, each block's bytes
	pend := make([]int, p)
	last := -1 // the last put since the last fence
	sealed := -1
	for i, op := range ops {
		switch op.Kind {
		case transporttest.OpPut:
			if last >= 0 {
				pend[ops[last].Peer] += ops[last].Bytes
			}
			last = i
		case transporttest.OpGet:
			gets += op.Bytes
		case transporttest.OpFence:
			if last < 0 {
				return nil, 0, fmt.Errorf("operation %d: a fence after no put", i)
			}
			q := ops[last].Peer // the record's put: the block for q is complete
			blocks[q] = append(blocks[q], pend[q])
			pend[q], last, sealed = 0, -1, q
		case transporttest.OpSignal:
			if sealed >= 0 && op.Peer != sealed {
				return nil, 0, fmt.Errorf("operation %d: the record of rank %d's block signalled to rank %d", i, sealed, op.Peer)
			}
			sealed = -1
		}
	}
	if last >= 0 {
		return nil, 0, fmt.Errorf("puts to rank %d without a fence after them", ops[last].Peer)
	}
	for q, bs := range blocks {
		for len(puts) < len(bs) {
			puts = append(puts, make([]int, p))
		}
		for e, n := range bs {
			puts[e][q] = n
		}
	}
	return puts, gets, nil
}

// Where ranks map each other's memory (one host: inproc here, shm alike), the
// low-latency mode reads in place: a rank writes its tokens once into its own staging,
// and the experts' ranks read them there; the combine's origins read the experts'
// outputs where the experts wrote them. Loads and stores do not cross a transport, so
// what is counted here is what the engine reports (Stats), against what the routing and
// the formats imply: on P=2..8, every wire type, sums and terms, each rank received
// (read in place) from each origin exactly the block wireFromRouting computes, sent its
// own, read in the combine one output row of Hidden values per choice of its tokens
// on another rank, and no message carried data. So do the Auto mode's steps that grow in
// place (their new buffers' agreement aside).
func TestInPlaceReadsThePlan(t *testing.T) {
	const experts, k, hid = 12, 3, 40
	for p := 2; p <= 8; p++ {
		pl, rs, _ := wireRouting(t, p, experts, k, uint64(400+p))
		_, choices := routed(pl, rs)
		for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
			for _, back := range []combine.Config{{}, {SumAtOrigin: true}} {
				cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: wire, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: 11}
				if p%2 == 0 && back.SumAtOrigin {
					// Auto, where some ranks' tokens do not fit: the step grows in place.
					cfg.Mode, cfg.MaxTokens = dispatch.Auto, 4
				}
				name := fmt.Sprintf("P=%d/%v/%v/%+v", p, cfg.Mode, wire, back)
				plan, err := combine.NewPlan[float32](cfg, back, rs, true)
				require.NoError(t, err, name)
				wants := make([][]int, p) // wants[o][q]: o's block for q
				for o := range wants {
					wants[o], _ = wireFromRouting(plan.Format, plan.CombineFormat, pl, rs, o, dispatch.LowLatency)
				}
				errs := countedStep(t, cfg, back, rs, nil, mappedWindows, func(me int, mode dispatch.Mode, ds, cs stageWire) error {
					if mode != dispatch.LowLatency {
						return fmt.Errorf("the step ran in the %v mode", mode)
					}
					sent, recv, read := 0, 0, 0
					for q := 0; q < p; q++ {
						if q != me {
							sent += wants[me][q]
							recv += wants[q][me]
							read += choices[me][q] * hid * 4
						}
					}
					switch {
					case !ds.d.InPlace || !cs.c.InPlace:
						return fmt.Errorf("in place: the dispatch %v, the combine %v", ds.d.InPlace, cs.c.InPlace)
					case ds.d.BytesSent != sent || ds.d.BytesReceived != recv:
						return fmt.Errorf("the dispatch sent %d and received %d bytes, the routing and the formats say %d and %d", ds.d.BytesSent, ds.d.BytesReceived, sent, recv)
					case cs.c.BytesRead != read:
						return fmt.Errorf("the combine read %d bytes of peers' outputs, the routing says %d", cs.c.BytesRead, read)
					case cs.c.BytesSent != 32*(p-1) || cs.c.BytesReceived != 32*(p-1):
						return fmt.Errorf("the combine sent %d and received %d bytes beside the reads, want a 32-byte header to each of %d peers", cs.c.BytesSent, cs.c.BytesReceived, p-1)
					case cfg.Mode == dispatch.LowLatency && total(ds.msgs)+total(cs.msgs) != 0:
						return fmt.Errorf("messages carried data: dispatch %v, combine %v", ds.msgs, cs.msgs)
					}
					return nil
				})
				for r, err := range errs {
					assert.NoError(t, err, "%s: rank %d", name, r)
				}
			}
		}
	}
}
