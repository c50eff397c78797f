package coll

import (
	"context"
	"errors"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"

	"github.com/moex-ai/moex/transport"
)

// A Board is memory that each rank fills and every other rank reads in place: one
// window of Size bytes per rank, which every rank of the communicator has mapped (inproc,
// or shm with every rank on one host). Reading a peer's data there costs one pass over
// it, by the reader, and nothing is copied on the way.
//
// A Board has no synchronisation of its own. Its users order a rank's writes and the
// others' reads with another collective between them (an Exchange whose blocks say that
// the data is in place, say), and must not write again what another rank may still
// read: a rank learns that its peers are done with some data from a later collective
// that they can only have entered afterwards.
type Board struct {
	c    *Comm
	win  transport.Window
	size int
	span []byte
}

// ErrNoBoard: some pair of ranks cannot map each other's memory (ranks on other hosts,
// a transport without windows, or Config.NoWindows), so there is no Board.
var ErrNoBoard = errors.New("coll: not every rank can read every rank's memory")

// NewBoard makes a Board of size bytes per rank on c, zeroed. It is collective: every
// rank calls it with the same size, and every rank returns ErrNoBoard (errors.Is) alike
// when some pair of ranks cannot reach each other's memory.
func (c *Comm) NewBoard(ctx context.Context, size int) (*Board, error) {
	return c.newBoard(ctx, size, false)
}

// NewSpanBoard is NewBoard for a Board whose parts every rank also sees side by side,
// as one slice (Span): rank q's part starts at q*Stride(). Where some rank cannot map
// them so (a transport without transport.SpanTransport), every rank returns ErrNoBoard.
func (c *Comm) NewSpanBoard(ctx context.Context, size int) (*Board, error) {
	return c.newBoard(ctx, size, true)
}

func (c *Comm) newBoard(ctx context.Context, size int, span bool) (*Board, error) {
	if size < 1 || size > transport.MaxWindow {
		return nil, &ArgError{Arg: "size", Reason: fmt.Sprintf("%d bytes (want 1..%d)", size, transport.MaxWindow)}
	}
	if c.size == 1 {
		return nil, fmt.Errorf("%w: a single rank", ErrNoBoard)
	}
	sig := algos.Signature(OpExchange, AlgoAuto, 1, -1, size)
	if span {
		sig ^= 0x5a5a0000 // a span board is not a plain one: both sides must ask for it
	}
	win, maps, mem, err := c.openWindowSpan(ctx, sig, size, "a board", span)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Board, error) {
		if win != nil {
			win.Close()
		}
		return nil, err
	}
	if i, j, some := unmapped(maps, c.size); some {
		return fail(fmt.Errorf("%w: rank %d cannot map rank %d's", ErrNoBoard, i, j))
	}
	if span && mem == nil {
		return fail(fmt.Errorf("%w: not every rank can map the parts side by side", ErrNoBoard))
	}
	return &Board{c: c, win: win, size: size, span: mem}, nil
}

// Span is every rank's part side by side, rank q's at q*Stride() (NewSpanBoard), to be
// read in place; nil for a Board from NewBoard.
func (b *Board) Span() []byte { return b.span }

// Stride is the distance between two ranks' parts in Span: Size rounded up to the page.
func (b *Board) Stride() int { return transport.SpanStride(b.size) }

// Size is the bytes of each rank's part.
func (b *Board) Size() int { return b.size }

// Local is this rank's part, for it to fill.
func (b *Board) Local() []byte { return b.win.Local()[:b.size:b.size] }

// Peer is rank q's part (this rank's own for q == Rank), to be read in place.
func (b *Board) Peer(q int) []byte {
	if q == b.c.rank {
		return b.Local()
	}
	return b.win.Remote(b.c.ranks[q])[:b.size:b.size]
}

// Close unmaps the board. It is local; no rank may read this rank's part afterwards
// (close after a collective that follows every read).
func (b *Board) Close() error {
	if b.win == nil {
		return nil
	}
	err := b.win.Close()
	b.win, b.span = nil, nil
	return err
}
