package combine_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// scenario: every rank's tokens and routing, built from a seed the same way on every rank.
type scenario struct {
	p, hid, k, experts int
	tokens             []int // per rank
	dropEvery          int   // drop one choice in this many (0: none)
	skew               bool  // everything to expert 0 and 1
	seed               uint64
	maxTokens          int // low-latency mode
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
			if s.skew && j < 2 {
				e = j
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
				for e >= 0 && seen[e] {
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

func toT[T combine.Act](x []float32) []T {
	out := make([]T, len(x))
	dtype.Convert(out, x)
	return out
}

func toF32[T dispatch.Act](x []T) []float32 {
	out := make([]float32, len(x))
	switch v := any(x).(type) {
	case []float32:
		copy(out, v)
	case []dtype.BFloat16:
		dtype.BF16ToF32(out, v)
	}
	return out
}

// wireRound is a row as the experts see it: through the wire type and into the
// activation type, done by the test from the kernels' definitions.
func wireRound(x []float32, wire, act dtype.Type, pow2 bool) []float32 {
	y := append([]float32(nil), x...)
	switch wire {
	case dtype.BF16:
		for i := range y {
			y[i] = dtype.ToBF16(y[i]).Float32()
		}
	case dtype.FP8E4M3:
		q := make([]byte, len(x))
		s := make([]float32, dtype.FP8Scales(len(x)))
		dtype.QuantizeFP8(q, s, x, pow2)
		dtype.DequantizeFP8(y, q, s)
	case dtype.I8:
		q := make([]byte, len(x))
		dtype.DequantizeI8(y, q, dtype.QuantizeI8(q, x))
	}
	if act == dtype.BF16 {
		for i := range y {
			y[i] = dtype.ToBF16(y[i]).Float32()
		}
	}
	return y
}

// exact reports whether every value the test computes is exact in cfg's types (the
// combined sums are then compared bit for bit): small integers and dyadic weights are
// exact in f32 and bf16, and in fp8 with power-of-two scales.
func exact(cfg step) bool {
	return cfg.WireDType != dtype.I8 && (cfg.WireDType != dtype.FP8E4M3 || cfg.PowerOfTwoScales) &&
		(cfg.Mode != dispatch.Gathered || cfg.Back.PartialDType == dtype.F32) // the gathered mode sums bf16 in bf16
}

// step is a dispatch's configuration and its combine's: what the helpers take.
type step struct {
	dispatch.Config
	Back combine.Config
}

func runRanks(t *testing.T, p int, ccfg coll.Config, f func(c *coll.Comm) error) {
	t.Helper()
	errs := onRanks(t, p, ccfg, true, f)
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// onRanks runs f on p local ranks and returns each rank's error; with abortOnError a
// rank that fails aborts the communicator, so that the others do not wait for it.
func onRanks(t *testing.T, p int, ccfg coll.Config, abortOnError bool, f func(c *coll.Comm) error) []error {
	t.Helper()
	if ccfg.Timeout == 0 {
		ccfg.Timeout = 30 * time.Second // a hang fails the test instead of stalling it
	}
	cs, err := coll.Local(p, ccfg)
	require.NoError(t, err)
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
			if errs[i] != nil && abortOnError {
				c.Abort(errs[i].Error()) // the others must not wait for this rank
			}
		}()
	}
	wg.Wait()
	return errs
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
	require.NoError(t, err)
	return pl
}

// checkRank is one rank's part of a check: rounds of dispatch, the test experts, combine
// and redispatch on c, every row, weight and sum compared with what the scenario
// implies. algo, unless AlgoAuto, is the algorithm the normal mode's plans must have.
// checkBlock checks what an engine that slices an expert's rows as one matrix gets:
// Block (QBlock) holds local expert li's rows, in entry order, in every mode; in place
// where the rows are expert-major (the normal mode, or Config.ExpertMajor).
func checkBlock[T combine.Act](out *dispatch.Output[T], li, hid int, f dispatch.Format, cfg step, mode dispatch.Mode) error {
	a, n := out.Offsets[li], out.Counts[li]
	if want := mode == dispatch.Normal || cfg.ExpertMajor; out.ExpertMajor() != want {
		return fmt.Errorf("ExpertMajor() %v in the %v mode, Config.ExpertMajor %v", out.ExpertMajor(), mode, cfg.ExpertMajor)
	}
	if cfg.Quantized {
		q, sc := out.QBlock(li)
		if len(q) != n*f.Payload || len(sc) != n*f.Scales {
			return fmt.Errorf("expert %d: QBlock of %d bytes and %d scales for %d rows", li, len(q), len(sc), n)
		}
		for k := 0; k < n; k++ {
			eq, es := out.QEntry(a + k)
			if !slices.Equal(q[k*f.Payload:(k+1)*f.Payload], eq) || !slices.Equal(sc[k*f.Scales:(k+1)*f.Scales], es) {
				return fmt.Errorf("expert %d: QBlock row %d is not entry %d's", li, k, a+k)
			}
		}
		return nil
	}
	b := out.Block(li)
	if len(b) != n*hid {
		return fmt.Errorf("expert %d: Block of %d values for %d rows of %d", li, len(b), n, hid)
	}
	for k := 0; k < n; k++ {
		e := out.Entry(a + k)
		if !slices.Equal(b[k*hid:(k+1)*hid], e) {
			return fmt.Errorf("expert %d: Block row %d is not entry %d's", li, k, a+k)
		}
		if out.ExpertMajor() && &b[k*hid] != &e[0] {
			return fmt.Errorf("expert %d: Block copied the expert-major rows", li)
		}
	}
	return nil
}

func checkRank[T combine.Act](c *coll.Comm, s scenario, cfg step, rounds int, algo coll.Algo) error {
	ctx := context.Background()
	routings := make([]*router.Routing, s.p)
	inputs := make([][]float32, s.p)
	for o := range routings {
		routings[o], inputs[o] = s.routing(o)
	}
	me := c.Rank()
	pl := cfg.Placement
	cfg.Hidden, cfg.TopK = s.hid, s.k
	if cfg.Mode == dispatch.LowLatency {
		cfg.MaxTokens = s.maxTokens
	}
	d, cb, err := newPairOf[T](ctx, c, cfg.Config, cfg.Back)
	if err != nil {
		return err
	}
	defer d.Close()
	defer cb.Close()
	cfg = step{d.Config(), cb.Config()}
	act := dtype.Of[T]()
	f := dispatch.NewFormat(cfg.Config)
	// What each token looks like to the experts.
	seen := make([][]float32, s.p)
	for o := range seen {
		seen[o] = make([]float32, len(inputs[o]))
		for tok := 0; tok < s.tokens[o]; tok++ {
			copy(seen[o][tok*s.hid:], wireRound(inputs[o][tok*s.hid:(tok+1)*s.hid], cfg.WireDType, act, cfg.PowerOfTwoScales))
		}
	}
	for round := 0; round < rounds; round++ {
		r, x32 := s.routing(me)
		x := toT[T](x32)
		out, h, err := d.Dispatch(ctx, x, r)
		if err != nil {
			return err
		}
		// What this rank must receive, per local expert, in (origin, token) order.
		for li, e := range pl.Local[me] {
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
			if (out.Offsets[li+1]-out.Offsets[li])%cfg.Align != 0 {
				return fmt.Errorf("expert %d block of %d rows not aligned to %d", e, out.Offsets[li+1]-out.Offsets[li], cfg.Align)
			}
			for i, w := range want {
				j := out.Offsets[li] + i
				if out.Origin[j] != w[0] || out.Source[j] != w[1] || out.Weight[j] != wantW[i] || out.Expert[j] != int32(e) {
					return fmt.Errorf("expert %d entry %d: origin %d src %d w %v, want %v w %v", e, i, out.Origin[j], out.Source[j], out.Weight[j], w, wantW[i])
				}
				wantRow := seen[w[0]][int(w[1])*s.hid : int(w[1]+1)*s.hid]
				if cfg.Quantized {
					q, sc := out.QEntry(j)
					if len(q) != f.Payload || len(sc) != f.Scales {
						return fmt.Errorf("expert %d entry %d: %d bytes and %d scales, want %d and %d", e, i, len(q), len(sc), f.Payload, f.Scales)
					}
					got := make([]float32, s.hid)
					if cfg.WireDType == dtype.I8 {
						dtype.DequantizeI8(got, q, sc[0])
					} else {
						dtype.DequantizeFP8(got, q, sc)
					}
					if err := sameRow(got, wantRow); err != nil {
						return fmt.Errorf("expert %d entry %d (quantised): %v", e, i, err)
					}
					continue
				}
				if err := sameRow(toF32(out.Entry(j)), wantRow); err != nil {
					return fmt.Errorf("expert %d entry %d: %v", e, i, err)
				}
			}
			for j := out.Offsets[li] + out.Counts[li]; j < out.Offsets[li+1]; j++ {
				q, _ := out.QEntry(j)
				if out.Origin[j] != -1 || out.Entry(j) != nil || q != nil {
					return fmt.Errorf("padding entry %d has origin %d or a row", j, out.Origin[j])
				}
			}
			if err := checkBlock(out, li, s.hid, f, cfg, d.Stats().Mode); err != nil {
				return err
			}
		}
		// Experts compute (on what they were given); combine.
		y32 := make([]float32, out.Rows()*s.hid)
		for j := 0; j < out.Rows(); j++ {
			if out.Origin[j] < 0 {
				continue
			}
			src := seen[out.Origin[j]][int(out.Source[j])*s.hid:]
			for k := 0; k < s.hid; k++ {
				y32[j*s.hid+k] = expert(out.Expert[j], src[k])
			}
		}
		y := toT[T](y32)
		if b := cb.Buffer(h); b != nil && round%2 == 1 { // the experts write in place
			if len(b) != len(y) {
				return fmt.Errorf("Buffer: %d values for %d rows of %d", len(b), out.Rows(), s.hid)
			}
			copy(b, y)
			y = b
		}
		got := make([]T, len(x))
		if err := cb.Combine(ctx, h, y, got); err != nil {
			return err
		}
		if cfg.Mode == dispatch.Normal && algo != coll.AlgoAuto && (d.Stats().Algo != algo || cb.Stats().Algo != algo) {
			return fmt.Errorf("dispatch ran %v, combine %v, want %v", d.Stats().Algo, cb.Stats().Algo, algo)
		}
		if err := checkCombined(toF32(got), r, seen[me], pl, me, s, cfg, act, cb.InPlace()); err != nil {
			return fmt.Errorf("round %d: %w", round, err)
		}
		// Redispatch with the same routing and new activations.
		for i := range x32 {
			x32[i]++
		}
		out2, err := d.Redispatch(ctx, h, toT[T](x32))
		if err != nil {
			return err
		}
		for j := 0; j < out2.Rows(); j++ {
			if out2.Origin[j] < 0 || cfg.Quantized {
				continue
			}
			tok := int(out2.Source[j])
			o := inputs[out2.Origin[j]]
			want := make([]float32, s.hid)
			for k := range want {
				want[k] = o[tok*s.hid+k] + 1
			}
			if err := sameRow(toF32(out2.Entry(j)), wireRound(want, cfg.WireDType, act, cfg.PowerOfTwoScales)); err != nil {
				return fmt.Errorf("redispatch entry %d: %v", j, err)
			}
		}
	}
	return nil
}

func sameRow(got, want []float32) error {
	for k := range want {
		if got[k] != want[k] && !(math.IsNaN(float64(got[k])) && math.IsNaN(float64(want[k]))) {
			return fmt.Errorf("element %d: %v, want %v", k, got[k], want[k])
		}
	}
	return nil
}

// checkCombined compares the combined rows with the scenario's: this rank's own
// experts' terms first (choice order), then each other serving rank's partial sum, in
// the combine's wire type (fp8 and int8 quantise the partial sum's row), in ascending
// rank order; or, in place, every term in float32, in choice order. Bit for bit where
// exact, within a relative 1e-5 of the terms' magnitudes otherwise, and a code step of
// each quantised partial sum.
func checkCombined(got []float32, r *router.Routing, seen []float32, pl *router.Placement, me int, s scenario, cfg step, act dtype.Type, inPlace bool) error {
	term := func(tok, j, k int) float32 {
		e := r.Experts[tok*s.k+j]
		y := expert(e, seen[tok*s.hid+k])
		if act == dtype.BF16 {
			y = dtype.ToBF16(y).Float32()
		}
		return r.Weights[tok*s.k+j] * y
	}
	// part[q] is rank q's partial sum of a token as it arrives, step[q] a code step of it.
	part, step := make([][]float32, s.p), make([][]float32, s.p)
	for tok := 0; tok < r.T; tok++ {
		mag := make([]float64, s.hid)
		for q := 0; q < s.p && !inPlace; q++ {
			row := make([]float32, s.hid)
			for k := range row {
				for j := 0; j < s.k; j++ {
					if e := r.Experts[tok*s.k+j]; e >= 0 && pl.RankOf(int(e), me, tok) == q {
						row[k] += term(tok, j, k)
						mag[k] += math.Abs(float64(term(tok, j, k)))
					}
				}
			}
			if q != me {
				part[q], step[q] = wireRound(row, cfg.Back.PartialDType, dtype.F32, false), codeStep(row, cfg.Back.PartialDType)
			}
		}
		for k := 0; k < s.hid; k++ {
			want, tol := float32(0), 0.0
			for j := 0; j < s.k && inPlace; j++ {
				if e := r.Experts[tok*s.k+j]; e >= 0 {
					want += term(tok, j, k)
					mag[k] += math.Abs(float64(term(tok, j, k)))
				}
			}
			for j := 0; j < s.k && !inPlace; j++ {
				if e := r.Experts[tok*s.k+j]; e >= 0 && pl.RankOf(int(e), me, tok) == me {
					want += term(tok, j, k)
				}
			}
			for q := 0; q < s.p && !inPlace; q++ {
				if q != me {
					want += part[q][k]
					tol += float64(step[q][k])
				}
			}
			if act == dtype.BF16 {
				want = dtype.ToBF16(want).Float32()
			}
			g := got[tok*s.hid+k]
			switch {
			case exact(cfg) && g != want:
				return fmt.Errorf("token %d element %d: combined %v, want %v", tok, k, g, want)
			case !exact(cfg) && math.Abs(float64(g-want)) > 1e-5*mag[k]+1e-6+tol+bf16ulp(act, want):
				return fmt.Errorf("token %d element %d: combined %v, want %v (terms' magnitude %v)", tok, k, g, want, mag[k])
			}
		}
	}
	return nil
}

// codeStep is, per element of a partial sum's row, the step between two codes of the
// combine type t where it lies (fp8: 2^-3 of it, or a subnormal's 2^-9 of the block's
// scale; int8: the row's scale), 0 for f32 and bf16: a partial sum that the test adds in
// another order than the kernel may round to the neighbouring code.
func codeStep(row []float32, t dtype.Type) []float32 {
	st := make([]float32, len(row))
	switch t {
	case dtype.FP8E4M3:
		for lo := 0; lo < len(row); lo += dtype.FP8Block {
			hi := min(lo+dtype.FP8Block, len(row))
			m := float32(0)
			for _, v := range row[lo:hi] {
				m = max(m, float32(math.Abs(float64(v))))
			}
			for i := lo; i < hi; i++ {
				st[i] = max(float32(math.Abs(float64(row[i])))/8, m/448/512)
			}
		}
	case dtype.I8:
		m := float32(0)
		for _, v := range row {
			m = max(m, float32(math.Abs(float64(v))))
		}
		for i := range st {
			st[i] = m / dtype.I8Max
		}
	}
	return st
}

// bf16ulp is a bfloat16 step at v when the output is bfloat16 (a sum taken in another
// order may round to the neighbour), else 0.
func bf16ulp(act dtype.Type, v float32) float64 {
	if act != dtype.BF16 {
		return 0
	}
	return math.Abs(float64(v)) * 0x1p-7
}

// check runs checkRank on p local ranks for every rank.
func check[T combine.Act](t *testing.T, s scenario, cfg step, ccfg coll.Config) {
	t.Helper()
	runRanks(t, s.p, ccfg, func(c *coll.Comm) error { return checkRank[T](c, s, cfg, 2, coll.AlgoAuto) })
}

func defaultScenario(p int) scenario {
	tokens := make([]int, p)
	for i := range tokens {
		tokens[i] = 13 + 7*i
	}
	if p > 2 {
		tokens[1] = 0 // a rank with no tokens
	}
	return scenario{p: p, hid: 9, k: min(3, 2*p), experts: 2 * p, tokens: tokens, dropEvery: 7, seed: uint64(p), maxTokens: 13 + 7*(p-1)}
}

// The matrix: ranks, placements, modes, wire types, activation types, windows or
// messages.
func TestDispatchCombine(t *testing.T) {
	wires := []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8}
	for _, p := range []int{1, 2, 3, 4, 5, 7, 8} {
		for pi, plKind := range []string{"contiguous", "roundrobin", "replicated"} {
			for _, mode := range modes {
				// Every wire type for each (P, mode); placements and activation types
				// rotate so that each pair meets every wire type at some P.
				for wi, wire := range wires {
					if (pi+wi+p)%3 != 0 && wire != dtype.F32 {
						continue
					}
					cfg := step{Config: dispatch.Config{WireDType: wire, Placement: placement(t, plKind, 2*p, p), Mode: mode}}
					ccfg := coll.Config{NoWindows: (p+wi)%2 == 1}
					name := fmt.Sprintf("P=%d/%s/%v/%v/windows=%v", p, plKind, mode, wire, !ccfg.NoWindows)
					t.Run(name+"/f32", func(t *testing.T) { check[float32](t, defaultScenario(p), cfg, ccfg) })
					t.Run(name+"/bf16", func(t *testing.T) {
						cfg := cfg
						if wire == dtype.FP8E4M3 {
							cfg.PowerOfTwoScales = true // exact for the test's small integers
						}
						check[dtype.BFloat16](t, defaultScenario(p), cfg, ccfg)
					})
				}
			}
		}
	}
}

// fp8 and int8 partial sums: each serving rank's partial sum of a token quantised once,
// the token's rank adding them in float32, bit for bit as the test's model of the
// kernels where the values are exact. Both point-to-point modes, windows and messages,
// both activation types, rows of three fp8 blocks (the last one short); the low-latency
// mode sends the partial sums (SendPartials) where ranks could read them in place.
func TestQuantizedCombine(t *testing.T) {
	kinds := []string{"contiguous", "roundrobin", "replicated"}
	for _, p := range []int{2, 3, 4, 8} {
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
			for bi, back := range []dtype.Type{dtype.FP8E4M3, dtype.I8} {
				for wi, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3} {
					s := defaultScenario(p)
					s.hid = 300
					cfg := step{dispatch.Config{WireDType: wire, PowerOfTwoScales: true, Mode: mode, Placement: placement(t, kinds[(p+wi+bi)%3], 2*p, p)},
						combine.Config{PartialDType: back, SendPartials: mode == dispatch.LowLatency}}
					ccfg := coll.Config{NoWindows: (p+wi+bi)%2 == 1}
					name := fmt.Sprintf("P=%d/%v/%v-back/%v/windows=%v", p, mode, back, wire, !ccfg.NoWindows)
					t.Run(name+"/f32", func(t *testing.T) { check[float32](t, s, cfg, ccfg) })
					t.Run(name+"/bf16", func(t *testing.T) { check[dtype.BFloat16](t, s, cfg, ccfg) })
				}
			}
		}
	}
}

// Config.ExpertMajor: every mode (Auto too, whose steps here go low-latency and
// grow), windows and messages, rows in the activation type and quantised, padded
// blocks: each expert's rows are one block in place (checkRank's checkBlock), and the
// modes that leave rows where they arrived count the copy that laid them out.
func TestExpertMajorEveryMode(t *testing.T) {
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered, dispatch.Auto} {
		for _, quantized := range []bool{false, true} {
			for _, windows := range []bool{true, false} {
				t.Run(fmt.Sprintf("%v/quantized=%v/windows=%v", mode, quantized, windows), func(t *testing.T) {
					s := defaultScenario(4)
					s.hid = 256
					cfg := step{Config: dispatch.Config{Mode: mode, Placement: placement(t, "roundrobin", 8, 4), ExpertMajor: true, Align: 4}}
					if quantized {
						cfg.WireDType, cfg.Quantized = dtype.FP8E4M3, true
					}
					check[float32](t, s, cfg, coll.Config{NoWindows: !windows})
					runRanks(t, 4, coll.Config{NoWindows: !windows}, func(c *coll.Comm) error {
						cfg := cfg.Config
						cfg.Hidden, cfg.TopK = s.hid, s.k
						if mode == dispatch.LowLatency {
							cfg.MaxTokens = s.maxTokens
						}
						d, err := dispatch.New[float32](context.Background(), c, cfg)
						if err != nil {
							return err
						}
						defer d.Close()
						r, x := s.routing(c.Rank())
						if _, _, err := d.Dispatch(context.Background(), x, r); err != nil {
							return err
						}
						st := d.Stats()
						if packs := st.Mode != dispatch.Normal && st.RowsReceived+st.RowsPerRank[c.Rank()] > 0; packs != (st.PackedBytes > 0) {
							return fmt.Errorf("rank %d, %v step: %d bytes packed", c.Rank(), st.Mode, st.PackedBytes)
						}
						return nil
					})
				})
			}
		}
	}
}

// Quantised rows straight to the experts; bf16 partial sums; padded expert blocks;
// everything to two hot experts.
func TestDispatchQuantizedAlignSkew(t *testing.T) {
	s := scenario{p: 4, hid: 300, k: 4, experts: 16, tokens: []int{40, 40, 40, 40}, skew: true, seed: 9, maxTokens: 40}
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		for _, wire := range []dtype.Type{dtype.FP8E4M3, dtype.I8} {
			t.Run(fmt.Sprintf("%v/%v", mode, wire), func(t *testing.T) {
				cfg := step{Config: dispatch.Config{WireDType: wire, Quantized: true, Placement: placement(t, "replicated", 16, 4), Mode: mode, Align: 8}}
				check[float32](t, s, cfg, coll.Config{})
				cfg.Back.PartialDType = dtype.BF16
				cfg.Quantized = false
				cfg.PowerOfTwoScales = true
				check[float32](t, s, cfg, coll.Config{})
			})
		}
	}
	check[float32](t, s, step{Config: dispatch.Config{Placement: placement(t, "contiguous", 16, 4), Align: 8, Mode: dispatch.Normal}}, coll.Config{})
}

// Opaque rows (Dispatcher[byte]) travel as they are; the combine runs in float32.
func TestDispatchOpaque(t *testing.T) {
	const p, rowBytes, hid = 3, 40, 10
	pl := placement(t, "contiguous", 6, p)
	ctx := context.Background()
	for _, mode := range modes {
		runRanks(t, p, coll.Config{}, func(c *coll.Comm) error {
			d, err := dispatch.New[byte](ctx, c, dispatch.Config{Hidden: rowBytes, TopK: 2, Placement: pl, Mode: mode, MaxTokens: 8})
			if err != nil {
				return err
			}
			defer d.Close()
			r := &router.Routing{T: 5, K: 2, E: 6, Experts: make([]int32, 10), Weights: make([]float32, 10)}
			x := make([]byte, 5*rowBytes)
			for tok := 0; tok < 5; tok++ {
				r.Experts[2*tok], r.Experts[2*tok+1] = int32((tok+c.Rank())%6), int32((tok+c.Rank()+3)%6)
				r.Weights[2*tok], r.Weights[2*tok+1] = 1, 0.5
				for b := 0; b < rowBytes; b++ {
					x[tok*rowBytes+b] = byte(c.Rank()*50 + tok*7 + b)
				}
			}
			out, h, err := d.Dispatch(ctx, x, r)
			if err != nil {
				return err
			}
			for j := 0; j < out.Rows(); j++ {
				o, tok := int(out.Origin[j]), int(out.Source[j])
				for b, v := range out.Entry(j) {
					if v != byte(o*50+tok*7+b) {
						return fmt.Errorf("entry %d byte %d: %d from rank %d token %d", j, b, v, o, tok)
					}
				}
			}
			// The combine needs its own hidden size for opaque rows: Hidden bytes.
			cb, err := combine.New[float32](ctx, d, combine.Config{})
			if err != nil {
				return err
			}
			defer cb.Close()
			y := make([]float32, out.Rows()*rowBytes)
			for j := range y {
				y[j] = 1
			}
			res := make([]float32, 5*rowBytes)
			if err := cb.Combine(ctx, h, y, res); err != nil {
				return err
			}
			for i, v := range res {
				if v != 1.5 {
					return fmt.Errorf("combined %d: %v, want 1.5", i, v)
				}
			}
			return nil
		})
	}
	_ = hid
}

// Bitwise reproducibility: the same inputs give the same bits run after run, whatever
// the scheduling of the ranks (non-integer data this time), in both modes.
func TestReproducible(t *testing.T) {
	s := scenario{p: 4, hid: 32, k: 3, experts: 8, tokens: []int{50, 60, 70, 80}, seed: 5, maxTokens: 80}
	for _, mode := range modes {
		var first [][]float32
		for run := 0; run < 4; run++ {
			results := make([][]float32, s.p)
			pl := placement(t, "replicated", s.experts, s.p)
			runRanks(t, s.p, coll.Config{}, func(c *coll.Comm) error {
				ctx := context.Background()
				d, err := dispatch.New[float32](ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: mode, MaxTokens: s.maxTokens})
				if err != nil {
					return err
				}
				defer d.Close()
				cb, err := combine.New[float32](ctx, d, combine.Config{})
				if err != nil {
					return err
				}
				defer cb.Close()
				r, x := s.routing(c.Rank())
				rng := rand.New(rand.NewPCG(uint64(c.Rank()), 3))
				for i := range x {
					x[i] = float32(rng.NormFloat64())
				}
				for i := range r.Weights {
					r.Weights[i] = float32(rng.Float64())
				}
				out, h, err := d.Dispatch(ctx, x, r)
				if err != nil {
					return err
				}
				y := make([]float32, out.Rows()*s.hid)
				for j := 0; j < out.Rows(); j++ {
					for k, v := range out.Entry(j) {
						y[j*s.hid+k] = v * 1.1
					}
				}
				res := make([]float32, len(x))
				if err := cb.Combine(ctx, h, y, res); err != nil {
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
				require.Equal(t, first[rk], results[rk], "%v run %d rank %d", mode, run, rk)
			}
		}
	}
}

// The normal and low-latency modes agree bit for bit: the same sums in the same order.
// (The gathered mode sums in the reduce-scatter's order.)
func TestModesAgree(t *testing.T) {
	s := scenario{p: 5, hid: 24, k: 3, experts: 10, tokens: []int{20, 0, 31, 7, 16}, dropEvery: 5, seed: 11, maxTokens: 32}
	pl := placement(t, "replicated", s.experts, s.p)
	type run struct {
		mode     dispatch.Mode
		partials bool
		push     bool
	}
	runs := []run{{dispatch.Normal, false, false}, {dispatch.LowLatency, true, false}, {dispatch.LowLatency, false, false},
		{dispatch.LowLatency, true, true}}
	results := make([][][]float32, len(runs))
	inPlace := make([]bool, len(runs))
	rowsInPlace := make([]bool, len(runs))
	for i, ru := range runs {
		res := make([][]float32, s.p)
		runRanks(t, s.p, coll.Config{}, func(c *coll.Comm) error {
			ctx := context.Background()
			d, err := dispatch.New[float32](ctx, c, dispatch.Config{Hidden: s.hid, TopK: s.k, Placement: pl, Mode: ru.mode, MaxTokens: s.maxTokens, WireDType: dtype.FP8E4M3, PushRows: ru.push})
			if err != nil {
				return err
			}
			defer d.Close()
			cb, err := combine.New[float32](ctx, d, combine.Config{SendPartials: ru.partials})
			if err != nil {
				return err
			}
			defer cb.Close()
			if c.Rank() == 0 {
				inPlace[i], rowsInPlace[i] = cb.InPlace(), d.RowsInPlace()
			}
			r, x := s.routing(c.Rank())
			rng := rand.New(rand.NewPCG(uint64(c.Rank()), 7))
			for i := range x {
				x[i] = float32(rng.NormFloat64())
			}
			out, h, err := d.Dispatch(ctx, x, r)
			if err != nil {
				return err
			}
			y := make([]float32, out.Rows()*s.hid)
			for j := 0; j < out.Rows(); j++ {
				for k, v := range out.Entry(j) {
					y[j*s.hid+k] = v * float32(out.Expert[j]+1)
				}
			}
			res[c.Rank()] = make([]float32, len(x))
			return cb.Combine(ctx, h, y, res[c.Rank()])
		})
		results[i] = res
	}
	// The same partial sums in the same order: the same bits, whether the experts read
	// the tokens in place or each rank pushed them.
	assert.Equal(t, results[0], results[1])
	assert.Equal(t, results[0], results[3])
	assert.Equal(t, []bool{false, true, true, false}, rowsInPlace)
	// In place every term is summed in float32 without the partial sums' rounding: the
	// same to float32 precision.
	require.Equal(t, []bool{false, false, true, false}, inPlace)
	for q := range results[0] {
		require.Len(t, results[2][q], len(results[0][q]))
		for k, v := range results[0][q] {
			assert.InDelta(t, v, results[2][q][k], 1e-5*(1+math.Abs(float64(v))), "rank %d value %d", q, k)
		}
	}
}
