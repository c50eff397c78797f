package transport

import (
	"time"

	"github.com/moex-ai/moex/busypoll"
)

// SharedSegment is an optional capability of a transport whose ranks all share one host
// (shm): every rank owns an area of memory that every rank maps. Package coll runs
// collectives through the areas (one copy in, a flag per rank, one copy out; or a peer's
// buffer read in place) in place of messages; the transport only lends the memory and
// what an algorithm over it needs of the operating system.
type SharedSegment interface {
	// Areas returns the ranks' areas, or nil where there are none (a single rank, areas
	// disabled, a peer on another host). One communicator claims them: a second call
	// returns nil.
	Areas() Areas
}

// AreaHeader is the bytes of words at the start of every area, which the algorithm
// lays out; the data space, 3 x Cap bytes, follows.
const AreaHeader = 256

// Areas are every rank's shared area, mapped here. A rank writes its own area only, and
// orders its writes and the others' reads with atomic operations on the header's words.
type Areas interface {
	// Area is rank q's area: AreaHeader bytes, then 3 x Cap bytes of data.
	Area(q int) []byte
	// Cap is the largest buffer an operation copies through an area (the smallest of
	// every rank's).
	Cap() int
	// Poller is the transport's busy-poll policy; Processes says the peers are other
	// processes (a waiter then yields to the kernel, not to Go's scheduler).
	Poller() *busypoll.Poller
	Processes() bool
	// Park sleeps while *word (a word of this rank's area) holds v, at most d, as the
	// transport's other sleeps do; it reports whether it timed out. Wake wakes whoever
	// sleeps on word.
	Park(word *uint32, v uint32, d time.Duration) (timedOut bool)
	Wake(word *uint32)
	// CanReadAcross reports whether ReadAcross works with every peer: it copies
	// len(dst) bytes at addr of rank q's memory into dst (cross-memory attach).
	CanReadAcross() bool
	ReadAcross(q int, dst []byte, addr uint64) error
	// ShareArena makes this process's shared arena (obuf.Shared) mappable by the peers;
	// ArenaData returns n bytes at off of rank q's, mapped here, or nil where they cannot
	// be read in place.
	ShareArena()
	ArenaData(q int, off uint64, n int) []byte
	// Hold keeps the mappings while an operation runs (false: the transport closed);
	// Release ends the hold. Closed reports whether the transport closed.
	Hold() bool
	Release()
	Closed() bool
	// PeerGone is the error of rank q gone (its process exited, or it closed), nil while
	// it lives.
	PeerGone(q int, op string) error
	// Rewind says operations alternate between the two halves of the data space (the
	// ranks outnumber the CPUs); Stream is 1 to copy blocks read in place with
	// non-temporal stores, 0 to decide by their size, -1 never.
	Rewind() bool
	Stream() int
	// Count adds to the transport's counters: operations, parks, parks that timed out,
	// bytes read in place from shared buffers and bytes read across.
	Count(ops, parks, timeouts, inPlace, across uint64)
}
