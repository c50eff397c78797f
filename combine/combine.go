// Package combine is the second stage of MoE expert parallelism: it brings the experts'
// outputs back to the ranks the tokens came from and sums them with the router's weights.
//
// Each expert rank first sums, weighted, the outputs of its experts for the same token
// (in the order of the token's choices), so one row per (token, rank) goes back, in one
// fused AlltoAllv over the layout the dispatch Handle remembers. The origin starts from the
// terms of the experts it holds itself (in the order of the token's choices), then adds
// the other ranks' partial sums in ascending rank order: a fixed order, so the result is
// bitwise identical run to run.
//
// What is guaranteed: for a fixed number of ranks, placement and wire type, Combine's
// output is bitwise reproducible whatever the timing. Across different rank counts the
// per-rank grouping of a token's experts changes, and with it the rounding of the sum:
// results then agree to a few float32 ulps of the largest term (f32 wire), or to bf16
// precision (bf16 wire), not bit for bit.
//
// combine owns its buffers (reused: no allocation per call in steady state); it must not
// import models.
package combine

import (
	"context"
	"errors"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/obuf"
	"gonum.org/v1/gonum/blas/blas32"
)

// Errors.
var (
	ErrInput = errors.New("combine: invalid input")
)

// Combiner brings expert outputs back. One per Dispatcher.
type Combiner struct {
	d     *dispatch.Dispatcher
	plan  coll.VPlan
	sendS obuf.Scratch
	recvS obuf.Scratch
	send  []byte
	recv  []byte
	part  []float32
	row   int
}

// New returns a combiner for the dispatches of d.
func New(d *dispatch.Dispatcher) *Combiner {
	cfg := d.Config()
	c := &Combiner{d: d, row: (cfg.Hidden*cfg.WireDType.Size() + 7) &^ 7}
	c.sendS.Pool, c.recvS.Pool = cfg.Pool, cfg.Pool
	return c
}

// Plan returns the AlltoAllv schedule of the last combine (for moex flow and debugging).
func (c *Combiner) Plan() *coll.VPlan { return &c.plan }

// RowBytes is the size of one partial sum on the wire.
func (c *Combiner) RowBytes() int { return c.row }

// Close gives the combiner's buffers back to their pool; it must not be used again.
func (c *Combiner) Close() {
	c.send, c.recv = nil, nil
	c.sendS.Release()
	c.recvS.Release()
}

// Combine takes the experts' outputs y (expert-major, the layout of the dispatch Output
// that h belongs to: Output.Rows() x Hidden) and writes into out (Tokens x Hidden) the
// weighted sum, for each of this rank's tokens, of its experts' outputs. Every rank must
// call it. Tokens whose every choice was dropped get zeros.
func (c *Combiner) Combine(ctx context.Context, h dispatch.Handle, y []float32, out []float32) error {
	d := c.d
	if h.Dispatcher() != d || !h.Valid() {
		return dispatch.ErrStale
	}
	cfg := d.Config()
	hid := cfg.Hidden
	comm := d.Comm()
	p, me := comm.Size(), comm.Rank()
	if len(out) != h.Tokens()*hid {
		return fmt.Errorf("%w: output of %d values for %d tokens of %d", ErrInput, len(out), h.Tokens(), hid)
	}
	if len(y) != h.Rows()*hid {
		return fmt.Errorf("%w: %d expert output values, the dispatch delivered %d rows of %d", ErrInput, len(y), h.Rows(), hid)
	}
	if err := comm.ReplanAlltoAllv(&c.plan, h.Back(), c.row); err != nil {
		return err
	}
	c.send = c.sendS.Bytes(c.plan.SendBytes())
	c.recv = c.recvS.Bytes(c.plan.RecvBytes())
	if cap(c.part) < hid {
		c.part = make([]float32, hid)
	}
	ownTokens := h.RowsTo(me) // incoming rows from this rank are its own tokens, in this order
	part := c.part[:hid]
	// Expert side: one weighted partial sum per incoming row. Rows of other origins are
	// summed straight into the send buffer (origin ascending); our own tokens' terms are
	// added straight into out.
	clear(out)
	off := 0
	for s := 0; s < p; s++ {
		a, b := h.Incoming(s)
		for i := a; i < b; i++ {
			rows, ws := h.Contributions(i)
			if s == me {
				t := int(ownTokens[i-a])
				dst := out[t*hid : (t+1)*hid]
				for j, r := range rows {
					axpy(dst, ws[j], y[int(r)*hid:(int(r)+1)*hid])
				}
				continue
			}
			dst := c.send[off : off+c.row]
			off += c.row
			acc := part
			if cfg.WireDType == dtype.F32 {
				acc = dtype.FromBytes[float32](dst[:hid*4])
			}
			clear(acc)
			for j, r := range rows {
				axpy(acc, ws[j], y[int(r)*hid:(int(r)+1)*hid])
			}
			if cfg.WireDType == dtype.BF16 {
				dtype.F32ToBF16(dtype.FromBytes[dtype.BFloat16](dst[:hid*2]), acc)
			}
		}
	}
	if err := comm.RunAlltoAllv(ctx, &c.plan, c.send, c.recv); err != nil {
		return err
	}
	// Origin side: add the other ranks' partial sums in ascending rank order.
	off = 0
	for q := 0; q < p; q++ {
		if q == me {
			continue
		}
		for _, t := range h.RowsTo(q) {
			src := c.recv[off : off+c.row]
			off += c.row
			dst := out[int(t)*hid : (int(t)+1)*hid]
			if cfg.WireDType == dtype.BF16 {
				addBF16(dst, dtype.FromBytes[dtype.BFloat16](src[:hid*2]))
			} else {
				addTo(dst, dtype.FromBytes[float32](src[:hid*4]))
			}
		}
	}
	return nil
}

// axpy: dst += a*x (gonum's assembly kernel).
func axpy(dst []float32, a float32, x []float32) {
	if len(dst) == 0 {
		return
	}
	blas32.Axpy(a, blas32.Vector{N: len(x), Inc: 1, Data: x}, blas32.Vector{N: len(dst), Inc: 1, Data: dst})
}

func addTo(dst, src []float32) { axpy(dst, 1, src) }

func addBF16(dst []float32, src []dtype.BFloat16) {
	for i, h := range src {
		dst[i] += h.Float32()
	}
}
