package tcp_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/tcp"
)

// MOEX_TCP_DEAD sets how long a silent host takes to be declared dead: a Go duration
// from 1s to 1h, 0 for the kernel's timeouts; anything else is an EnvError naming it.
func TestDeadAfterFromEnv(t *testing.T) {
	for v, want := range map[string]time.Duration{"": 0, "3s": 3 * time.Second, "1h": time.Hour, "0": -1} {
		var cfg tcp.Config
		require.NoError(t, cfg.ConfigFromEnv(func(k string) string {
			if k == "MOEX_TCP_DEAD" {
				return v
			}
			return ""
		}), v)
		assert.Equal(t, want, cfg.DeadAfter, v)
	}
	for _, v := range []string{"500ms", "2h", "x", "-1s"} {
		var cfg tcp.Config
		err := cfg.ConfigFromEnv(func(k string) string {
			if k == "MOEX_TCP_DEAD" {
				return v
			}
			return ""
		})
		var ee *transport.EnvError
		require.ErrorAs(t, err, &ee, v)
		assert.Equal(t, "MOEX_TCP_DEAD", ee.Var)
	}
}
