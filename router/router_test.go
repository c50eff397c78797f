package router

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
)

func randLogits(rng *rand.Rand, t, e int) []float32 {
	x := make([]float32, t*e)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	return x
}

func near(a, b, tol float32) bool { return float32(math.Abs(float64(a-b))) <= tol }

func TestSoftmaxTopK(t *testing.T) {
	logits := []float32{1, 3, 2, 0}
	r, err := Route(&Config{Experts: 4, TopK: 2, Gating: SoftmaxTopK}, logits, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r.Experts[0] != 1 || r.Experts[1] != 2 {
		t.Fatalf("experts %v", r.Experts)
	}
	z := math.Exp(1) + math.Exp(3) + math.Exp(2) + 1
	if !near(r.Weights[0], float32(math.Exp(3)/z), 1e-6) || !near(r.Weights[1], float32(math.Exp(2)/z), 1e-6) {
		t.Fatalf("weights %v", r.Weights)
	}
	r, _ = Route(&Config{Experts: 4, TopK: 2, Gating: SoftmaxTopK, Renormalize: true}, logits, nil)
	if !near(r.Weights[0]+r.Weights[1], 1, 1e-6) || !near(r.Weights[0], float32(math.Exp(1)/(1+math.Exp(1))), 1e-6) {
		t.Fatalf("renormalised weights %v", r.Weights)
	}
}

func TestTopKSoftmaxMatchesMixtral(t *testing.T) {
	// Mixtral: softmax over the two chosen logits.
	logits := []float32{0.5, -1, 2.5, 2}
	r, err := Route(&Config{Experts: 4, TopK: 2, Gating: TopKSoftmax}, logits, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r.Experts[0] != 2 || r.Experts[1] != 3 {
		t.Fatalf("experts %v", r.Experts)
	}
	w0 := float32(1 / (1 + math.Exp(-0.5)))
	if !near(r.Weights[0], w0, 1e-6) || !near(r.Weights[1], 1-w0, 1e-6) {
		t.Fatalf("weights %v", r.Weights)
	}
}

func TestTiesGoToLowerIndex(t *testing.T) {
	r, _ := Route(&Config{Experts: 5, TopK: 3, Gating: SoftmaxTopK}, []float32{1, 1, 1, 1, 1}, nil)
	if r.Experts[0] != 0 || r.Experts[1] != 1 || r.Experts[2] != 2 {
		t.Fatalf("%v", r.Experts)
	}
}

// DeepSeek-V3 gating against a direct transcription of the reference procedure.
func TestDeepSeekV3(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	E, G, TG, K := 16, 4, 2, 4
	bias := make([]float32, E)
	for i := range bias {
		bias[i] = float32(rng.NormFloat64() * 0.1)
	}
	cfg := &Config{Experts: E, TopK: K, Gating: DeepSeekV3, Groups: G, TopKGroups: TG, ScalingFactor: 2.5, Bias: bias, NormTopK: true}
	logits := randLogits(rng, 50, E)
	r, err := Route(cfg, logits, nil)
	if err != nil {
		t.Fatal(err)
	}
	for tok := 0; tok < 50; tok++ {
		row := logits[tok*E : (tok+1)*E]
		s := make([]float64, E)
		b := make([]float64, E)
		for e := range row {
			s[e] = 1 / (1 + math.Exp(-float64(row[e])))
			b[e] = s[e] + float64(bias[e])
		}
		// groups by sum of top-2 biased scores
		type gs struct {
			g int
			v float64
		}
		var groups []gs
		for g := 0; g < G; g++ {
			v := append([]float64(nil), b[g*4:(g+1)*4]...)
			best1, best2 := math.Inf(-1), math.Inf(-1)
			for _, x := range v {
				if x > best1 {
					best1, best2 = x, best1
				} else if x > best2 {
					best2 = x
				}
			}
			groups = append(groups, gs{g, best1 + best2})
		}
		allowed := map[int]bool{}
		for k := 0; k < TG; k++ {
			bi := -1
			for i, x := range groups {
				if !allowed[x.g] && (bi < 0 || x.v > groups[bi].v) {
					bi = i
				}
			}
			allowed[groups[bi].g] = true
		}
		chosen := map[int]bool{}
		var pick []int
		for k := 0; k < K; k++ {
			be := -1
			for e := 0; e < E; e++ {
				if allowed[e/4] && !chosen[e] && (be < 0 || b[e] > b[be]) {
					be = e
				}
			}
			chosen[be] = true
			pick = append(pick, be)
		}
		sum := 0.0
		for _, e := range pick {
			sum += s[e]
		}
		for j, e := range pick {
			if int(r.Experts[tok*K+j]) != e {
				t.Fatalf("token %d choice %d: got %d want %d", tok, j, r.Experts[tok*K+j], e)
			}
			if want := float32(s[e] / sum * 2.5); !near(r.Weights[tok*K+j], want, 1e-5) {
				t.Fatalf("token %d weight %d: got %v want %v", tok, j, r.Weights[tok*K+j], want)
			}
		}
	}
}

func TestHashRouting(t *testing.T) {
	ids := []int64{1, 2, 3, 4, 1}
	r, err := Route(&Config{Experts: 8, TopK: 3, Gating: Hash}, nil, ids)
	if err != nil {
		t.Fatal(err)
	}
	for tok := 0; tok < len(ids); tok++ {
		seen := map[int32]bool{}
		for j := 0; j < 3; j++ {
			e := r.Experts[tok*3+j]
			if e < 0 || e >= 8 || seen[e] || r.Weights[tok*3+j] != float32(1)/3 {
				t.Fatalf("token %d: %v %v", tok, r.Experts, r.Weights)
			}
			seen[e] = true
		}
	}
	for j := 0; j < 3; j++ {
		if r.Experts[j] != r.Experts[12+j] {
			t.Fatal("the same token id routed differently")
		}
	}
}

func TestCapacityDropsLowestFirst(t *testing.T) {
	// 4 tokens, all prefer expert 0; capacity factor 1 with k=1, E=2: capacity 2.
	logits := []float32{5, 0, 3, 0, 4, 0, 1, 0}
	r, err := Route(&Config{Experts: 2, TopK: 1, Gating: SoftmaxTopK, CapacityFactor: 1}, logits, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []int32{0, -1, 0, -1} // tokens 1 and 3 have the lowest weights for expert 0
	for i := range want {
		if r.Experts[i] != want[i] {
			t.Fatalf("got %v want %v", r.Experts, want)
		}
	}
	if r.Dropped != 2 || r.Stats().Dropped != 2 {
		t.Fatalf("dropped %d", r.Dropped)
	}
	// Dropless keeps everything.
	r, _ = Route(&Config{Experts: 2, TopK: 1, Gating: SoftmaxTopK}, logits, nil)
	if r.Dropped != 0 {
		t.Fatal("dropless dropped")
	}
}

func TestBadInput(t *testing.T) {
	cases := []struct {
		cfg    Config
		logits []float32
		want   error
	}{
		{Config{Experts: 4, TopK: 5, Gating: SoftmaxTopK}, make([]float32, 4), ErrConfig},
		{Config{Experts: 0, TopK: 1, Gating: SoftmaxTopK}, nil, ErrConfig},
		{Config{Experts: 4, TopK: 0, Gating: SoftmaxTopK}, make([]float32, 4), ErrConfig},
		{Config{Experts: 4, TopK: 1, Gating: 99}, make([]float32, 4), ErrConfig},
		{Config{Experts: 4, TopK: 1, Gating: SoftmaxTopK}, make([]float32, 5), ErrShape},
		{Config{Experts: 2, TopK: 1, Gating: SoftmaxTopK}, []float32{0, float32(math.NaN())}, ErrNonFinite},
		{Config{Experts: 2, TopK: 1, Gating: TopKSoftmax}, []float32{float32(math.Inf(1)), 0}, ErrNonFinite},
		{Config{Experts: 6, TopK: 2, Gating: DeepSeekV3, Groups: 4}, make([]float32, 6), ErrConfig},
		{Config{Experts: 8, TopK: 5, Gating: DeepSeekV3, Groups: 4, TopKGroups: 2}, make([]float32, 8), ErrConfig},
		{Config{Experts: 4, TopK: 1, Gating: SoftmaxTopK, CapacityFactor: -1}, make([]float32, 4), ErrConfig},
	}
	for i, c := range cases {
		if _, err := Route(&c.cfg, c.logits, nil); !errors.Is(err, c.want) {
			t.Errorf("case %d: got %v want %v", i, err, c.want)
		}
	}
	// Zero tokens is fine.
	r, err := Route(&Config{Experts: 4, TopK: 2, Gating: SoftmaxTopK}, nil, nil)
	if err != nil || r.T != 0 {
		t.Fatalf("zero tokens: %v", err)
	}
}

func TestPlacement(t *testing.T) {
	pl, err := NewPlacement(Contiguous, 10, 4)
	if err != nil {
		t.Fatal(err)
	}
	// 10 over 4: 3,3,2,2
	wantLocal := [][]int{{0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9}}
	for r, es := range wantLocal {
		if len(pl.Local[r]) != len(es) {
			t.Fatalf("rank %d: %v", r, pl.Local[r])
		}
		for i, e := range es {
			if pl.Local[r][i] != e || pl.LocalIndex(r, e) != i {
				t.Fatalf("rank %d: %v", r, pl.Local[r])
			}
		}
	}
	rr, _ := NewPlacement(RoundRobin, 10, 4)
	if rr.RankOf(6, 0, 0) != 2 || rr.LocalIndex(2, 6) != 1 {
		t.Fatal("round robin")
	}
	// Fewer experts than ranks.
	few, _ := NewPlacement(Contiguous, 2, 4)
	if few.RankOf(1, 0, 0) != 1 || len(few.Local[3]) != 0 {
		t.Fatal("fewer experts than ranks")
	}
	// Replicas: the origin's own replica first, else (o+t) mod replicas.
	if err := pl.Replicate([]int{0}, 3); err != nil {
		t.Fatal(err)
	}
	if got := pl.Owners[0]; len(got) != 3 || got[0] != 0 || got[1] != 1 || got[2] != 2 {
		t.Fatalf("owners %v", got)
	}
	if pl.RankOf(0, 1, 7) != 1 || pl.RankOf(0, 3, 0) != 0 || pl.RankOf(0, 3, 1) != 1 || pl.RankOf(0, 3, 2) != 2 {
		t.Fatal("replica rule")
	}
	if pl.LocalIndex(1, 0) != 0 || pl.Local[1][1] != 3 {
		t.Fatalf("rank 1 local %v", pl.Local[1])
	}
}

func TestLayoutOncePerRank(t *testing.T) {
	pl, _ := NewPlacement(Contiguous, 8, 4) // 2 experts per rank
	r := &Routing{T: 3, K: 3, E: 8,
		Experts: []int32{0, 1, 7, 2, -1, 4, 6, 7, 5},
		Weights: make([]float32, 9)}
	l, err := BuildLayout(r, pl, 0)
	if err != nil {
		t.Fatal(err)
	}
	// token 0 -> ranks 0 (experts 0,1: once) and 3; token 1 -> 1, 2; token 2 -> 3, 2
	want := [][]int32{{0}, {1}, {1, 2}, {0, 2}}
	for d := range want {
		if len(l.Rows[d]) != len(want[d]) {
			t.Fatalf("rank %d rows %v", d, l.Rows[d])
		}
		for i := range want[d] {
			if l.Rows[d][i] != want[d][i] {
				t.Fatalf("rank %d rows %v", d, l.Rows[d])
			}
		}
	}
	if l.Assignments != 8 || len(l.Dest[0]) != 2 {
		t.Fatalf("assignments %d dest %v", l.Assignments, l.Dest)
	}
	// The rank of every choice, in choice order; -1 for the dropped one.
	assert.Equal(t, []int32{0, 0, 3, 1, -1, 2, 3, 3, 2}, l.ChoiceRank)
	r.Experts[0] = 9
	if _, err := BuildLayout(r, pl, 0); !errors.Is(err, ErrConfig) {
		t.Fatalf("expert out of range: %v", err)
	}
}

func TestStats(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	r, _ := Route(&Config{Experts: 8, TopK: 2, Gating: SoftmaxTopK}, randLogits(rng, 1000, 8), nil)
	s := r.Stats()
	total := 0
	for _, n := range s.TokensPerExpert {
		total += n
	}
	if total != 2000 || s.MaxOverMean < 1 || s.MaxOverMean > 1.5 {
		t.Fatalf("stats %+v", s)
	}
	// Uniform routing has aux loss near 1 (its minimum); a router that sends everything to
	// one expert with full confidence has aux loss E.
	if s.AuxLoss < 0.9 || s.AuxLoss > 1.3 {
		t.Fatalf("aux loss %v", s.AuxLoss)
	}
	skew := make([]float32, 100*8)
	for i := 0; i < 100; i++ {
		skew[i*8] = 50
		skew[i*8+1] = 40
	}
	r, _ = Route(&Config{Experts: 8, TopK: 2, Gating: SoftmaxTopK}, skew, nil)
	if a := r.Stats().AuxLoss; a < 3.9 {
		t.Fatalf("skewed aux loss %v", a)
	}
	if Imbalance([]int{1, 1, 1, 5}) != 2.5 || Imbalance([]int{0, 0}) != 0 {
		t.Fatal("imbalance")
	}
}
