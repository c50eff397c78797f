package models

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"
	"gorgonia.org/tensor"

	"github.com/moex-ai/moex/router"
)

// ErrTooLarge: the layer's weights do not fit the memory budget.
var ErrTooLarge = errors.New("models: layer does not fit in memory")

// Layer is a reference MoE layer. Weights are drawn from a seed per (expert, matrix), so
// a rank that materialises only its own experts gets the very weights the single-rank
// reference uses.
type Layer struct {
	Cfg    Config        // the model
	Router router.Config // its router
	Gate   []float32     // Experts x Hidden
	// Per materialised expert e: W1 and W3 (FFN x Hidden: gate and up projections) and
	// W2 (Hidden x FFN: down projection). Nil for experts not materialised.
	W1, W3, W2 [][]float32
	// Shared experts, applied to every token.
	S1, S3, S2 [][]float32
}

// NewLayer builds the layer's router and the routed experts listed in experts (nil: all)
// plus the shared experts, refusing when they would need more than maxBytes (0: no
// limit).
func NewLayer(cfg Config, seed uint64, experts []int, maxBytes int64) (*Layer, error) {
	return newLayer(cfg, seed, experts, maxBytes, true)
}

// NewRoutedLayer is NewLayer without the shared experts, for a rank that runs only the
// routed part of the layer (Layer.SharedForward then adds nothing): the router and the
// routed experts listed in experts (nil: all; empty: the router alone).
func NewRoutedLayer(cfg Config, seed uint64, experts []int, maxBytes int64) (*Layer, error) {
	return newLayer(cfg, seed, experts, maxBytes, false)
}

func newLayer(cfg Config, seed uint64, experts []int, maxBytes int64, shared bool) (*Layer, error) {
	if experts == nil {
		experts = make([]int, cfg.Experts)
		for i := range experts {
			experts[i] = i
		}
	}
	nShared := 0
	if shared {
		nShared = cfg.Shared
	}
	need := 4 * (int64(len(experts))*cfg.ExpertParams() + int64(nShared)*3*int64(cfg.Hidden)*int64(cfg.SharedSize()) +
		int64(cfg.Experts)*int64(cfg.Hidden))
	if maxBytes > 0 && need > maxBytes {
		return nil, fmt.Errorf("%w: %s needs %.1f GiB of float32 weights for %d experts, the budget is %.1f GiB",
			ErrTooLarge, cfg.Name, float64(need)/(1<<30), len(experts), float64(maxBytes)/(1<<30))
	}
	l := &Layer{Cfg: cfg, Router: cfg.RouterConfig()}
	l.Gate = randn(seed, 0, 0, cfg.Experts*cfg.Hidden, 1/math.Sqrt(float64(cfg.Hidden)))
	if cfg.Gating == router.DeepSeekV3 {
		l.Router.Bias = randn(seed, 0, 1, cfg.Experts, 0.01)
	}
	l.W1, l.W3, l.W2 = make([][]float32, cfg.Experts), make([][]float32, cfg.Experts), make([][]float32, cfg.Experts)
	for _, e := range experts {
		if e < 0 || e >= cfg.Experts {
			return nil, fmt.Errorf("models: expert %d of %d", e, cfg.Experts)
		}
		l.W1[e], l.W3[e], l.W2[e] = ffn(seed, 1+e, cfg.Hidden, cfg.ExpertFFN)
	}
	for s := 0; s < nShared; s++ {
		w1, w3, w2 := ffn(seed, 1+cfg.Experts+s, cfg.Hidden, cfg.SharedSize())
		l.S1, l.S3, l.S2 = append(l.S1, w1), append(l.S3, w3), append(l.S2, w2)
	}
	return l, nil
}

func ffn(seed uint64, id, hid, f int) (w1, w3, w2 []float32) {
	return randn(seed, id, 1, f*hid, 1/math.Sqrt(float64(hid))),
		randn(seed, id, 3, f*hid, 1/math.Sqrt(float64(hid))),
		randn(seed, id, 2, hid*f, 1/math.Sqrt(float64(f)))
}

// randn draws n normal values with standard deviation std from (seed, id, which).
func randn(seed uint64, id, which, n int, std float64) []float32 {
	rng := rand.New(rand.NewPCG(seed, uint64(id)<<8|uint64(which)))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * std)
	}
	return x
}

// gemmNT: c (m x n) = a (m x k) * b^T, b being n x k (all row-major).
func gemmNT(m, n, k int, a, b, c []float32) {
	if m == 0 || n == 0 {
		return
	}
	blas32.Gemm(blas.NoTrans, blas.Trans, 1,
		blas32.General{Rows: m, Cols: k, Stride: k, Data: a},
		blas32.General{Rows: n, Cols: k, Stride: k, Data: b},
		0, blas32.General{Rows: m, Cols: n, Stride: n, Data: c})
}

// Logits computes the router logits of rows tokens (rows x Hidden) into out (rows x Experts).
func (l *Layer) Logits(x []float32, rows int, out []float32) {
	gemmNT(rows, l.Cfg.Experts, l.Cfg.Hidden, x, l.Gate, out)
}

// Expert runs routed expert e (SwiGLU: W2 (silu(W1 x) * W3 x)) on rows inputs, writing
// rows outputs. scratch needs 2*rows*ExpertFFN floats (nil: allocated).
func (l *Layer) Expert(e int, in []float32, rows int, out, scratch []float32) error {
	if l.W1[e] == nil {
		return fmt.Errorf("models: expert %d is not materialised on this rank", e)
	}
	swiglu(l.W1[e], l.W3[e], l.W2[e], l.Cfg.Hidden, l.Cfg.ExpertFFN, in, rows, out, scratch)
	return nil
}

func swiglu(w1, w3, w2 []float32, hid, f int, in []float32, rows int, out, scratch []float32) {
	if rows == 0 {
		return
	}
	if len(scratch) < 2*rows*f {
		scratch = make([]float32, 2*rows*f)
	}
	g, u := scratch[:rows*f], scratch[rows*f:2*rows*f]
	gemmNT(rows, f, hid, in, w1, g)
	gemmNT(rows, f, hid, in, w3, u)
	for i, v := range g {
		g[i] = v / (1 + float32(math.Exp(-float64(v)))) * u[i]
	}
	gemmNT(rows, hid, f, g, w2, out)
}

// SharedForward adds the shared experts' outputs for rows tokens to out.
func (l *Layer) SharedForward(in []float32, rows int, out []float32) {
	if len(l.S1) == 0 || rows == 0 {
		return
	}
	tmp := make([]float32, rows*l.Cfg.Hidden)
	for s := range l.S1 {
		swiglu(l.S1[s], l.S3[s], l.S2[s], l.Cfg.Hidden, l.Cfg.SharedSize(), in, rows, tmp, nil)
		for i, v := range tmp {
			out[i] += v
		}
	}
}

// Route gates rows tokens.
func (l *Layer) Route(x []float32, rows int) (*router.Routing, error) {
	logits := make([]float32, rows*l.Cfg.Experts)
	l.Logits(x, rows, logits)
	return router.Route(&l.Router, logits, nil)
}

// Forward is the reference: every token through the router, its top-k experts (summed
// with the router weights in the order of its choices) and the shared experts, on this
// one rank. x is a float32 tensor of shape (tokens, hidden).
func (l *Layer) Forward(x *tensor.Dense) (*tensor.Dense, error) {
	in, rows, err := l.input(x)
	if err != nil {
		return nil, err
	}
	r, err := l.Route(in, rows)
	if err != nil {
		return nil, err
	}
	hid, k := l.Cfg.Hidden, l.Cfg.TopK
	out := make([]float32, rows*hid)
	tmp := make([]float32, hid)
	for t := 0; t < rows; t++ {
		row := out[t*hid : (t+1)*hid]
		for j := 0; j < k; j++ {
			e := int(r.Experts[t*k+j])
			if e < 0 {
				continue
			}
			if err := l.Expert(e, in[t*hid:(t+1)*hid], 1, tmp, nil); err != nil {
				return nil, err
			}
			w := r.Weights[t*k+j]
			for i, v := range tmp {
				row[i] += w * v
			}
		}
	}
	l.SharedForward(in, rows, out)
	return tensor.New(tensor.WithShape(rows, hid), tensor.WithBacking(out)), nil
}

func (l *Layer) input(x *tensor.Dense) ([]float32, int, error) {
	if x.Dtype() != tensor.Float32 {
		return nil, 0, fmt.Errorf("models: input is %v, want float32", x.Dtype())
	}
	s := x.Shape()
	if len(s) != 2 || s[1] != l.Cfg.Hidden {
		return nil, 0, fmt.Errorf("models: input shape %v, want (tokens, %d)", s, l.Cfg.Hidden)
	}
	return Floats(x), s[0], nil
}

// Floats returns a float32 tensor's data ([]float32{} for an empty one: gorgonia's Data
// panics on those).
func Floats(x *tensor.Dense) []float32 {
	if x.Shape().TotalSize() == 0 {
		return []float32{}
	}
	return x.Data().([]float32)
}

// Tokens returns n tokens of activations drawn from (seed, rank), as a (n, hidden) tensor.
func (c Config) Tokens(seed uint64, rank, n int) *tensor.Dense {
	x := randn(seed^0x5eed, 1<<20+rank, 7, n*c.Hidden, 1)
	return tensor.New(tensor.WithShape(n, c.Hidden), tensor.WithBacking(x))
}
