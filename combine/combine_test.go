package combine_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/internal/race"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport/shm"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// scenario: every rank's tokens and routing, built from a seed the same way on every rank.
type scenario struct {
	p, hid, k, experts int
	tokens             []int // per rank
	dropEvery          int   // drop one choice in this many (0: none)
	skew               bool  // everything to expert 0 and 1
	seed               uint64
}

func (s scenario) routing(rank int) (*router.Routing, []float32) {
	rng := rand.New(rand.NewPCG(s.seed, uint64(rank)))
	t := s.tokens[rank]
	r := &router.Routing{T: t, K: s.k, E: s.experts, Experts: make([]int32, t*s.k), Weights: make([]float32, t*s.k)}
	dyadic := []float32{0.5, 0.25, 0.125, 1, 0.75}
	for i := 0; i < t; i++ {
		perm := rng.Perm(s.experts)
		for j := 0; j < s.k; j++ {
			e := perm[j]
			if s.skew {
				e = j % 2
				if j >= 2 {
					e = perm[j]
				}
			}
			r.Experts[i*s.k+j] = int32(e)
			r.Weights[i*s.k+j] = dyadic[rng.IntN(len(dyadic))]
			if s.dropEvery > 0 && rng.IntN(s.dropEvery) == 0 {
				r.Experts[i*s.k+j], r.Weights[i*s.k+j] = -1, 0
			}
		}
		if s.skew { // keep choices distinct
			seen := map[int32]bool{}
			for j := 0; j < s.k; j++ {
				e := r.Experts[i*s.k+j]
				for seen[e] {
					e = (e + 1) % int32(s.experts)
				}
				seen[e] = true
				r.Experts[i*s.k+j] = e
			}
		}
	}
	x := make([]float32, t*s.hid)
	for i := range x {
		x[i] = float32(rng.IntN(9) - 4) // small integers: every sum below is exact
	}
	return r, x
}

// expert is the test's expert function: expert e multiplies by e+1.
func expert(e int32, x float32) float32 { return x * float32(e+1) }

func runRanks(t *testing.T, p int, f func(c *coll.Comm) error) {
	t.Helper()
	cs, err := coll.Local(p, coll.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	errs := make([]error, p)
	var wg sync.WaitGroup
	for i, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(c)
			if errs[i] != nil {
				c.Abort(errs[i].Error()) // the others must not wait for this rank
			}
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}

func placement(t *testing.T, kind string, experts, p int) *router.Placement {
	t.Helper()
	var pl *router.Placement
	var err error
	switch kind {
	case "contiguous":
		pl, err = router.NewPlacement(router.Contiguous, experts, p)
	case "roundrobin":
		pl, err = router.NewPlacement(router.RoundRobin, experts, p)
	case "replicated":
		pl, err = router.NewPlacement(router.Contiguous, experts, p)
		if err == nil {
			err = pl.Replicate([]int{0, 1}, min(p, 3))
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return pl
}

// check runs dispatch, the test experts, and combine, and compares everything with what
// the scenario implies.
func check(t *testing.T, s scenario, plKind string, wire dtype.Type, align int) {
	t.Helper()
	pl := placement(t, plKind, s.experts, s.p)
	runRanks(t, s.p, func(c *coll.Comm) error { return checkRank(c, s, pl, wire, align, 2, coll.AlgoAuto) })
}

// checkRank is one rank's part of check: rounds of dispatch, the test experts, combine
// and redispatch on c, every row, weight and sum compared with what the scenario implies.
// algo, unless AlgoAuto, is the algorithm the dispatch and combine plans must have.
func checkRank(c *coll.Comm, s scenario, pl *router.Placement, wire dtype.Type, align, rounds int, algo coll.Algo) error {
	routings := make([]*router.Routing, s.p)
	inputs := make([][]float32, s.p)
	for o := range routings {
		routings[o], inputs[o] = s.routing(o)
	}
	me := c.Rank()
	d, err := dispatch.New(c, dispatch.Config{Hidden: s.hid, TopK: s.k, WireDType: wire, Placement: pl, Align: align})
	if err != nil {
		return err
	}
	cb := combine.New(d)
	ctx := context.Background()
	for round := 0; round < rounds; round++ {
		r, x := s.routing(me)
		out, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		// What this rank must receive, per local expert, in (origin, token) order.
		local := pl.Local[me]
		for li, e := range local {
			var want [][2]int32
			var wantW []float32
			for o := 0; o < s.p; o++ {
				ro := routings[o]
				for tok := 0; tok < ro.T; tok++ {
					for j := 0; j < s.k; j++ {
						if int(ro.Experts[tok*s.k+j]) == e && pl.RankOf(e, o, tok) == me {
							want = append(want, [2]int32{int32(o), int32(tok)})
							wantW = append(wantW, ro.Weights[tok*s.k+j])
						}
					}
				}
			}
			if out.Counts[li] != len(want) {
				return fmt.Errorf("expert %d: %d rows, want %d", e, out.Counts[li], len(want))
			}
			if (out.Offsets[li+1]-out.Offsets[li])%align != 0 {
				return fmt.Errorf("expert %d block of %d rows not aligned to %d", e, out.Offsets[li+1]-out.Offsets[li], align)
			}
			for i, w := range want {
				row := out.Offsets[li] + i
				if out.Origin[row] != w[0] || out.Source[row] != w[1] || out.Weight[row] != wantW[i] || out.Expert[row] != int32(e) {
					return fmt.Errorf("expert %d row %d: origin %d src %d w %v, want %v w %v", e, i, out.Origin[row], out.Source[row], out.Weight[row], w, wantW[i])
				}
				xo := inputs[w[0]]
				for k := 0; k < s.hid; k++ {
					if out.X[row*s.hid+k] != xo[int(w[1])*s.hid+k] {
						return fmt.Errorf("expert %d row %d element %d: %v want %v", e, i, k, out.X[row*s.hid+k], xo[int(w[1])*s.hid+k])
					}
				}
			}
			for row := out.Offsets[li] + out.Counts[li]; row < out.Offsets[li+1]; row++ {
				if out.Origin[row] != -1 {
					return fmt.Errorf("padding row %d has origin %d", row, out.Origin[row])
				}
			}
		}
		// Experts compute; combine.
		y := make([]float32, len(out.X))
		for row := 0; row < out.Rows(); row++ {
			for k := 0; k < s.hid; k++ {
				y[row*s.hid+k] = expert(out.Expert[row], out.X[row*s.hid+k])
			}
		}
		got := make([]float32, len(x))
		if err := cb.Combine(ctx, h, y, got); err != nil {
			return err
		}
		if algo != coll.AlgoAuto && (d.Plan().Algo != algo || cb.Plan().Algo != algo) {
			return fmt.Errorf("dispatch ran %v, combine %v, want %v", d.Plan().Algo, cb.Plan().Algo, algo)
		}
		for tok := 0; tok < r.T; tok++ {
			for k := 0; k < s.hid; k++ {
				// This rank's own experts' terms first (choice order), then each other
				// serving rank's partial sum (exact: small dyadic values), which crosses
				// the wire in the wire type, in ascending rank order.
				want := float32(0)
				for j := 0; j < s.k; j++ {
					if e := r.Experts[tok*s.k+j]; e >= 0 && pl.RankOf(int(e), me, tok) == me {
						want += r.Weights[tok*s.k+j] * expert(e, x[tok*s.hid+k])
					}
				}
				for q := 0; q < s.p; q++ {
					if q == me {
						continue
					}
					part := float32(0)
					for j := 0; j < s.k; j++ {
						if e := r.Experts[tok*s.k+j]; e >= 0 && pl.RankOf(int(e), me, tok) == q {
							part += r.Weights[tok*s.k+j] * expert(e, x[tok*s.hid+k])
						}
					}
					if wire == dtype.BF16 {
						part = dtype.ToBF16(part).Float32()
					}
					want += part
				}
				if got[tok*s.hid+k] != want {
					return fmt.Errorf("round %d token %d element %d: combined %v, want %v", round, tok, k, got[tok*s.hid+k], want)
				}
			}
		}
		// Redispatch with the same routing and new activations.
		x2 := make([]float32, len(x))
		for i := range x2 {
			x2[i] = x[i] + 1
		}
		out2, err := d.Redispatch(ctx, h, x2)
		if err != nil {
			return err
		}
		for row := 0; row < out2.Rows(); row++ {
			if out2.Origin[row] < 0 {
				continue
			}
			xo := inputs[out2.Origin[row]]
			if out2.X[row*s.hid] != xo[int(out2.Source[row])*s.hid]+1 {
				return fmt.Errorf("redispatch row %d wrong", row)
			}
		}
	}
	return nil
}

func TestDispatchCombine(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 7, 8} {
		for _, plKind := range []string{"contiguous", "roundrobin", "replicated"} {
			for _, wire := range []dtype.Type{dtype.F32, dtype.BF16} {
				name := fmt.Sprintf("P=%d/%s/%v", p, plKind, wire)
				t.Run(name, func(t *testing.T) {
					tokens := make([]int, p)
					for i := range tokens {
						tokens[i] = 13 + 7*i
					}
					if p > 2 {
						tokens[1] = 0 // a rank with no tokens
					}
					s := scenario{p: p, hid: 9, k: min(3, 2*p), experts: 2 * p, tokens: tokens, dropEvery: 7, seed: uint64(p)}
					check(t, s, plKind, wire, 1)
				})
			}
		}
	}
}

func TestDispatchSkewAndAlign(t *testing.T) {
	s := scenario{p: 4, hid: 16, k: 4, experts: 16, tokens: []int{40, 40, 40, 40}, skew: true, seed: 9}
	check(t, s, "contiguous", dtype.F32, 8)
	check(t, s, "replicated", dtype.BF16, 4)
}

func TestBadInputs(t *testing.T) {
	pl, _ := router.NewPlacement(router.Contiguous, 8, 3)
	ctx := context.Background()
	runRanks(t, 3, func(c *coll.Comm) error {
		d, err := dispatch.New(c, dispatch.Config{Hidden: 4, TopK: 2, Placement: pl})
		if err != nil {
			return err
		}
		good := func() (*router.Routing, []float32) {
			r := &router.Routing{T: 2, K: 2, E: 8, Experts: []int32{0, 5, 7, 2}, Weights: []float32{1, 1, 1, 1}}
			return r, make([]float32, 8)
		}
		// Expert out of range on rank 1: rank 1 gets ErrInput, the others a
		// PeerInputError naming rank 1, in the same call.
		r, x := good()
		if c.Rank() == 1 {
			r.Experts[3] = 8
		}
		_, _, err = d.Dispatch(ctx, x, r)
		var pie *dispatch.PeerInputError
		switch {
		case c.Rank() == 1 && !errors.Is(err, dispatch.ErrInput):
			return fmt.Errorf("bad expert: %v", err)
		case c.Rank() != 1 && (!errors.As(err, &pie) || pie.Rank != 1):
			return fmt.Errorf("other rank's bad expert: %v", err)
		}
		// Shape mismatch on rank 2.
		r, x = good()
		if c.Rank() == 2 {
			x = x[:4]
		}
		if _, _, err = d.Dispatch(ctx, x, r); !errors.Is(err, dispatch.ErrInput) {
			return fmt.Errorf("shape: %v", err)
		}
		// The communicator is still usable: a good dispatch works, with a rank at zero
		// tokens.
		r, x = good()
		if c.Rank() == 0 {
			r = &router.Routing{T: 0, K: 2, E: 8}
			x = nil
		}
		out, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return fmt.Errorf("good dispatch after errors: %v", err)
		}
		y := make([]float32, len(out.X))
		res := make([]float32, len(x))
		if err := combine.New(d).Combine(ctx, h, y, res); err != nil {
			return err
		}
		// A handle from an older dispatch is refused.
		if _, _, err := d.Dispatch(ctx, x, r); err != nil {
			return err
		}
		if err := combine.New(d).Combine(ctx, h, y, res); !errors.Is(err, dispatch.ErrStale) {
			return fmt.Errorf("stale handle: %v", err)
		}
		return nil
	})
	// Ranks that disagree on the hidden size all fail with ErrMismatch.
	runRanks(t, 3, func(c *coll.Comm) error {
		hid := 4
		if c.Rank() == 0 {
			hid = 5
		}
		d, err := dispatch.New(c, dispatch.Config{Hidden: hid, TopK: 1, Placement: pl})
		if err != nil {
			return err
		}
		r := &router.Routing{T: 1, K: 1, E: 8, Experts: []int32{int32(c.Rank())}, Weights: []float32{1}}
		if _, _, err := d.Dispatch(ctx, make([]float32, hid), r); !errors.Is(err, coll.ErrMismatch) {
			return fmt.Errorf("hidden mismatch: %v", err)
		}
		return nil
	})
	// Configuration errors.
	cs, _ := coll.Local(1, coll.Config{})
	defer cs[0].Close()
	pl1, _ := router.NewPlacement(router.Contiguous, 4, 1)
	for _, cfg := range []dispatch.Config{
		{Hidden: 0, TopK: 1, Placement: pl1},
		{Hidden: 4, TopK: 5, Placement: pl1},
		{Hidden: 4, TopK: 1, Placement: pl1, WireDType: dtype.F16},
		{Hidden: 4, TopK: 1},
		{Hidden: 4, TopK: 1, Placement: pl},
	} {
		if _, err := dispatch.New(cs[0], cfg); !errors.Is(err, dispatch.ErrConfig) {
			t.Errorf("%+v: %v", cfg, err)
		}
	}
}

// Bitwise reproducibility: the same inputs give the same bits run after run, whatever
// the scheduling of the ranks (non-integer data this time).
func TestReproducible(t *testing.T) {
	s := scenario{p: 4, hid: 32, k: 3, experts: 8, tokens: []int{50, 60, 70, 80}, seed: 5}
	var first [][]float32
	for run := 0; run < 4; run++ {
		results := make([][]float32, s.p)
		pl := placement(t, "replicated", s.experts, s.p)
		runRanks(t, s.p, func(c *coll.Comm) error {
			d, _ := dispatch.New(c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl})
			r, x := s.routing(c.Rank())
			rng := rand.New(rand.NewPCG(uint64(c.Rank()), 3))
			for i := range x {
				x[i] = float32(rng.NormFloat64())
			}
			for i := range r.Weights {
				r.Weights[i] = float32(rng.Float64())
			}
			out, h, err := d.Dispatch(context.Background(), x, r)
			if err != nil {
				return err
			}
			y := make([]float32, len(out.X))
			for i := range y {
				y[i] = out.X[i] * 1.1
			}
			res := make([]float32, len(x))
			if err := combine.New(d).Combine(context.Background(), h, y, res); err != nil {
				return err
			}
			results[c.Rank()] = res
			return nil
		})
		if first == nil {
			first = results
			continue
		}
		for rk := range results {
			for i := range results[rk] {
				if results[rk][i] != first[rk][i] {
					t.Fatalf("run %d rank %d element %d: %v differs from %v", run, rk, i, results[rk][i], first[rk][i])
				}
			}
		}
	}
}

// In steady state a dispatch and a combine allocate nothing.
func TestAllocs(t *testing.T) {
	if race.Enabled {
		t.Skip("allocation counts are meaningless under -race (sync.Pool drops items on purpose)")
	}
	s := scenario{p: 2, hid: 64, k: 2, experts: 4, tokens: []int{100, 100}, seed: 1}
	pl := placement(t, "contiguous", s.experts, s.p)
	cs, _ := coll.Local(2, coll.Config{})
	defer cs[0].Close()
	defer cs[1].Close()
	type st struct {
		d   *dispatch.Dispatcher
		cb  *combine.Combiner
		r   *router.Routing
		x   []float32
		y   []float32
		res []float32
	}
	sts := make([]*st, 2)
	pools := []*obuf.Pool{obuf.NewPool(0), obuf.NewPool(0)}
	for i, c := range cs {
		d, _ := dispatch.New(c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, WireDType: dtype.BF16, Pool: pools[i]})
		r, x := s.routing(i)
		sts[i] = &st{d: d, cb: combine.New(d), r: r, x: x, y: make([]float32, 4096*s.hid), res: make([]float32, len(x))}
	}
	step := func(s *st) {
		out, h, err := s.d.Dispatch(context.Background(), s.x, s.r)
		if err != nil {
			panic(err)
		}
		if err := s.cb.Combine(context.Background(), h, s.y[:len(out.X)], s.res); err != nil {
			panic(err)
		}
	}
	other := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range other {
			step(sts[1])
		}
	}()
	run := func() {
		other <- struct{}{}
		step(sts[0])
	}
	for i := 0; i < 10; i++ {
		run()
	}
	n := testing.AllocsPerRun(100, run)
	close(other)
	<-done
	if n > 0 {
		t.Fatalf("%.1f allocations per dispatch+combine", n)
	}
	// The wire buffers and expert inputs came from the pool, and go back to it on Close.
	for i, x := range sts {
		if st := pools[i].Stats(); st.Gets < 5 || st.Allocs > st.Gets {
			t.Errorf("rank %d: pool stats %+v: dispatch and combine buffers not taken from the pool", i, st)
		}
		x.cb.Close()
		x.d.Close()
		if st := pools[i].Stats(); st.Gets != st.Releases {
			t.Errorf("rank %d: %d buffers taken, %d given back after Close", i, st.Gets, st.Releases)
		}
	}
}

// TestHelperMoERank is one rank of TestMoEOverShm, started by `moex run`.
func TestHelperMoERank(t *testing.T) {
	if os.Getenv("MOEX_COMBINE_HELPER") == "" {
		t.Skip("helper rank: runs only under TestMoEOverShm")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := coll.Init(ctx, coll.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p := c.Size()
	tokens := make([]int, p)
	for i := range tokens {
		tokens[i] = 13 + 7*i
	}
	tokens[1] = 0 // a rank with no tokens
	for _, s := range []scenario{
		{p: p, hid: 9, k: 3, experts: 2 * p, tokens: tokens, dropEvery: 7, seed: 1},
		// Rows of 8 KiB: every rank's send buffer is larger than the area (read in place
		// from the shared arena, where private buffers are read across).
		{p: p, hid: 2048, k: 2, experts: 2 * p, tokens: []int{200, 150, 220, 180}[:p], seed: 2},
	} {
		for _, wire := range []dtype.Type{dtype.F32, dtype.BF16} {
			pl, err := router.NewPlacement(router.Contiguous, s.experts, p)
			if err != nil {
				t.Fatal(err)
			}
			if err := checkRank(c, s, pl, wire, 1, 2, coll.Shared); err != nil {
				t.Fatalf("rank %d, hidden %d, %v on the wire: %v", c.Rank(), s.hid, wire, err)
			}
		}
	}
	// The dispatcher's default buffers are shared, so the others read them in place.
	if tr, ok := c.Transport().(*shm.Transport); !ok || tr.Stats().SharedBytes == 0 {
		t.Fatalf("rank %d: no bytes read in place from the dispatchers' shared buffers", c.Rank())
	}
	fmt.Printf("rank %d ok\n", c.Rank())
}

// The MoE dispatch and combine between processes over shared memory go through the
// shared areas (the plans say so), and deliver what the scenario implies, with small
// send buffers (through the areas) and large ones (read in place: the dispatcher takes
// its buffers from obuf.Shared over shared memory).
func TestMoEOverShm(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("shared memory transport: Linux only")
	}
	exe := filepath.Join(t.TempDir(), "moex")
	if out, err := exec.Command("go", "build", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput(); err != nil {
		t.Fatalf("building moex: %v\n%s", err, out)
	}
	cmd := exec.Command(exe, "run", "-n", "4", "--", os.Args[0], "-test.run=^TestHelperMoERank$")
	cmd.Env = append(os.Environ(), "MOEX_COMBINE_HELPER=1", "MOEX_TRANSPORT=shm")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("moex run: %v\n%s", err, out)
	}
	if n := strings.Count(string(out), " ok"); n != 4 {
		t.Fatalf("%d of 4 ranks ok:\n%s", n, out)
	}
}
