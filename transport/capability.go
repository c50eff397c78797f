package transport

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// Capabilities beyond point-to-point that some transports have, found by type assertion.
// Code outside the transports asks for these, never for a concrete transport.

// Counters is what a transport has moved so far, in the units every transport has; a
// field a transport does not count stays 0.
type Counters struct {
	MessagesOut, MessagesIn uint64 // messages (tcp: frames)
	BytesOut, BytesIn       uint64 // payload bytes
	Syscalls                uint64 // system calls that moved data (tcp: writes and reads)
	Slots                   uint64 // shared-memory ring slots written (shm sends make no system call)
	RMAOps                  uint64 // one-sided operations posted: puts, gets, signals (ucx windows)
}

// Add returns the sum of c and o.
func (c Counters) Add(o Counters) Counters {
	return Counters{c.MessagesOut + o.MessagesOut, c.MessagesIn + o.MessagesIn, c.BytesOut + o.BytesOut,
		c.BytesIn + o.BytesIn, c.Syscalls + o.Syscalls, c.Slots + o.Slots, c.RMAOps + o.RMAOps}
}

// Counting is implemented by transports that count their traffic.
type Counting interface {
	Counters() Counters
}

// Killer is implemented by transports that can stop as a crash would, without telling
// their peers: for fault injection in tests and in the recovery benchmark.
type Killer interface {
	Kill()
}

// CountersOf sums the counters of t (of every transport a Mux routes to); ok is false
// where none counts.
func CountersOf(t Transport) (c Counters, ok bool) {
	if m, isMux := t.(*Mux); isMux {
		for _, u := range m.all {
			if uc, uok := CountersOf(u); uok {
				c, ok = c.Add(uc), true
			}
		}
		return c, ok
	}
	if ct, isCounting := t.(Counting); isCounting {
		return ct.Counters(), true
	}
	return c, false
}

// Kill stops t (every transport of a Mux) as a crash would; it reports whether t could be
// killed.
func Kill(t Transport) bool {
	if m, isMux := t.(*Mux); isMux {
		killed := false
		for _, u := range m.all {
			killed = Kill(u) || killed
		}
		return killed
	}
	if k, ok := t.(Killer); ok {
		k.Kill()
		return true
	}
	return false
}

// Readmitter is implemented by transports that can give a dead peer's rank to a new
// process, one that took the rank over while the job runs (tcp and shm: Transport.Readmit).
type Readmitter interface {
	// Readmit connects this rank to the process waiting at addr that took over rank
	// peer, telling it the live ranks (members, this one among them, as every one of
	// them names them); from then on operations with peer reach the new process.
	Readmit(ctx context.Context, peer int, addr string, members []int) error
	// Evict undoes a Readmit whose admission the live ranks then abandoned (another live
	// rank could not connect): the connection to peer is closed, and operations with it
	// fail with ErrEvicted (a PeerError), as with a peer that died. It is a no-op for a
	// peer already failed.
	Evict(peer int)
}

// ErrEvicted is what operations with a peer fail with once Evict undid its admission.
var ErrEvicted = fmt.Errorf("%w: its admission was abandoned", ErrPeerClosed)

// CheckReadmit checks a Readmit's arguments on rank of size ranks: peer is another rank,
// and members (the live ranks) hold rank and not peer.
func CheckReadmit(rank, size, peer int, members []int) error {
	switch {
	case peer == rank || peer < 0 || peer >= size:
		return &ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d of %d, this one %d", peer, size, rank)}
	case !slices.Contains(members, rank) || slices.Contains(members, peer) || len(members) >= size:
		return &ArgError{Arg: "members", Reason: fmt.Sprintf("%v: the live ranks, with %d and without %d", members, rank, peer)}
	}
	return nil
}

// ErrNoReadmit: no transport of a Mux can take a joiner.
var ErrNoReadmit = errors.New("transport: no transport here takes a joiner")

// ReadmitterOf is what gives peer's rank of t to a new process: t where it is a
// Readmitter (a Mux is, where one of its transports is); nil where there is none.
func ReadmitterOf(t Transport, peer int) Readmitter {
	if m, isMux := t.(*Mux); isMux {
		if peer < 0 || peer >= m.size || !slices.ContainsFunc(m.all, func(t Transport) bool { _, ok := t.(Readmitter); return ok }) {
			return nil
		}
		return m
	}
	r, _ := t.(Readmitter)
	return r
}
