package transport

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
)

const (
	nonceSize   = 32
	maxHello    = 4096
	authVersion = "moex-auth/1"
)

// AcceptIdle bounds how long the accepting end of a handshake waits for the dialer's
// first bytes, which a peer sends as soon as it connects: a connection that sends
// nothing (a port scanner, a stuck client) is dropped after it, and one whose first byte
// is not a dialer's at once, however long the handshake's context allows.
const AcceptIdle = 3 * time.Second

// Role distinguishes the two ends of a handshake so that a proof cannot be reflected back.
type Role byte

const (
	RoleDialer   Role = 'D'
	RoleAcceptor Role = 'A'
)

// Handshake proves to the peer on conn, and checks that the peer proves, knowledge of the
// job secret, with a mutual HMAC-SHA256 challenge over fresh nonces. Each side also sends
// a short hello (rank, stream index, ...) that the proofs cover. It returns the peer's
// hello. A wrong secret gives an error wrapping ErrAuth. ctx bounds the whole exchange.
func Handshake(ctx context.Context, conn net.Conn, token []byte, role Role, hello []byte) ([]byte, error) {
	if len(hello) > maxHello {
		return nil, &ArgError{Arg: "hello", Reason: "longer than 4096 bytes"}
	}
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(30 * time.Second)
	}
	_ = conn.SetDeadline(dl)
	if idle := time.Now().Add(AcceptIdle); role == RoleAcceptor && idle.Before(dl) {
		_ = conn.SetReadDeadline(idle)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer func() {
		stop()
		_ = conn.SetDeadline(time.Time{})
	}()

	var mine [nonceSize]byte
	if _, err := rand.Read(mine[:]); err != nil {
		return nil, err
	}
	out := make([]byte, 0, 1+nonceSize+2+len(hello))
	out = append(out, byte(role))
	out = append(out, mine[:]...)
	out = binary.LittleEndian.AppendUint16(out, uint16(len(hello)))
	out = append(out, hello...)
	if _, err := conn.Write(out); err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	var head [1 + nonceSize + 2]byte
	if _, err := io.ReadFull(conn, head[:1]); err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	peerRole := Role(head[0])
	if peerRole == role || (peerRole != RoleDialer && peerRole != RoleAcceptor) {
		return nil, fmt.Errorf("%w: peer role %q (not a moex peer)", ErrAuth, peerRole)
	}
	if _, err := io.ReadFull(conn, head[1:]); err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	_ = conn.SetReadDeadline(dl)
	peerNonce := head[1 : 1+nonceSize]
	n := int(binary.LittleEndian.Uint16(head[1+nonceSize:]))
	if n > maxHello {
		return nil, fmt.Errorf("%w: hello of %d bytes", ErrProtocol, n)
	}
	peerHello := make([]byte, n)
	if _, err := io.ReadFull(conn, peerHello); err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	proof := func(r Role, a, b, ha, hb []byte) []byte {
		m := hmac.New(sha256.New, token)
		m.Write([]byte(authVersion))
		m.Write([]byte{byte(r)})
		for _, x := range [][]byte{a, b, ha, hb} {
			var l [4]byte
			binary.LittleEndian.PutUint32(l[:], uint32(len(x)))
			m.Write(l[:])
			m.Write(x)
		}
		return m.Sum(nil)
	}
	if _, err := conn.Write(proof(role, mine[:], peerNonce, hello, peerHello)); err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	got := make([]byte, sha256.Size)
	if _, err := io.ReadFull(conn, got); err != nil {
		// A peer that rejected our proof hangs up here.
		return nil, fmt.Errorf("%w: peer hung up during the challenge (wrong job secret?): %v", ErrAuth, err)
	}
	if !hmac.Equal(got, proof(peerRole, peerNonce, mine[:], peerHello, hello)) {
		return nil, fmt.Errorf("%w: peer %s does not know the job secret", ErrAuth, conn.RemoteAddr())
	}
	return peerHello, nil
}
