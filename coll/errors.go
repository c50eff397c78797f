package coll

import (
	"errors"
	"fmt"
	"time"

	"github.com/moex-ai/moex/coll/health"
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
	// ErrPanicked: a rank panicked with its communicator open (see *PanicError).
	ErrPanicked = errors.New("coll: a rank panicked")
)

// StoppedError is the error of an operation whose context was cancelled while the
// launcher (moex run) was stopping the job because a rank failed: a rank's program that
// cancels its context on SIGTERM gets it instead of only "context canceled". Rank is the
// rank (of the world) the launcher blames, Reason how it ended. It matches ErrCanceled
// and the context's error.
type StoppedError struct {
	Rank   int    // the rank the launcher blames
	Reason string // how it ended, as the launcher says it
	err    error
}

func (e *StoppedError) Error() string {
	return fmt.Sprintf("%v: the launcher is stopping the job (%s)", e.err, e.Reason)
}

func (e *StoppedError) Unwrap() error { return e.err }

// PanicError is the abort of a rank that panicked while its communicator was open and
// deferred its Close (see Comm.Close): on that rank and on every other one. Rank is the
// rank of the world; Value is what it panicked with, as text. It matches ErrPanicked.
type PanicError struct {
	Rank   int    // the rank (of the world) that panicked
	Value  string // what it panicked with, as text
	remote string // the text the panicking rank sent
}

func (e *PanicError) Error() string {
	if e.remote != "" {
		return e.remote
	}
	return fmt.Sprintf("coll: rank %d panicked: %s", e.Rank, e.Value)
}

func (e *PanicError) Unwrap() error { return ErrPanicked }

// PeerError reports the failure of a rank (it died, closed, or its connection broke).
type PeerError = transport.PeerError

// ArgError names the argument that is wrong and why.
type ArgError struct {
	Arg    string // the argument, by its name in the call
	Reason string // what is wrong with it
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
	Idle    time.Duration // how long the operation made no progress
	Waiting []int         // the ranks it waited for
	Stuck   []int         // the ranks at the end of the chain of waits
	remote  string        // the text of a timeout another rank reported
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

// kindOf is the kind an abort notice gives err, so that the ranks that hear of it get
// an error that matches the same sentinel.
func kindOf(err error) health.Kind {
	var pe *PeerError
	var pa *PanicError
	switch {
	case errors.As(err, &pa):
		return health.Panic
	case errors.Is(err, ErrMismatch):
		return health.Mismatch
	case errors.Is(err, ErrInvalidArgument):
		return health.Argument
	case errors.As(err, &pe):
		return health.Peer
	case errors.Is(err, ErrTimeout):
		return health.Timeout
	case errors.Is(err, ErrCanceled):
		return health.Canceled
	case errors.Is(err, ErrClosed):
		return health.Closed
	}
	return health.Other
}

// remoteErr rebuilds, from a notice, an error that matches the same sentinels.
type remoteErr struct {
	kind   error
	reason string
	peer   int
}

func (e *remoteErr) Error() string { return e.reason }

func (e *remoteErr) Unwrap() error { return e.kind }

func decodeNotice(kind health.Kind, peer int, reason string) error {
	switch kind {
	case health.Timeout:
		if peer >= 0 {
			return &TimeoutError{Waiting: []int{peer}, remote: reason}
		}
		return &remoteErr{ErrTimeout, reason, -1}
	case health.Mismatch:
		return &remoteErr{ErrMismatch, reason, -1}
	case health.Argument:
		return &remoteErr{ErrInvalidArgument, reason, -1}
	case health.Peer:
		return &PeerError{Rank: peer, Op: "remote", Err: errors.New(reason)}
	case health.Canceled:
		return &remoteErr{ErrCanceled, reason, -1}
	case health.Closed:
		return &remoteErr{ErrClosed, reason, -1}
	case health.Panic:
		return &PanicError{Rank: peer, remote: reason}
	}
	return errors.New(reason)
}
