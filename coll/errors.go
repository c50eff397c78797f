package coll

import (
	"errors"
	"fmt"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Errors. Test with errors.Is / errors.As; never by text.
var (
	// ErrTimeout: an operation did not complete within the communicator's timeout or the
	// context's deadline. The communicator is aborted.
	ErrTimeout = transport.ErrTimeout
	// ErrCanceled: the context of an operation was cancelled. The communicator is aborted.
	ErrCanceled = transport.ErrCanceled
	// ErrMismatch: ranks issued different operations, or the same one with different
	// counts, types or roots, at the same point. The communicator is aborted.
	ErrMismatch = transport.ErrMismatch
	// ErrAborted: the communicator was aborted (Abort, or an error on some rank).
	ErrAborted = errors.New("coll: communicator aborted")
	// ErrClosed: the communicator was closed.
	ErrClosed = transport.ErrClosed
	// ErrInvalidArgument: an argument is wrong (see *ArgError for which).
	ErrInvalidArgument = errors.New("coll: invalid argument")
)

// PeerError reports the failure of a rank (it died, closed, or its connection broke).
type PeerError = transport.PeerError

// ArgError names the argument that is wrong and why.
type ArgError struct {
	Arg    string
	Reason string
}

func (e *ArgError) Error() string { return "coll: invalid " + e.Arg + ": " + e.Reason }

// Is makes every ArgError match ErrInvalidArgument.
func (e *ArgError) Is(target error) bool { return target == ErrInvalidArgument }

// TimeoutError is a communicator's operation that made no progress for the timeout
// (MOEX_TIMEOUT): Waiting lists the ranks (of the world, as PeerError does) it waited for
// (a transfer posted to or from them had not completed), the missing, stuck or slow
// ones; empty when the operation waited on shared memory rather than on messages.
// Stuck lists the ranks at the end of the chain of waits (a rank waited for may itself
// wait for another): those that did not answer a probe (stopped, or cut off), else
// those in no operation of the communicator (busy elsewhere); empty when the probe found
// none. On the other ranks, the timeout that one rank reported names its stuck rank, or
// the first it waited for, in Waiting. It matches ErrTimeout.
type TimeoutError struct {
	Idle    time.Duration
	Waiting []int
	Stuck   []int
	remote  string // the text of a timeout another rank reported
}

// blame is the rank to name first: the first stuck one, else the first waited for, else
// -1.
func (e *TimeoutError) blame() int {
	switch {
	case len(e.Stuck) > 0:
		return e.Stuck[0]
	case len(e.Waiting) > 0:
		return e.Waiting[0]
	}
	return -1
}

func (e *TimeoutError) Error() string {
	if e.remote != "" {
		return e.remote
	}
	stuck := ""
	if len(e.Stuck) > 0 {
		stuck = fmt.Sprintf("; at the end of the chain of waits, ranks %v are stuck (no answer, or in no operation)", e.Stuck)
	}
	if len(e.Waiting) == 0 {
		return fmt.Sprintf("%v: no progress for %v (MOEX_TIMEOUT); a rank is missing, stuck or slower than the timeout allows%s", ErrTimeout, e.Idle, stuck)
	}
	return fmt.Sprintf("%v: no progress for %v (MOEX_TIMEOUT), waiting for ranks %v: missing, stuck or slower than the timeout allows%s", ErrTimeout, e.Idle, e.Waiting, stuck)
}

func (e *TimeoutError) Unwrap() error { return ErrTimeout }

// AbortError is what an operation returns once its communicator has been aborted: by this
// rank (Rank is this rank) or by another one, which told every rank why.
type AbortError struct {
	Rank int   // the rank that aborted
	Err  error // why (wraps ErrMismatch, ErrTimeout, ErrInvalidArgument, a *PeerError, ...)
}

func (e *AbortError) Error() string {
	return fmt.Sprintf("coll: communicator aborted by rank %d: %v", e.Rank, e.Err)
}

func (e *AbortError) Unwrap() []error { return []error{ErrAborted, e.Err} }

// Abort notices travel between ranks as a kind code and a text.
const (
	kindOther uint8 = iota
	kindTimeout
	kindMismatch
	kindArg
	kindPeer
	kindCanceled
	kindClosed
	// Not abort notices: a stall probe (whom do you wait for?) and its reply (a byte, 1
	// when the rank is in an operation, then the world ranks it waits for).
	kindProbe      = 100
	kindProbeReply = 101
)

func kindOf(err error) uint8 {
	var pe *PeerError
	switch {
	case errors.Is(err, ErrMismatch):
		return kindMismatch
	case errors.Is(err, ErrInvalidArgument):
		return kindArg
	case errors.As(err, &pe):
		return kindPeer
	case errors.Is(err, ErrTimeout):
		return kindTimeout
	case errors.Is(err, ErrCanceled):
		return kindCanceled
	case errors.Is(err, ErrClosed):
		return kindClosed
	}
	return kindOther
}

// remoteErr rebuilds, from a notice, an error that matches the same sentinels.
type remoteErr struct {
	kind   error
	reason string
	peer   int
}

func (e *remoteErr) Error() string { return e.reason }

func (e *remoteErr) Unwrap() error { return e.kind }

func decodeNotice(kind uint8, peer int, reason string) error {
	switch kind {
	case kindTimeout:
		if peer >= 0 {
			return &TimeoutError{Waiting: []int{peer}, remote: reason}
		}
		return &remoteErr{ErrTimeout, reason, -1}
	case kindMismatch:
		return &remoteErr{ErrMismatch, reason, -1}
	case kindArg:
		return &remoteErr{ErrInvalidArgument, reason, -1}
	case kindPeer:
		return &PeerError{Rank: peer, Op: "remote", Err: errors.New(reason)}
	case kindCanceled:
		return &remoteErr{ErrCanceled, reason, -1}
	case kindClosed:
		return &remoteErr{ErrClosed, reason, -1}
	}
	return errors.New(reason)
}

// kindName names an error's kind for the launcher's report.
func kindName(err error) string {
	return [...]string{"other", "timeout", "mismatch", "argument", "peer", "canceled", "closed"}[kindOf(err)]
}
