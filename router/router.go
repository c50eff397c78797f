// Package router is the planning half of MoE expert parallelism: gating (which experts
// each token goes to, with which weights), capacity limits, expert placement (which ranks
// hold which experts) and the dispatch layout (which ranks each token goes to, how many
// rows each rank receives), with load statistics.
//
// Everything here is a pure function of its inputs: no transport, no goroutines, so it is
// tested without processes and reused by `moex flow`. It must not import coll, dispatch
// or combine.
package router

import (
	"errors"
	"fmt"
	"math"
	"sort"

	"github.com/cespare/xxhash/v2"
)

// Gating selects how logits become expert choices and weights.
type Gating int

const (
	// SoftmaxTopK: softmax over all experts, then the top k probabilities (optionally
	// renormalised to sum to one). Qwen3, OLMoE, DBRX (renormalised), gpt-oss uses
	// TopKSoftmax.
	SoftmaxTopK Gating = iota + 1
	// TopKSoftmax: the top k logits, then softmax over those k (Mixtral, gpt-oss).
	TopKSoftmax
	// DeepSeekV3: sigmoid scores; a per-expert correction bias added for selection only
	// (auxiliary-loss-free balancing); experts in n_group groups, the topk_group groups
	// with the best sum of their top-2 biased scores are eligible; the top k eligible
	// experts are chosen; their unbiased scores are normalised and multiplied by
	// routed_scaling_factor.
	DeepSeekV3
	// Hash: the expert is a hash (xxhash64) of the token id; weights 1/k.
	Hash
)

func (g Gating) String() string {
	switch g {
	case SoftmaxTopK:
		return "softmax-topk"
	case TopKSoftmax:
		return "topk-softmax"
	case DeepSeekV3:
		return "deepseek-v3"
	case Hash:
		return "hash"
	}
	return fmt.Sprintf("gating(%d)", int(g))
}

// Config describes a router.
type Config struct {
	Experts     int    // routed experts
	TopK        int    // experts per token
	Gating      Gating // how scores become choices and weights
	Renormalize bool   // SoftmaxTopK: divide the chosen probabilities by their sum
	// DeepSeekV3 only.
	Groups        int       // n_group
	TopKGroups    int       // topk_group
	ScalingFactor float32   // routed_scaling_factor (0 means 1)
	Bias          []float32 // e_score_correction_bias, one per expert (nil: zeros)
	NormTopK      bool      // norm_topk_prob
	// CapacityFactor limits each expert to ceil(CapacityFactor * tokens * TopK / Experts)
	// assignments from this rank's tokens; the assignments with the lowest weights are
	// dropped first (ties: the later token). 0 means dropless.
	CapacityFactor float64
}

// Errors.
var (
	ErrConfig    = errors.New("router: invalid configuration")
	ErrNonFinite = errors.New("router: logits are not finite")
	ErrShape     = errors.New("router: input has the wrong shape")
)

// Validate checks the configuration.
func (c *Config) Validate() error {
	switch {
	case c.Experts < 1:
		return fmt.Errorf("%w: %d experts", ErrConfig, c.Experts)
	case c.TopK < 1 || c.TopK > c.Experts:
		return fmt.Errorf("%w: top-k %d with %d experts (want 1..%d)", ErrConfig, c.TopK, c.Experts, c.Experts)
	case c.Gating < SoftmaxTopK || c.Gating > Hash:
		return fmt.Errorf("%w: unknown gating %v", ErrConfig, c.Gating)
	case c.CapacityFactor < 0 || math.IsNaN(c.CapacityFactor):
		return fmt.Errorf("%w: capacity factor %v", ErrConfig, c.CapacityFactor)
	}
	if c.Gating == DeepSeekV3 {
		g := max(c.Groups, 1)
		if c.Experts%g != 0 {
			return fmt.Errorf("%w: %d experts do not split into %d groups", ErrConfig, c.Experts, g)
		}
		tg := c.TopKGroups
		if tg == 0 {
			tg = g
		}
		if tg < 1 || tg > g {
			return fmt.Errorf("%w: topk_group %d of %d groups", ErrConfig, tg, g)
		}
		if tg*(c.Experts/g) < c.TopK {
			return fmt.Errorf("%w: %d groups of %d experts cannot supply top-%d", ErrConfig, tg, c.Experts/g, c.TopK)
		}
		if c.Bias != nil && len(c.Bias) != c.Experts {
			return fmt.Errorf("%w: %d bias values for %d experts", ErrConfig, len(c.Bias), c.Experts)
		}
	}
	return nil
}

// Routing is the router's decision for T tokens: Experts[t*K+j] is the j-th choice of
// token t (-1 when dropped by capacity) and Weights[t*K+j] its weight. Choices of a token
// are in decreasing order of selection score.
type Routing struct {
	T, K    int       // tokens, and choices per token
	E       int       // experts
	Experts []int32   // T x K: token t's choices, -1 for a dropped one
	Weights []float32 // T x K: their weights
	// Probs[e] is the mean gate probability of expert e over the tokens (for the
	// auxiliary loss); Dropped counts assignments dropped by capacity.
	Probs   []float32
	Dropped int
}

// Route gates T tokens. logits is T x Experts, row-major (unused for Hash); tokenIDs
// (Hash only) has T entries.
func Route(c *Config, logits []float32, tokenIDs []int64) (*Routing, error) {
	r := &Routing{}
	return r, RouteInto(r, c, logits, tokenIDs)
}

// RouteInto is Route reusing r's storage.
func RouteInto(r *Routing, c *Config, logits []float32, tokenIDs []int64) error {
	if err := c.Validate(); err != nil {
		return err
	}
	E, K := c.Experts, c.TopK
	var T int
	if c.Gating == Hash {
		T = len(tokenIDs)
	} else {
		if len(logits)%E != 0 {
			return fmt.Errorf("%w: %d logits is not a multiple of %d experts", ErrShape, len(logits), E)
		}
		T = len(logits) / E
	}
	r.T, r.K, r.E, r.Dropped = T, K, E, 0
	r.Experts = grow(r.Experts, T*K)
	r.Weights = grow(r.Weights, T*K)
	r.Probs = grow(r.Probs, E)
	clear(r.Probs)
	if c.Gating == Hash {
		for t, id := range tokenIDs {
			hashChoose(r.Experts[t*K:(t+1)*K], id, E)
			for j := 0; j < K; j++ {
				r.Weights[t*K+j] = 1 / float32(K)
				r.Probs[r.Experts[t*K+j]] += 1 / float32(K) / float32(max(T, 1))
			}
		}
		return capacity(r, c)
	}
	probs := make([]float32, E)
	sel := make([]float32, E)
	idx := make([]int32, E)
	for t := 0; t < T; t++ {
		row := logits[t*E : (t+1)*E]
		for e, v := range row {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				return fmt.Errorf("%w: token %d, expert %d: %v", ErrNonFinite, t, e, v)
			}
		}
		ex, w := r.Experts[t*K:(t+1)*K], r.Weights[t*K:(t+1)*K]
		switch c.Gating {
		case SoftmaxTopK:
			softmax(probs, row)
			topK(ex, probs, idx)
			sum := float32(0)
			for j := range ex {
				w[j] = probs[ex[j]]
				sum += w[j]
			}
			if c.Renormalize {
				for j := range w {
					w[j] /= sum
				}
			}
		case TopKSoftmax:
			topK(ex, row, idx)
			softmax(probs, row) // for the statistics only
			m := row[ex[0]]
			sum := float32(0)
			for j := range ex {
				w[j] = float32(math.Exp(float64(row[ex[j]] - m)))
				sum += w[j]
			}
			for j := range w {
				w[j] /= sum
			}
		case DeepSeekV3:
			deepseek(c, row, ex, w, probs, sel, idx)
		}
		for e := range probs {
			r.Probs[e] += probs[e] / float32(T)
		}
	}
	return capacity(r, c)
}

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// softmax writes the softmax of x into dst (stable: subtract the max).
func softmax(dst, x []float32) {
	m := x[0]
	for _, v := range x {
		m = max(m, v)
	}
	sum := 0.0
	for i, v := range x {
		e := math.Exp(float64(v - m))
		dst[i] = float32(e)
		sum += e
	}
	for i := range dst {
		dst[i] = float32(float64(dst[i]) / sum)
	}
}

// topK writes the indices of the len(dst) largest scores into dst, largest first; ties go
// to the lower index. idx is scratch of len(scores).
func topK(dst []int32, scores []float32, idx []int32) {
	for i := range idx {
		idx[i] = int32(i)
	}
	// Partial selection: k is small.
	for j := range dst {
		best := j
		for i := j + 1; i < len(idx); i++ {
			a, b := scores[idx[i]], scores[idx[best]]
			if a > b || a == b && idx[i] < idx[best] {
				best = i
			}
		}
		idx[j], idx[best] = idx[best], idx[j]
		dst[j] = idx[j]
	}
}

func sigmoid(x float32) float32 { return float32(1 / (1 + math.Exp(-float64(x)))) }

func deepseek(c *Config, row []float32, ex []int32, w, probs, sel []float32, idx []int32) {
	E := c.Experts
	g := max(c.Groups, 1)
	tg := c.TopKGroups
	if tg == 0 {
		tg = g
	}
	per := E / g
	for e, v := range row {
		probs[e] = sigmoid(v)
		sel[e] = probs[e]
		if c.Bias != nil {
			sel[e] += c.Bias[e]
		}
	}
	if tg < g {
		// Group score: the sum of the group's two best biased scores.
		type gs struct {
			g     int
			score float32
		}
		groups := make([]gs, g)
		for gi := 0; gi < g; gi++ {
			b1, b2 := float32(math.Inf(-1)), float32(math.Inf(-1))
			for _, v := range sel[gi*per : (gi+1)*per] {
				if v > b1 {
					b1, b2 = v, b1
				} else if v > b2 {
					b2 = v
				}
			}
			if per == 1 {
				b2 = 0
			}
			groups[gi] = gs{gi, b1 + b2}
		}
		sort.SliceStable(groups, func(i, j int) bool { return groups[i].score > groups[j].score })
		keep := make([]bool, g)
		for _, x := range groups[:tg] {
			keep[x.g] = true
		}
		for gi := 0; gi < g; gi++ {
			if !keep[gi] {
				for e := gi * per; e < (gi+1)*per; e++ {
					sel[e] = float32(math.Inf(-1))
				}
			}
		}
	}
	topK(ex, sel, idx)
	sum := float32(0)
	for j := range ex {
		w[j] = probs[ex[j]]
		sum += w[j]
	}
	if c.NormTopK && sum > 0 {
		for j := range w {
			w[j] /= sum
		}
	}
	s := c.ScalingFactor
	if s == 0 {
		s = 1
	}
	for j := range w {
		w[j] *= s
	}
	// Statistics use the normalised scores as the gate distribution.
	total := float32(0)
	for _, p := range probs {
		total += p
	}
	for e := range probs {
		probs[e] /= total
	}
}

// hashChoose picks k distinct experts for a token id.
func hashChoose(dst []int32, id int64, E int) {
	var b [16]byte
	for j := range dst {
		for salt := uint64(0); ; salt++ {
			for i := 0; i < 8; i++ {
				b[i] = byte(uint64(id) >> (8 * i))
				b[8+i] = byte((uint64(j)<<32 | salt) >> (8 * i))
			}
			e := int32(xxhash.Sum64(b[:]) % uint64(E))
			dup := false
			for _, x := range dst[:j] {
				if x == e {
					dup = true
				}
			}
			if !dup {
				dst[j] = e
				break
			}
		}
	}
}

// Capacity returns the per-expert capacity for T tokens (0: unlimited).
func (c *Config) Capacity(T int) int {
	if c.CapacityFactor == 0 {
		return 0
	}
	return int(math.Ceil(c.CapacityFactor * float64(T*c.TopK) / float64(c.Experts)))
}

// capacity drops, per expert, the lowest-weight assignments beyond the capacity.
func capacity(r *Routing, c *Config) error {
	capE := c.Capacity(r.T)
	if capE == 0 {
		return nil
	}
	perExpert := make([][]int, r.E)
	for i, e := range r.Experts {
		perExpert[e] = append(perExpert[e], i)
	}
	for _, as := range perExpert {
		if len(as) <= capE {
			continue
		}
		sort.SliceStable(as, func(i, j int) bool {
			wi, wj := r.Weights[as[i]], r.Weights[as[j]]
			if wi != wj {
				return wi > wj
			}
			return as[i] < as[j]
		})
		for _, i := range as[capE:] {
			r.Experts[i] = -1
			r.Weights[i] = 0
			r.Dropped++
		}
	}
	return nil
}

// Stats summarises the load a routing puts on the experts.
type Stats struct {
	TokensPerExpert []int   // assignments per expert
	MaxOverMean     float64 // max / mean assignments per expert (1 = perfectly balanced)
	AuxLoss         float64 // Switch-style: E * sum_e f_e * P_e
	Dropped         int
}

// Stats computes the load statistics of r.
func (r *Routing) Stats() Stats {
	s := Stats{TokensPerExpert: make([]int, r.E), Dropped: r.Dropped}
	total := 0
	for _, e := range r.Experts {
		if e >= 0 {
			s.TokensPerExpert[e]++
			total++
		}
	}
	mx := 0
	for _, n := range s.TokensPerExpert {
		mx = max(mx, n)
	}
	if total > 0 {
		mean := float64(total) / float64(r.E)
		s.MaxOverMean = float64(mx) / mean
		for e, n := range s.TokensPerExpert {
			s.AuxLoss += float64(n) / float64(total) * float64(r.Probs[e])
		}
		s.AuxLoss *= float64(r.E)
	}
	return s
}
