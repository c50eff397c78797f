// Package health is what keeps a communicator's failures from becoming hangs: the
// watchdog that turns a stall into an error, the control messages that tell every rank
// why a communicator aborted, the search along the chain of waits for the rank that is
// stuck, and the reports that let a launcher blame the root cause. It does no I/O of
// its own beyond the launcher's report files: package coll sends what it encodes.
package health

import (
	"encoding/binary"
	"errors"
)

// Kind is a control message's kind: an abort notice's cause, or a stall probe.
type Kind uint8

// The kinds. The abort kinds say which of coll's sentinel errors the abort matches on
// the ranks that hear of it.
const (
	Other Kind = iota
	Timeout
	Mismatch
	Argument
	Peer
	Canceled
	Closed
	Panic // the rank that aborted panicked
	// Not abort notices: a stall probe (whom do you wait for?) and its reply.
	Probe      Kind = 100
	ProbeReply Kind = 101
)

var kindNames = [...]string{"other", "timeout", "mismatch", "argument", "peer", "canceled", "closed", "panic"}

// String names the kind as launchers' reports do.
func (k Kind) String() string {
	switch {
	case int(k) < len(kindNames):
		return kindNames[k]
	case k == Probe:
		return "probe"
	case k == ProbeReply:
		return "probe-reply"
	}
	return "unknown"
}

// HeaderLen is the length of a control message's header: its kind, the rank it blames
// (-1: none) and the rank that aborted, then the body.
const HeaderLen = 9

// MaxReason bounds the text an abort notice carries.
const MaxReason = 900

// ErrShort is a control message shorter than its header.
var ErrShort = errors.New("short control message")

// Message is one control message.
type Message struct {
	Kind   Kind
	Blame  int    // the rank the sender blames (a dead peer, the rank a timeout waited for); -1: none
	Origin int    // the rank that aborted (probes: unused)
	Body   []byte // an abort's reason; a probe reply's answer
}

// Notice encodes an abort notice; the reason is cut to MaxReason bytes.
func Notice(kind Kind, blame, origin int, reason string) []byte {
	if len(reason) > MaxReason {
		reason = reason[:MaxReason]
	}
	msg := make([]byte, HeaderLen+len(reason))
	msg[0] = byte(kind)
	binary.LittleEndian.PutUint32(msg[1:], uint32(int32(blame)))
	binary.LittleEndian.PutUint32(msg[5:], uint32(int32(origin)))
	copy(msg[HeaderLen:], reason)
	return msg
}

// Parse reads a control message; Body aliases b.
func Parse(b []byte) (Message, error) {
	if len(b) < HeaderLen {
		return Message{}, ErrShort
	}
	return Message{
		Kind:   Kind(b[0]),
		Blame:  int(int32(binary.LittleEndian.Uint32(b[1:]))),
		Origin: int(int32(binary.LittleEndian.Uint32(b[5:]))),
		Body:   b[HeaderLen:],
	}, nil
}

// ProbeMessage is a stall probe: whom do you wait for?
func ProbeMessage() []byte {
	msg := make([]byte, HeaderLen)
	msg[0] = byte(Probe)
	return msg
}

// Reply is a peer's answer to a stall probe.
type Reply struct {
	From    int   // the rank (of the world) that answered
	InOp    bool  // it is in an operation of this communicator
	Waiting []int // the ranks (of the world) it waits for
}

// ReplyMessage encodes the answer to a stall probe.
func ReplyMessage(inOp bool, waiting []int) []byte {
	msg := make([]byte, HeaderLen+1, HeaderLen+1+4*len(waiting))
	msg[0] = byte(ProbeReply)
	if inOp {
		msg[HeaderLen] = 1
	}
	for _, w := range waiting {
		msg = binary.LittleEndian.AppendUint32(msg, uint32(w))
	}
	return msg
}

// ParseReply reads a probe reply's body: at most max ranks, each below 2^31.
func ParseReply(body []byte, max int) Reply {
	var r Reply
	if len(body) >= 1 {
		r.InOp = body[0] == 1
		for i := 1; i+4 <= len(body) && len(r.Waiting) < max; i += 4 {
			if w := binary.LittleEndian.Uint32(body[i:]); w < 1<<31 {
				r.Waiting = append(r.Waiting, int(w))
			}
		}
	}
	return r
}
