package transport

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/moex-ai/moex/obuf"
)

// WindowTransport is implemented by transports whose ranks can write straight into one
// another's memory: inproc (one address space) and shm (shared mappings). A window is a
// block of one rank's memory that its peers write with plain stores and then notify:
// one-sided puts, so that an exchange writes each block once, from the sender's data
// into the receiver's buffer (coll.Exchange uses them).
//
// Windows are made collectively, with the help of the caller: every rank calls
// NewWindow, the ranks swap the descriptors it returns (coll all-gathers them), each
// maps the others' with Map, and once every rank has mapped every window (a barrier)
// each calls Seal. A window outlives neither its Close nor the process.
type WindowTransport interface {
	// NewWindow allocates this rank's window of size bytes, zeroed, and returns it with a
	// descriptor for the other ranks' Map. size is bounded by MaxWindow.
	NewWindow(size int) (Window, []byte, error)
}

// MaxWindow is the largest window NewWindow makes.
const MaxWindow = 16 << 30

// CheckNewWindow is NewWindow's check of its arguments, for every transport alike: size
// within 0..MaxWindow (an *ArgError naming it), and the transport open (ErrClosed).
func CheckNewWindow(size int, closed bool) error {
	switch {
	case size < 0 || size > MaxWindow:
		return &ArgError{Arg: "size", Reason: fmt.Sprintf("%d bytes (want 0..%d)", size, MaxWindow)}
	case closed:
		return ErrClosed
	}
	return nil
}

// MaxWindowDesc is the longest descriptor NewWindow returns (a UCX window's carries its
// packed remote key).
const MaxWindowDesc = 1024

// ErrNoWindow is returned by Map for a peer whose memory this transport cannot reach
// (another host); exchanges with that peer go through messages instead.
var ErrNoWindow = errors.New("transport: peer's window cannot be mapped here")

// Window is one rank's view of a set of windows: its own, and the peers' it mapped.
//
// The memory of a window is plain memory: writers and readers order their accesses with
// sync/atomic on words inside it (a writer fills a block, then stores a flag; the reader
// loads the flag, then reads the block). Notify and Wait only wake and park.
type Window interface {
	// Local is this rank's window.
	Local() []byte
	// Map maps peer's window (peer: a transport rank) from the descriptor its NewWindow
	// returned. It returns an error wrapping ErrNoWindow when the peer is out of reach.
	Map(peer int, desc []byte) error
	// Remote is peer's window, writable; nil unless mapped.
	Remote(peer int) []byte
	// Seal says every rank has mapped every window: nothing more will be mapped (shm
	// unlinks its file, so that nothing is left behind however the processes end).
	Seal()
	// Notify wakes peer if it waits in Wait (call it after the stores it should see).
	Notify(peer int)
	// Wait returns when ready() holds, polling it under the transport's busy-poll policy
	// and parking until a Notify (or a few milliseconds) when the policy says so. It
	// returns ctx's error if ctx ends first. Waits of several goroutines may overlap.
	Wait(ctx context.Context, ready func() bool) error
	// Close unmaps everything; the window must not be used afterwards.
	Close() error
}

// SpanTransport is implemented by window transports that can also map a set of windows
// side by side (shm; inproc on Linux): a reader then sees every rank's window as one
// slice, each at a fixed stride, and can hand out one view of rows that live in many
// ranks' memory (a dispatch whose experts read the tokens where their origins wrote them).
type SpanTransport interface {
	WindowTransport
	// NewSpanWindow is NewWindow for a window that Span can map. Windows are made and
	// mapped as NewWindow's are; Span comes after every Map and before Seal.
	NewSpanWindow(size int) (SpanWindow, []byte, error)
}

// SpanWindow is a Window that can be mapped side by side with its peers'.
type SpanWindow interface {
	Window
	// Span maps the windows of peers (transport ranks, this rank's own included, each
	// one mapped), in that order, into one range of addresses: peers[i]'s window starts
	// at i*SpanStride(size). Writes through the span and through Local or Remote reach
	// the same memory. The span lives until Close; a second call returns the first span.
	Span(peers []int) ([]byte, error)
}

// SpanStride is the distance between two windows of size bytes in a span: size rounded
// up to the page size.
func SpanStride(size int) int {
	pg := os.Getpagesize()
	return (size + pg - 1) / pg * pg
}

// RMATransport is implemented by window transports whose windows are RMAWindows (ucx):
// a caller that needs windows it can address (a span, a board) does not ask them for one.
type RMATransport interface {
	WindowTransport
	// RMAWindows reports that NewWindow returns RMAWindows.
	RMAWindows() bool
}

// RMAWindow is the Window of a transport whose peers' windows this rank cannot address
// (ucx: memory registered once with ucp_mem_map, written with ucp_put_nbx: the way RDMA
// NICs are used). Remote is nil; the rank reaches them with Put, Get and Signal once Map has taken their descriptors. Nothing is
// matched at the owner: a writer puts its data, fences, then signals a word that the
// owner polls in its own memory (Wait), as DeepEP and NVSHMEM programs do.
type RMAWindow interface {
	Window
	// Reaches reports whether peer's window was mapped (its key is held).
	Reaches(peer int) bool
	// Put posts a write of src at off of peer's window. The request completes when src
	// may be reused, not when the bytes are visible at peer: a later Signal, after a
	// Fence, says that.
	Put(peer, off int, src []byte) (Request, error)
	// Get posts a read of len(dst) bytes at off of peer's window; it completes when dst
	// holds them.
	Get(peer, off int, dst []byte) (Request, error)
	// Signal adds delta, atomically, to the 64-bit word at off (8-byte aligned) of peer's
	// window: the owner loads the word with sync/atomic.
	Signal(peer, off int, delta uint64) (Request, error)
	// Fence orders this rank's one-sided operations: every one posted before it lands
	// before any posted after it.
	Fence() error
	// Register maps b with the transport once, so that Puts from b and Gets into it use
	// that registration instead of one per operation.
	Register(b *obuf.Buf) error
}
