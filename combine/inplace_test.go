package combine_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// Where every rank can read every rank's memory the low-latency combine reads the expert
// outputs in place; Buffer says where they go, and is nil wherever the combine does not.
func TestInPlaceBuffer(t *testing.T) {
	s := scenario{p: 3, hid: 16, k: 2, experts: 6, tokens: []int{5, 0, 7}, seed: 3, maxTokens: 8}
	pl := placement(t, "contiguous", s.experts, s.p)
	cases := []struct {
		name    string
		mode    dispatch.Mode
		partial bool
		ccfg    coll.Config
		inPlace bool
	}{
		{"low-latency", dispatch.LowLatency, false, coll.Config{}, true},
		{"send-partials", dispatch.LowLatency, true, coll.Config{}, false},
		{"no-windows", dispatch.LowLatency, false, coll.Config{NoWindows: true}, false},
		{"normal", dispatch.Normal, false, coll.Config{}, false},
		{"gathered", dispatch.Gathered, false, coll.Config{}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			runRanks(t, s.p, tc.ccfg, func(c *coll.Comm) error {
				ctx := context.Background()
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: tc.mode, MaxTokens: s.maxTokens, InFlight: 1}, combine.Config{SendPartials: tc.partial})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				if cb.InPlace() != tc.inPlace {
					return fmt.Errorf("InPlace %v, want %v", cb.InPlace(), tc.inPlace)
				}
				r, x := s.routing(c.Rank())
				out, h, err := d.Dispatch(ctx, x, r)
				if err != nil {
					return err
				}
				b := cb.Buffer(h)
				switch {
				case !tc.inPlace && b != nil:
					return fmt.Errorf("Buffer of %d values where the combine does not read in place", len(b))
				case tc.inPlace && len(b) != out.Rows()*s.hid:
					return fmt.Errorf("Buffer of %d values for %d rows of %d", len(b), out.Rows(), s.hid)
				}
				y := make([]float32, out.Rows()*s.hid)
				if b != nil {
					y = b
				}
				res := make([]float32, len(x))
				if err := cb.Combine(ctx, h, y, res); err != nil {
					return err
				}
				// The next dispatch into the same buffers (InFlight 1) makes h stale; while it
				// is under way its Output has no buffer, then the new dispatch's.
				pd, err := d.Start(ctx, x, r)
				if err != nil {
					return err
				}
				if b := cb.Buffer(out.Handle()); b != nil {
					return fmt.Errorf("Buffer of an Output whose buffers a dispatch under way reuses: %d values", len(b))
				}
				out2, h2, err := pd.Wait(ctx)
				if err != nil {
					return err
				}
				if b := cb.Buffer(h); b != nil {
					return fmt.Errorf("Buffer of a stale handle: %d values", len(b))
				}
				if out2 != out || out.Handle() != h2 || (tc.inPlace && len(cb.Buffer(out.Handle())) != out2.Rows()*s.hid) {
					return fmt.Errorf("the Output's handle is not the new dispatch's (Buffer of %d values)", len(cb.Buffer(out.Handle())))
				}
				return nil
			})
		})
	}
}

// Many steps back to back, ranks out of step with one another, the expert outputs
// written where the combine reads them: a rank never writes the outputs of a dispatch
// while another still reads the ones before from the same memory (InFlight 1 reuses it
// every step; -race watches the inproc windows), and every step's sums are right.
func TestInPlaceReuse(t *testing.T) {
	s := scenario{p: 4, hid: 32, k: 3, experts: 8, tokens: []int{9, 3, 12, 6}, seed: 5, maxTokens: 12}
	pl := placement(t, "roundrobin", s.experts, s.p)
	for _, inFlight := range []int{1, 2} {
		t.Run(fmt.Sprintf("InFlight=%d", inFlight), func(t *testing.T) {
			runRanks(t, s.p, coll.Config{}, func(c *coll.Comm) error {
				ctx := context.Background()
				me := c.Rank()
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: s.maxTokens, InFlight: inFlight}, combine.Config{})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				if !cb.InPlace() {
					return errors.New("the combine does not read in place over inproc")
				}
				r, x := s.routing(me)
				rng := rand.New(rand.NewPCG(uint64(me), 1))
				res := make([]float32, len(x))
				for step := 0; step < 30; step++ {
					out, h, err := d.Dispatch(ctx, x, r)
					if err != nil {
						return err
					}
					time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
					y := cb.Buffer(h)
					runExperts(y, out, s.hid, float32(step))
					if err := cb.Combine(ctx, h, y, res); err != nil {
						return err
					}
					if err := checkSums(res, x, r, s, float32(step)); err != nil {
						return fmt.Errorf("step %d: %w", step, err)
					}
				}
				return nil
			})
		})
	}
}

// runExperts writes into y each entry's output, expert(e, x) + off, zeros for padding.
func runExperts(y []float32, out *dispatch.Output[float32], hid int, off float32) {
	for j := 0; j < out.Rows(); j++ {
		row := y[j*hid : (j+1)*hid]
		if out.Origin[j] < 0 {
			clear(row)
			continue
		}
		for k, v := range out.Entry(j) {
			row[k] = expert(out.Expert[j], v) + off
		}
	}
}

// checkSums compares each token's combined row with its terms expert(e, x) + off summed
// in float64, within float32 rounding of their magnitudes.
func checkSums(got, x []float32, r *router.Routing, s scenario, off float32) error {
	for tok := 0; tok < r.T; tok++ {
		for k := 0; k < s.hid; k++ {
			want, mag := 0.0, 0.0
			for j := 0; j < s.k; j++ {
				e := r.Experts[tok*s.k+j]
				if e < 0 {
					continue
				}
				v := float64(r.Weights[tok*s.k+j]) * float64(expert(e, x[tok*s.hid+k])+off)
				want += v
				mag += math.Abs(v)
			}
			if g := float64(got[tok*s.hid+k]); math.Abs(g-want) > 1e-5*mag+1e-6 {
				return fmt.Errorf("token %d element %d: %v, want %v", tok, k, g, want)
			}
		}
	}
	return nil
}

// CombineRows takes each incoming row's outputs summed already, in every mode: in place
// the origins read the summed rows where they are.
func TestCombineRows(t *testing.T) {
	s := scenario{p: 3, hid: 24, k: 3, experts: 9, tokens: []int{10, 4, 0}, seed: 8, maxTokens: 10}
	pl := placement(t, "replicated", s.experts, s.p)
	type run struct {
		mode    dispatch.Mode
		partial bool
	}
	for _, ru := range []run{{dispatch.Normal, false}, {dispatch.LowLatency, true}, {dispatch.LowLatency, false}} {
		t.Run(fmt.Sprintf("%v/partials=%v", ru.mode, ru.partial), func(t *testing.T) {
			runRanks(t, s.p, coll.Config{}, func(c *coll.Comm) error {
				ctx := context.Background()
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: ru.mode, MaxTokens: s.maxTokens}, combine.Config{SendPartials: ru.partial})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				r, x := s.routing(c.Rank())
				for round := 0; round < 3; round++ {
					out, h, err := d.Dispatch(ctx, x, r)
					if err != nil {
						return err
					}
					// Each incoming row: its experts' outputs, weighted and summed here.
					summed := make([]float32, h.IncomingRows()*s.hid)
					for i := 0; i < h.IncomingRows(); i++ {
						entries, ws := h.Contributions(i)
						for n, e := range entries {
							for k, v := range out.Entry(int(e)) {
								summed[i*s.hid+k] += ws[n] * (expert(out.Expert[e], v) + float32(round))
							}
						}
					}
					if b := cb.Buffer(h); b != nil && round == 1 { // in place, as the experts would
						copy(b, summed)
						summed = b[:len(summed)]
					}
					res := make([]float32, len(x))
					if err := cb.CombineRows(ctx, h, summed, res); err != nil {
						return err
					}
					if err := checkSums(res, x, r, s, float32(round)); err != nil {
						return fmt.Errorf("round %d: %w", round, err)
					}
				}
				return nil
			})
		})
	}
}

// A rank whose combine call is bad makes every rank fail in the same call, in place as
// with partial sums, and the next step works.
func TestInPlaceBadCall(t *testing.T) {
	s := scenario{p: 3, hid: 8, k: 2, experts: 6, tokens: []int{4, 5, 6}, seed: 2, maxTokens: 6}
	pl := placement(t, "contiguous", s.experts, s.p)
	errs := onRanks(t, s.p, coll.Config{}, false, func(c *coll.Comm) error {
		ctx := context.Background()
		d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: s.maxTokens}, combine.Config{})
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		r, x := s.routing(c.Rank())
		_, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		y := cb.Buffer(h)
		res := make([]float32, len(x))
		if c.Rank() == 1 {
			res = res[1:] // the wrong length
		}
		err = cb.Combine(ctx, h, y, res)
		var pe *dispatch.PeerInputError
		switch {
		case c.Rank() == 1 && !errors.Is(err, combine.ErrInput):
			return fmt.Errorf("the bad rank got %v, want combine.ErrInput", err)
		case c.Rank() != 1 && (!errors.As(err, &pe) || pe.Rank != 1):
			return fmt.Errorf("got %v, want a PeerInputError naming rank 1", err)
		}
		// The communicator and the combiner still work.
		out, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		y = cb.Buffer(h)
		for j := 0; j < out.Rows(); j++ {
			copy(y[j*s.hid:(j+1)*s.hid], out.Entry(j))
		}
		res = make([]float32, len(x))
		if err := cb.Combine(ctx, h, y, res); err != nil {
			return err
		}
		for tok := 0; tok < r.T; tok++ {
			w := float32(0)
			for j := 0; j < s.k; j++ {
				w += r.Weights[tok*s.k+j]
			}
			for k := 0; k < s.hid; k++ {
				if want := w * x[tok*s.hid+k]; math.Abs(float64(res[tok*s.hid+k]-want)) > 1e-5*math.Abs(float64(want))+1e-6 {
					return fmt.Errorf("token %d element %d: %v, want %v", tok, k, res[tok*s.hid+k], want)
				}
			}
		}
		return nil
	})
	for q, err := range errs {
		assert.NoError(t, err, "rank %d", q)
	}
	require.Len(t, errs, s.p)
}

// The low-latency dispatch writes each rank's tokens once into its own staging and the
// experts read them there. Its staging is written again only once the combine of the
// dispatch that last used it has completed: with ranks out of step and new activations
// every step, every expert sees each token as its origin sent it in that step. A step
// without a combine makes the next dispatch into its slot push its rows (the experts
// may still read the staging), and the one after it is in place again.
func TestDispatchInPlaceReuse(t *testing.T) {
	// The staging lives in memory files (inproc) or /dev/shm: none is left open.
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		require.NoError(t, err)
		return len(ents)
	}
	before := fds()
	t.Cleanup(func() { assert.Equal(t, before, fds(), "file descriptors left open") })
	s := scenario{p: 4, hid: 24, k: 3, experts: 8, tokens: []int{9, 3, 12, 0}, seed: 6, maxTokens: 12}
	pl := placement(t, "roundrobin", s.experts, s.p)
	for _, inFlight := range []int{1, 2} {
		t.Run(fmt.Sprintf("InFlight=%d", inFlight), func(t *testing.T) {
			runRanks(t, s.p, coll.Config{}, func(c *coll.Comm) error {
				ctx := context.Background()
				me := c.Rank()
				d, cb, err := newPair(ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: s.maxTokens, InFlight: inFlight}, combine.Config{})
				if err != nil {
					return err
				}
				defer d.Close()
				defer cb.Close()
				if !d.RowsInPlace() {
					return errors.New("the dispatch does not read the rows in place over inproc")
				}
				// Every rank's activations at a step: its scenario's, plus the step.
				xs := make([][]float32, s.p)
				r, _ := s.routing(me)
				for q := range xs {
					_, xs[q] = s.routing(q)
				}
				at := func(q, step int) []float32 {
					x := slices.Clone(xs[q])
					for i := range x {
						x[i] += float32(step * 1000)
					}
					return x
				}
				rng := rand.New(rand.NewPCG(uint64(me), 2))
				res := make([]float32, len(xs[me]))
				skipped := -1 // the last step without a combine
				for step := 0; step < 30; step++ {
					// In place unless the slot's last dispatch had no combine; then Buffer
					// is where the tokens may go (every other step they are written there).
					wantInPlace := skipped < 0 || step-skipped != inFlight
					x := at(me, step)
					if buf := d.Buffer(); (buf != nil) != wantInPlace {
						return fmt.Errorf("step %d: Buffer %d values, want one: %v", step, len(buf), wantInPlace)
					} else if buf != nil && step%2 == 0 {
						x = buf[:copy(buf, x)]
					}
					out, h, err := d.Dispatch(ctx, x, r)
					if err != nil {
						return err
					}
					if got := d.Stats().InPlace; got != wantInPlace && s.tokens[me] > 0 {
						return fmt.Errorf("step %d: in place %v, want %v", step, got, wantInPlace)
					}
					time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
					for j := 0; j < out.Rows(); j++ {
						if out.Origin[j] < 0 {
							continue
						}
						q, src := int(out.Origin[j]), int(out.Source[j])
						want := at(q, step)[src*s.hid : (src+1)*s.hid]
						if !slices.Equal(out.Entry(j), want) {
							return fmt.Errorf("step %d: entry %d (rank %d's token %d): %v, want %v", step, j, q, src, out.Entry(j), want)
						}
					}
					if step%7 == 3 {
						skipped = step // no combine: the experts of this step may read on
						continue
					}
					y := cb.Buffer(h)
					runExperts(y, out, s.hid, 0)
					if err := cb.Combine(ctx, h, y, res); err != nil {
						return err
					}
					if err := checkSums(res, at(me, step), r, s, 0); err != nil {
						return fmt.Errorf("step %d: %w", step, err)
					}
				}
				return nil
			})
		})
	}
}
