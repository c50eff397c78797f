// Package wire defines the frame header that moex's byte-stream transports (tcp, shm rings)
// put in front of every message, and its encoding.
//
// It owns the layout, the validation of a header read from an untrusted peer and the
// optional payload checksum. It does no I/O and keeps no state: a transport reads
// HeaderSize bytes, calls Decode, and decides what to do with the payload.
//
// Layout (little endian, 64 bytes):
//
//	0  magic   uint16  'M','X'
//	2  version uint8
//	3  type    uint8   Type
//	4  flags   uint8   Flag*
//	5  zero    [3]byte
//	8  comm    uint32  communicator id
//	12 src     uint32  source rank
//	16 seq     uint32  operation sequence on the communicator
//	20 tag     uint32  tag within the operation
//	24 sig     uint32  operation signature (checked on match, not matched)
//	28 zero    uint32
//	32 length  uint64  payload bytes that follow this header
//	40 id      uint64  request id (see Type)
//	48 aux     uint64  second word (see Type)
//	56 sum     uint64  xxhash64 of the payload when FlagChecksum is set
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cespare/xxhash/v2"
)

// HeaderSize is the encoded size of a Header.
const HeaderSize = 64

// Magic is the first two bytes of every frame ('M', 'X').
const Magic uint16 = 'M' | 'X'<<8

// Version is the protocol version this package speaks.
const Version uint8 = 1

// Type is the kind of frame.
type Type uint8

const (
	// TypeHello opens a connection; the payload is transport specific (rank, stream, proof).
	TypeHello Type = iota + 1
	// TypeEager carries a whole message inline: Length bytes of payload.
	TypeEager
	// TypeRTS announces a large message without payload: ID is the sender's request id,
	// Aux the message length.
	TypeRTS
	// TypeCTS answers an RTS once a matching receive is posted: ID echoes the sender's
	// request id, Aux is the receiver's request id.
	TypeCTS
	// TypeData carries part of a large message: ID is the receiver's request id, Aux the
	// offset of the payload within the message.
	TypeData
	// TypeAbort tells the peer that this side gave up: the payload is a reason string.
	TypeAbort
	// TypeBye is a graceful close: no more frames follow.
	TypeBye
	// TypePad fills a shared-memory ring from its position to the end of the ring, Aux
	// slots: the consumer skips them. A producer that finds its ring empty rewinds so to
	// the start, whose memory is still in cache.
	TypePad
	typeEnd
)

var typeNames = [...]string{"", "hello", "eager", "rts", "cts", "data", "abort", "bye", "pad"}

func (t Type) String() string {
	if t > 0 && t < typeEnd {
		return typeNames[t]
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Flags.
const (
	// FlagChecksum says Sum holds the xxhash64 of the payload.
	FlagChecksum uint8 = 1 << iota
	flagsKnown         = FlagChecksum
)

// MaxLength bounds the payload of one frame. Larger messages are split into Data frames.
const MaxLength = 1 << 40

// Header is the decoded form of a frame header.
type Header struct {
	Type   Type
	Flags  uint8
	Comm   uint32
	Src    uint32
	Seq    uint32
	Tag    uint32
	Sig    uint32
	Length uint64
	ID     uint64
	Aux    uint64
	Sum    uint64
}

// Errors returned by Decode. All wrap ErrInvalid.
var (
	ErrInvalid  = errors.New("wire: invalid frame")
	ErrMagic    = fmt.Errorf("%w: bad magic", ErrInvalid)
	ErrVersion  = fmt.Errorf("%w: unsupported version", ErrInvalid)
	ErrType     = fmt.Errorf("%w: unknown type", ErrInvalid)
	ErrFlags    = fmt.Errorf("%w: unknown flags", ErrInvalid)
	ErrReserved = fmt.Errorf("%w: reserved bytes not zero", ErrInvalid)
	ErrLength   = fmt.Errorf("%w: length out of range", ErrInvalid)
	ErrShort    = fmt.Errorf("%w: short header", ErrInvalid)
	ErrChecksum = fmt.Errorf("%w: payload checksum mismatch", ErrInvalid)
)

// Encode writes h into b, which must hold HeaderSize bytes.
func (h *Header) Encode(b []byte) {
	_ = b[HeaderSize-1]
	le := binary.LittleEndian
	le.PutUint16(b[0:], Magic)
	b[2] = Version
	b[3] = uint8(h.Type)
	b[4] = h.Flags
	b[5], b[6], b[7] = 0, 0, 0
	le.PutUint32(b[8:], h.Comm)
	le.PutUint32(b[12:], h.Src)
	le.PutUint32(b[16:], h.Seq)
	le.PutUint32(b[20:], h.Tag)
	le.PutUint32(b[24:], h.Sig)
	le.PutUint32(b[28:], 0)
	le.PutUint64(b[32:], h.Length)
	le.PutUint64(b[40:], h.ID)
	le.PutUint64(b[48:], h.Aux)
	le.PutUint64(b[56:], h.Sum)
}

// Decode parses and validates a header. It never panics, whatever b holds.
func (h *Header) Decode(b []byte) error {
	if len(b) < HeaderSize {
		return ErrShort
	}
	le := binary.LittleEndian
	if le.Uint16(b[0:]) != Magic {
		return ErrMagic
	}
	if b[2] != Version {
		return ErrVersion
	}
	t := Type(b[3])
	if t == 0 || t >= typeEnd {
		return ErrType
	}
	if b[4]&^flagsKnown != 0 {
		return ErrFlags
	}
	if b[5]|b[6]|b[7] != 0 || le.Uint32(b[28:]) != 0 {
		return ErrReserved
	}
	length := le.Uint64(b[32:])
	if length > MaxLength {
		return ErrLength
	}
	*h = Header{
		Type:   t,
		Flags:  b[4],
		Comm:   le.Uint32(b[8:]),
		Src:    le.Uint32(b[12:]),
		Seq:    le.Uint32(b[16:]),
		Tag:    le.Uint32(b[20:]),
		Sig:    le.Uint32(b[24:]),
		Length: length,
		ID:     le.Uint64(b[40:]),
		Aux:    le.Uint64(b[48:]),
		Sum:    le.Uint64(b[56:]),
	}
	return nil
}

// SetChecksum sets FlagChecksum and Sum for payload.
func (h *Header) SetChecksum(payload []byte) {
	h.Flags |= FlagChecksum
	h.Sum = xxhash.Sum64(payload)
}

// Verify checks payload against Sum when FlagChecksum is set.
func (h *Header) Verify(payload []byte) error {
	if h.Flags&FlagChecksum == 0 {
		return nil
	}
	if xxhash.Sum64(payload) != h.Sum {
		return ErrChecksum
	}
	return nil
}
