package dispatch

import (
	"context"
	"fmt"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/router"
)

// TwoLevel is the dispatch for ranks on several hosts, in two stages, as DeepEP's
// internode kernels do it: a token crosses the network at most once per remote host,
// whatever the number of its experts there, and the host's ranks pass it on among
// themselves (over shared memory).
//
//   - Up: among the ranks with the same local index on every host (coll.Comm.SplitHosts),
//     a dispatch whose "ranks" are the hosts: each token goes once to the relay of every
//     host holding one of its experts (its own host's relay is the rank itself), with
//     the routing of all its experts there.
//   - Down: among the ranks of the host, a dispatch of the rows each rank relays (its
//     own tokens included) to the ranks that hold their experts.
//
// The experts see the down stage's Output: Expert holds global expert ids; Origin is
// the rank (of the communicator given to NewTwoLevel) that relayed the row and Source
// the row's index among that rank's relayed rows. Package combine's TwoLevel sums a
// token's expert outputs within each host first, and each host's sum crosses back once.
//
// Both stages run in cfg.Mode (normal or low-latency); the down stage takes cfg's Align
// and Quantized. Hosts must hold equal numbers of ranks. The stages fail as a dispatch
// does: a rank's bad input fails every rank in the same call.
type TwoLevel[T Act] struct {
	c            *coll.Comm
	intra, inter *coll.Comm
	up, down     *Dispatcher[T]
	global       []int32 // down's expert id -> global expert
	local        []int32 // global expert -> down's expert id (-1: not on this host)
	members      []int   // intra rank -> rank in c
	maxLocal     int     // Config.MaxLocalExperts
	r2           []router.Routing
	n            int // dispatches
	x2           obuf.Scratch
	inArrival    bool // the up stage's rows are in arrival order, a row per incoming row
}

// TwoLevelHandle is an opaque token for one two-level dispatch, for the two-level
// combine: the handles of its two stages.
type TwoLevelHandle struct {
	up, down Handle
}

// Valid reports whether both stages' handles still describe their buffers.
func (h TwoLevelHandle) Valid() bool { return h.up.Valid() && h.down.Valid() }

// Tokens is the number of this rank's tokens: the combined output has this many rows.
func (h TwoLevelHandle) Tokens() int { return h.up.Tokens() }

// Rows is the number of entries the down stage delivered to this rank: the expert
// outputs passed to the combine have this many rows.
func (h TwoLevelHandle) Rows() int { return h.down.Rows() }

// NewTwoLevel splits c by host (collectively: every rank calls it with the same cfg)
// and makes the two stages' dispatchers.
func NewTwoLevel[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*TwoLevel[T], error) {
	if cfg.Mode == Auto {
		// Both stages in the normal mode: the relays' down stage takes every host's
		// tokens for this host, which an Auto choice would size for none.
		cfg.Mode = Normal
	}
	cfg, err := Defaults[T](cfg)
	if err != nil {
		return nil, err
	}
	switch {
	case cfg.Mode == Gathered:
		return nil, fmt.Errorf("%w: the gathered mode has no two-level form", ErrConfig)
	case cfg.Placement.Ranks != c.Size():
		return nil, fmt.Errorf("%w: placement over %d ranks on a communicator of %d", ErrConfig, cfg.Placement.Ranks, c.Size())
	}
	intra, inter, err := c.SplitHosts(ctx)
	if err != nil {
		return nil, err
	}
	d := &TwoLevel[T]{c: c, intra: intra, inter: inter}
	fail := func(err error) (*TwoLevel[T], error) {
		d.Close()
		return nil, err
	}
	if inter == nil {
		return fail(fmt.Errorf("%w: a two-level dispatch needs hosts with equal numbers of ranks", ErrConfig))
	}
	hosts := make([]int, c.Size())
	for r := range hosts {
		hosts[r] = c.Host(r)
	}
	tl, err := newTwoLevel(cfg.Placement, hosts)
	if err != nil {
		return fail(err)
	}
	b := tl.hostIdx[c.Rank()]
	upPl, downPl := tl.up, tl.down[b]
	d.members, d.global, d.local = tl.members[b], tl.global[b], tl.localOf[b]
	if downPl == nil {
		return fail(fmt.Errorf("%w: no expert on the ranks of this host", ErrConfig))
	}
	if inter.Size() != len(tl.members) || intra.Size() != len(d.members) {
		return fail(fmt.Errorf("%w: %d hosts of %d ranks, but host communicators of %d and %d", ErrConfig, len(tl.members), len(d.members), inter.Size(), intra.Size()))
	}
	ucfg := cfg
	// A host holds at most its ranks' experts; a rank of the host, its own.
	ucfg.Placement, ucfg.Align, ucfg.Quantized, ucfg.Pool = upPl, 1, false, nil
	ucfg.MaxLocalExperts = min(upPl.Experts, cfg.MaxLocalExperts*len(d.members))
	// The up stage keeps a row once, in arrival order: the down stage's tokens as they are.
	if d.up, err = newWith[T](ctx, inter, ucfg, options{Arrival: true}); err != nil {
		return fail(err)
	}
	dcfg := cfg
	dcfg.Placement, dcfg.TopK = downPl, min(cfg.TopK, len(d.global))
	dcfg.MaxLocalExperts = min(downPl.Experts, cfg.MaxLocalExperts)
	dcfg.MaxTokens = cfg.MaxTokens * inter.Size() // every host's relay may send each token here
	if cfg.Mode != LowLatency {
		dcfg.MaxTokens = cfg.MaxTokens
	}
	if d.down, err = New[T](ctx, intra, dcfg); err != nil {
		return fail(err)
	}
	d.r2 = make([]router.Routing, cfg.InFlight)
	d.maxLocal = cfg.MaxLocalExperts
	d.inArrival = cfg.Mode == Normal // the normal mode keeps them so (Options.Arrival)
	d.x2.Pool = d.up.cfg.Pool
	return d, nil
}

// UsePlacement makes the dispatches that follow use pl, another layer's placement, as
// Dispatcher.UsePlacement does: the hosts' placement and this host's follow from it, and
// both stages keep their buffers. Every rank must call it alike. pl must leave experts on
// this host's ranks, at least the down stage's top-k of them, and give no rank more than
// MaxLocalExperts (ErrConfig; the stages then keep the placement they had).
func (d *TwoLevel[T]) UsePlacement(pl *router.Placement) error {
	if pl == nil {
		return fmt.Errorf("%w: no placement", ErrConfig)
	}
	if pl.Ranks != d.c.Size() {
		return fmt.Errorf("%w: placement over %d ranks on a communicator of %d", ErrConfig, pl.Ranks, d.c.Size())
	}
	if maxLocal(pl) > d.maxLocal {
		return fmt.Errorf("%w: a rank holds %d experts, MaxLocalExperts is %d", ErrConfig, maxLocal(pl), d.maxLocal)
	}
	hosts := make([]int, d.c.Size())
	for r := range hosts {
		hosts[r] = d.c.Host(r)
	}
	tl, err := newTwoLevel(pl, hosts)
	if err != nil {
		return err
	}
	b := tl.hostIdx[d.c.Rank()]
	if tl.down[b] == nil {
		return fmt.Errorf("%w: no expert on the ranks of this host", ErrConfig)
	}
	old := d.up.cfg.Placement
	if err := d.up.UsePlacement(tl.up); err != nil {
		return err
	}
	if err := d.down.UsePlacement(tl.down[b]); err != nil {
		d.up.UsePlacement(old)
		return err
	}
	d.global, d.local = tl.global[b], tl.localOf[b]
	return nil
}

// Up is the dispatcher of the stage across hosts; Down that of the stage within this
// host. They are the TwoLevel's: for their Stats, Bytes and Config, not to dispatch.
func (d *TwoLevel[T]) Up() *Dispatcher[T] { return d.up }

// Down is the dispatcher of the stage within this host (see Up).
func (d *TwoLevel[T]) Down() *Dispatcher[T] { return d.down }

// Dispatch sends this rank's tokens x (Tokens x Hidden) to the experts r chose (global
// expert ids) and returns what this rank's experts receive. Every rank must call it.
func (d *TwoLevel[T]) Dispatch(ctx context.Context, x []T, r *router.Routing) (*Output[T], TwoLevelHandle, error) {
	out1, h1, err := d.up.Dispatch(ctx, x, r)
	if err != nil {
		// The ranks of this host whose up stage went well wait in the down stage for
		// this one: it takes part there, failing their call too.
		return nil, TwoLevelHandle{}, d.down.Abandon(ctx, err)
	}
	// The rows this rank relays become the down stage's tokens, each with the choices
	// of this host's experts it came with.
	n := h1.IncomingRows()
	hid, k := d.up.cfg.Hidden, d.down.cfg.TopK
	r2 := &d.r2[d.n%len(d.r2)]
	d.n++
	r2.T, r2.K, r2.E, r2.Dropped = n, k, len(d.global), 0
	r2.Experts = growI32(r2.Experts, n*k)
	r2.Weights = growF32(r2.Weights, n*k)
	var x2 []T
	if d.inArrival {
		x2 = out1.x[:n*hid] // row i of x is incoming row i
	} else { // the rows stay where they arrived: gathered here
		x2 = dtype.FromBytes[T](d.x2.Bytes(n * hid * d.up.act.Size()))
	}
	for i := 0; i < n; i++ {
		entries, ws := h1.Contributions(i)
		if !d.inArrival {
			copy(x2[i*hid:(i+1)*hid], out1.Entry(int(entries[0])))
		}
		for j := 0; j < k; j++ {
			e, w := int32(-1), float32(0)
			if j < len(entries) {
				e, w = d.local[out1.Expert[entries[j]]], ws[j]
			}
			r2.Experts[i*k+j], r2.Weights[i*k+j] = e, w
		}
	}
	out2, h2, err := d.down.Dispatch(ctx, x2, r2)
	if err != nil {
		return nil, TwoLevelHandle{}, err
	}
	for j, e := range out2.Expert {
		if e >= 0 {
			out2.Expert[j] = d.global[e]
		}
		if o := out2.Origin[j]; o >= 0 {
			out2.Origin[j] = int32(d.members[o])
		}
	}
	return out2, TwoLevelHandle{up: h1, down: h2}, nil
}

// Bytes is the memory this rank holds for both stages' buffers (Dispatcher.Bytes of
// each, and the relayed rows). It is 0 after Close.
func (d *TwoLevel[T]) Bytes() int {
	n := d.x2.Cap()
	for _, x := range []*Dispatcher[T]{d.down, d.up} {
		if x != nil {
			n += x.Bytes()
		}
	}
	return n
}

// Close releases both stages and the host communicators.
func (d *TwoLevel[T]) Close() error {
	d.x2.Release()
	for _, x := range []*Dispatcher[T]{d.down, d.up} {
		if x != nil {
			x.Close()
		}
	}
	for _, c := range []*coll.Comm{d.inter, d.intra} {
		if c != nil {
			c.Close()
		}
	}
	return nil
}

// TwoLevelCombiner combines the dispatches of a TwoLevel: the stage within the host
// sums, on the rank that relayed each row, the weighted outputs of the host's experts
// for it, and the stage across hosts sends each host's sum back to the token's rank
// once, where the hosts' sums are added in ascending order of host. Bitwise
// reproducible for a fixed placement, as Combiner is; grouped by host, then by rank, so
// it agrees with the flat combine to rounding, not bit for bit.
type TwoLevelCombiner[T Out] struct {
	up, down *Combiner[T]
	hidden   int
	mid      obuf.Scratch // each relayed row's host sum
}

// NewTwoLevelCombiner returns the combiner of d's dispatches (collective in the
// low-latency mode, as NewCombiner is). An fp8 or int8 PartialDType applies to the host
// sums that cross hosts; within a host the partial sums travel in the outputs' type.
// SumAtOrigin is refused: the two-level path sums each host's terms there.
func NewTwoLevelCombiner[T Out](ctx context.Context, d *TwoLevel[T], ccfg CombineConfig) (*TwoLevelCombiner[T], error) {
	if ccfg.SumAtOrigin {
		return nil, fmt.Errorf("%w: SumAtOrigin on the two-level path, which sums each host's terms there", ErrConfig)
	}
	within := ccfg
	if q := ccfg.PartialDType; q == dtype.FP8E4M3 || q == dtype.I8 {
		within.PartialDType = 0 // quantised across hosts only: within, the outputs' type
	}
	down, err := NewCombiner[T](ctx, d.down, within)
	if err != nil {
		return nil, err
	}
	up, err := NewCombiner[T](ctx, d.up, ccfg)
	if err != nil {
		down.Close()
		return nil, err
	}
	cb := &TwoLevelCombiner[T]{up: up, down: down, hidden: d.up.cfg.Hidden}
	cb.mid.Pool = d.up.cfg.Pool
	return cb, nil
}

// Combine takes the experts' outputs y (a row per entry of the dispatch's Output, as
// Combiner.Combine does) and writes this rank's tokens' weighted sums into out. Every
// rank must call it.
func (cb *TwoLevelCombiner[T]) Combine(ctx context.Context, h TwoLevelHandle, y, out []T) error {
	n := 0
	if h.up.s != nil {
		n = h.up.IncomingRows()
	}
	mid := dtype.FromBytes[T](cb.mid.Bytes(n * cb.hidden * outType[T]().Size()))
	if err := cb.down.Combine(ctx, h.down, y, mid); err != nil {
		// The ranks of other hosts wait in the up stage for this one: it takes part
		// there, failing their call too.
		return cb.up.abandon(ctx, err)
	}
	return cb.up.CombineRows(ctx, h.up, mid, out)
}

// Up is the combiner of the stage across hosts; Down that of the stage within this
// host. They are the TwoLevel's: for their Stats, Bytes and Config, not to combine.
func (cb *TwoLevelCombiner[T]) Up() *Combiner[T] { return cb.up }

// Down is the combiner of the stage within this host (see Up).
func (cb *TwoLevelCombiner[T]) Down() *Combiner[T] { return cb.down }

// Bytes is the memory this rank holds for both stages' buffers (Combiner.Bytes of each,
// and the relayed rows' host sums). It is 0 after Close.
func (cb *TwoLevelCombiner[T]) Bytes() int {
	return cb.mid.Cap() + cb.up.Bytes() + cb.down.Bytes()
}

// Close releases both stages' buffers.
func (cb *TwoLevelCombiner[T]) Close() error {
	cb.mid.Release()
	cb.up.Close()
	return cb.down.Close()
}
