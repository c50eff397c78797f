// Package transport defines moex's point-to-point contract, with what every transport
// shares: its errors, the Mux that routes peers to transports, the job-secret handshake
// that every connection proves, and host identity. Reading the launcher's environment,
// the rendezvous store and the choice of transport are package bootstrap's.
//
// The contract is tagged, non-blocking send and receive between the ranks of one job.
// Posting never blocks; a Request completes when the send's buffer may be reused or the
// receive's buffer holds the message. Messages with the same (peer, tag) arrive in the
// order they were sent. Small messages go eager; large ones go rendezvous, written straight
// into the receiver's posted buffer where the transport allows.
//
// Implementations live in subpackages (inproc, tcp, shm, ucx) and all pass the conformance
// suite in transporttest. Optional capabilities (memory registration, device memory, path
// reporting) are separate interfaces found by type assertion. This package must not import
// coll or anything above it.
package transport

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// Tag identifies a message between two ranks. Comm, Seq and Tag must match exactly between
// a send and a receive. Sig is not matched but checked: a receive that matches a message
// whose Sig differs completes with ErrMismatch (two ranks that issued different operations
// at the same point, for instance). Plain point-to-point users leave Seq and Sig zero.
type Tag struct {
	Comm uint32 // communicator id
	Seq  uint32 // operation sequence number on the communicator
	Tag  uint32 // tag within the operation (step, chunk, user tag)
	Sig  uint32 // operation signature, checked on match
}

// Key returns the matched part of t.
func (t Tag) Key() Key { return Key{t.Comm, t.Seq, t.Tag} }

func (t Tag) String() string {
	return fmt.Sprintf("comm=%d seq=%d tag=%d sig=%#x", t.Comm, t.Seq, t.Tag, t.Sig)
}

// Key is the matched part of a Tag.
type Key struct {
	Comm, Seq, Tag uint32 // the communicator, its operation's sequence number, the tag
}

// Transport moves bytes between the ranks of one job.
type Transport interface {
	// Rank is this process's rank; Size the number of ranks.
	Rank() int
	Size() int
	// Isend posts a send of buf to peer. buf must not be modified until the request
	// completes. Sending to oneself is allowed.
	Isend(peer int, tag Tag, buf []byte) (Request, error)
	// Irecv posts a receive of at most len(buf) bytes from peer. A longer message
	// completes the request with ErrTruncated.
	Irecv(peer int, tag Tag, buf []byte) (Request, error)
	// Name names the transport ("inproc", "tcp", ...).
	Name() string
	// Close releases everything the transport holds. Pending requests complete with
	// ErrClosed; peers see this rank leave.
	Close() error
}

// A Batcher can put several messages to one peer on the wire together: one system call
// where each would take one (tcp). IsendBatch posts sends of bufs[i] with tags[i] to peer,
// as many Isend calls in that order would, and stores the requests in reqs (at least
// len(bufs) long). On error the requests already posted are in reqs (the rest nil).
type Batcher interface {
	IsendBatch(peer int, tags []Tag, bufs [][]byte, reqs []Request) error
}

// IsendBatch posts the sends of Batcher.IsendBatch on t: as a batch where t is a Batcher,
// else one by one.
func IsendBatch(t Transport, peer int, tags []Tag, bufs [][]byte, reqs []Request) error {
	if b, ok := t.(Batcher); ok {
		return b.IsendBatch(peer, tags, bufs, reqs)
	}
	return IsendEach(t, peer, tags, bufs, reqs)
}

// IsendEach posts the sends of Batcher.IsendBatch on t one by one (a Batcher's own
// IsendBatch calls it with its batch held back).
func IsendEach(t Transport, peer int, tags []Tag, bufs [][]byte, reqs []Request) error {
	clear(reqs[:len(bufs)])
	for i, b := range bufs {
		r, err := t.Isend(peer, tags[i], b)
		if err != nil {
			return err
		}
		reqs[i] = r
	}
	return nil
}

// Request is the handle of a posted send or receive.
//
// Wait must be called exactly once (as MPI_Wait frees an MPI request): when it returns, the
// request is recycled and must not be used again. Test may be called any number of times
// before Wait.
type Request interface {
	// Test reports, without blocking, whether the operation completed.
	Test() bool
	// Wait blocks until the operation completes or ctx ends, and returns the number of
	// bytes sent or received. If ctx ends first the operation is cancelled: a receive's
	// buffer is detached before Wait returns, a send not yet on the wire is withdrawn, and
	// a send already being transferred is completed first, so in every case the buffer is
	// the caller's again when Wait returns. The error then wraps ErrTimeout (deadline) or
	// ErrCanceled, and ctx.Err().
	Wait(ctx context.Context) (int, error)
}

// PathReporter is implemented by transports that can say how bytes reach a peer, and why
// that path was chosen ("tcp: UCX not built", "shm: same host, cma").
type PathReporter interface {
	Path(peer int) string
}

// Sentinel errors. Test with errors.Is.
var (
	ErrClosed     = errors.New("transport: closed")
	ErrTimeout    = errors.New("transport: timeout")
	ErrCanceled   = errors.New("transport: canceled")
	ErrTruncated  = errors.New("transport: message longer than receive buffer")
	ErrMismatch   = errors.New("transport: operation mismatch")
	ErrProtocol   = errors.New("transport: protocol error")
	ErrPeerClosed = errors.New("transport: peer closed the connection")
	// ErrPeerLeft is the ErrPeerClosed of a peer that said goodbye (it closed its end
	// on purpose, often after an abort that explains why); errors.Is(err, ErrPeerClosed)
	// holds for it too.
	ErrPeerLeft = fmt.Errorf("%w (it said goodbye)", ErrPeerClosed)
	ErrAborted  = errors.New("transport: aborted")
	ErrAuth     = errors.New("transport: authentication failed")
)

// PeerError reports a failure of an operation with a given peer.
type PeerError struct {
	Rank int    // the peer
	Op   string // "send", "recv", "connect", ...
	Err  error
}

func (e *PeerError) Error() string {
	return fmt.Sprintf("transport: %s with rank %d: %s", e.Op, e.Rank, Unprefixed(e.Err))
}

// Unprefixed is err's text without a leading "transport: ", for an error of this
// package that wraps it and says "transport: " once.
func Unprefixed(err error) string {
	if err == nil {
		return "<nil>"
	}
	return strings.TrimPrefix(err.Error(), "transport: ")
}

func (e *PeerError) Unwrap() error { return e.Err }

// ArgError reports an invalid argument, naming it.
type ArgError struct {
	Arg    string // the argument, by its name in the call
	Reason string // what is wrong with it
}

func (e *ArgError) Error() string { return "transport: invalid " + e.Arg + ": " + e.Reason }

// Because returns an error whose text is its own, a sentence that says more than its
// cause's text (which it does not repeat), and which matches cause with errors.Is and
// errors.As: one prefix per layer, not one per wrapping.
func Because(cause error, format string, args ...any) error {
	return &because{msg: fmt.Sprintf(format, args...), cause: cause}
}

type because struct {
	msg   string
	cause error
}

func (e *because) Error() string { return e.msg }
func (e *because) Unwrap() error { return e.cause }

// CtxError converts a context error into one that wraps ErrTimeout or ErrCanceled and the
// context's own error.
func CtxError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return &ctxErr{ErrTimeout, err}
	}
	return &ctxErr{ErrCanceled, err}
}

type ctxErr struct{ kind, ctx error }

func (e *ctxErr) Error() string   { return e.kind.Error() + ": " + e.ctx.Error() }
func (e *ctxErr) Unwrap() []error { return []error{e.kind, e.ctx} }

// CheckPeer validates a peer rank argument.
func CheckPeer(peer, size int) error {
	if peer < 0 || peer >= size {
		return &ArgError{Arg: "peer", Reason: fmt.Sprintf("rank %d out of range [0,%d)", peer, size)}
	}
	return nil
}

// WaitAll waits for every request (each exactly once) and returns the first error.
func WaitAll(ctx context.Context, reqs ...Request) error {
	var first error
	for _, r := range reqs {
		if r == nil {
			continue
		}
		if _, err := r.Wait(ctx); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// MemType says where a buffer lives.
type MemType int

const (
	MemHost MemType = iota
	MemCUDA
	MemCUDAManaged
	MemROCm
)

func (m MemType) String() string {
	switch m {
	case MemHost:
		return "host"
	case MemCUDA:
		return "cuda"
	case MemCUDAManaged:
		return "cuda-managed"
	case MemROCm:
		return "rocm"
	}
	return fmt.Sprintf("memtype(%d)", int(m))
}

// DeviceTransport is implemented by transports that move device (GPU) memory directly,
// such as UCX built with CUDA (GPUDirect RDMA): the buffer is a device pointer, never
// touched by the CPU.
type DeviceTransport interface {
	IsendDevice(peer int, tag Tag, ptr uintptr, n int, mt MemType) (Request, error)
	IrecvDevice(peer int, tag Tag, ptr uintptr, n int, mt MemType) (Request, error)
}
