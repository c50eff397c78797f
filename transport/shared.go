package transport

import "context"

// SharedAreas is an optional capability of a transport whose ranks all share one host:
// collectives through shared-memory areas (one copy in, a flag per rank, one copy out; or
// a peer's buffer read in place), in place of messages. shm's Direct implements it; a
// communicator finds it through SharedAreasProvider and runs its AlltoAll(v), AllGather,
// AllReduce and ReduceScatter there when the buffers fit.
//
// Every rank calls the collectives in the same order, each with the turn Turn handed out
// for it; sig is the operation's signature, checked on every rank.
type SharedAreas interface {
	// Cap is the largest buffer the area takes; Fits reports whether an operation of n
	// bytes can run (through the area, or by reading peers' buffers in place).
	Cap() int
	Fits(n int) bool
	// Turn hands out the next operation's place in the areas' order.
	Turn() uint64
	// Wake makes a rank waiting in an area look at its context again (after an abort).
	Wake()
	// Waiting lists the ranks the current operation waits for (those that have not
	// published their part).
	Waiting() []int
	AllToAll(ctx context.Context, turn uint64, send, recv []byte, sig uint64) error
	AllToAllv(ctx context.Context, turn uint64, send, recv []byte, lay *VLayout, sig uint64) error
	AllReduce(ctx context.Context, turn uint64, send, recv []byte, es int, reduce func(dst, src []byte), sig uint64) error
	ReduceScatter(ctx context.Context, turn uint64, send, recv []byte, reduce func(dst, src []byte), sig uint64) error
}

// SharedAreasProvider is implemented by transports that may offer SharedAreas. It
// returns nil where they cannot (a single rank, no area): at most once per transport,
// for its one communicator of every rank.
type SharedAreasProvider interface {
	SharedAreas() SharedAreas
}

// VLayout is the layout of a shared-area AlltoAllv that every rank knows in full (the MoE
// dispatch and combine plan from the whole count matrix), in bytes. Rank q's block for
// this rank is RecvLen[q] bytes at SrcOff[q] of q's send buffer, which is SrcLen[q] bytes
// long, and lands at RecvOff[q] of recv. This rank's own block is SrcOff[r] of send.
// SrcLen decides how each rank publishes its send buffer (through its area when it
// fits), so every rank must agree on it: the operation's signature should cover the
// counts.
type VLayout struct {
	RecvOff, RecvLen, SrcOff, SrcLen []int
}
