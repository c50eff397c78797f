package transport

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func FuzzHandshake(f *testing.F) {
	f.Add([]byte{byte(RoleDialer)})
	f.Add(append([]byte{byte(RoleDialer)}, make([]byte, nonceSize+2)...))
	hello := append([]byte{byte(RoleDialer)}, make([]byte, nonceSize)...)
	hello = binary.LittleEndian.AppendUint16(hello, 5)
	f.Add(append(append(hello, "hello"...), make([]byte, 32)...))
	f.Add(append([]byte{byte(RoleAcceptor)}, make([]byte, 64)...))
	f.Fuzz(func(t *testing.T, in []byte) {
		a, b := net.Pipe()
		defer a.Close()
		go func() { // the stranger: sends its bytes, reads whatever comes, hangs up
			go func() { _, _ = io.Copy(io.Discard, b) }()
			_, _ = b.Write(in)
			b.Close()
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := Handshake(ctx, a, []byte("the job secret"), RoleAcceptor, []byte("store"))
		require.Error(t, err)
		assert.NoError(t, ctx.Err(), "a stranger that hung up held the handshake until its deadline")
	})
}
