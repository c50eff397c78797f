package core

import (
	"errors"
	"fmt"

	"github.com/moex-ai/moex/transport"
)

// CheckMatch checks a message from peer, sent under tag got and n bytes long, against the
// receive it matched, posted under want with room bytes: the signatures must agree (else
// ErrMismatch: the two sides are in different operations) and the message must fit
// (else ErrTruncated), each a PeerError naming peer.
func CheckMatch(peer int, want, got transport.Tag, n, room int) error {
	if got.Sig != want.Sig {
		return SignatureError(peer, got, want.Sig)
	}
	if n > room {
		return TruncatedError(peer, n, room)
	}
	return nil
}

// SignatureError: peer sent under got a message whose signature is not want.
func SignatureError(peer int, got transport.Tag, want uint32) error {
	return &transport.PeerError{Rank: peer, Op: "recv", Err: fmt.Errorf(
		"%w: rank %d sent signature %#x at %v, this receive expects %#x",
		transport.ErrMismatch, peer, got.Sig, got.Key(), want)}
}

// TruncatedError: peer sent n bytes to a receive of room bytes.
func TruncatedError(peer, n, room int) error {
	return &transport.PeerError{Rank: peer, Op: "recv", Err: fmt.Errorf(
		"%w: %d bytes into a %d-byte buffer", transport.ErrTruncated, n, room)}
}

// Per-message notices of the rendezvous protocols (wire.TypeAbort frames, the code in
// Aux, a reason as payload).
const (
	NoticeTruncated uint64 = 1 // receiver to sender: your message is longer than my buffer
	NoticeMismatch  uint64 = 2 // receiver to sender: your message's signature differs from mine
	NoticeCanceled  uint64 = 3 // sender to receiver: I withdrew the message I announced
	NoticeCancelAck uint64 = 4 // receiver to sender: withdrawn, your buffer is yours again
)

// RejectNotice is the notice that tells a sender why CheckMatch refused its message.
func RejectNotice(err error) uint64 {
	if errors.Is(err, transport.ErrMismatch) {
		return NoticeMismatch
	}
	return NoticeTruncated
}

// Rejected is the error a send completes with when its receiver refused it with notice
// code (NoticeTruncated or NoticeMismatch) for reason.
func Rejected(peer int, code uint64, reason string) error {
	kind := transport.ErrTruncated
	if code == NoticeMismatch {
		kind = transport.ErrMismatch
	}
	return &transport.PeerError{Rank: peer, Op: "send", Err: fmt.Errorf("%w: rejected by the receiver: %s", kind, reason)}
}
