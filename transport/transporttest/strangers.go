package transporttest

import (
	"errors"
	"net"
	"os"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Strangers are connections a listener of a moex job must drop on its own: one that
// sends what no moex peer sends (an HTTP request, random bytes) and one that sends
// nothing at all.
var Strangers = []struct {
	Name string
	Send []byte // nil: says nothing
}{{"idle", nil}, {"http", []byte("GET / HTTP/1.0\r\n\r\n")}, {"noise", noise(4096)}}

func noise(n int) []byte {
	b := make([]byte, n)
	Pattern(b, 7)
	return b
}

// Dropped connects to addr, sends send, and reports whether the listener closed the
// connection within transport.AcceptIdle and a margin (nil), or what happened instead.
func Dropped(addr string, send []byte) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if send != nil {
		if _, err := c.Write(send); err != nil {
			return nil // already closed by the listener
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(2 * transport.AcceptIdle))
	buf := make([]byte, 4096)
	for {
		if _, err := c.Read(buf); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return errors.New("the listener kept the connection open")
			}
			return nil // EOF or reset: dropped
		}
	}
}
