package tcp

import (
	"context"
	"errors"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport/transporttest"
)

// While a rank sets up (here, stuck in the address exchange), its listener drops
// connections that are not a peer's: garbage at once, silence after
// transport.AcceptIdle, rather than holding them until set-up ends.
func TestSetupDropsStrangers(t *testing.T) {
	addrCh := make(chan string, 1)
	release := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := New(context.Background(), Config{Rank: 0, Size: 2, Token: []byte("job"), Exchange: func(ctx context.Context, mine []byte) ([][]byte, error) {
			addrCh <- string(mine)
			<-release
			return nil, errors.New("no peers in this test")
		}})
		done <- err
	}()
	addr := <-addrCh
	for _, s := range transporttest.Strangers {
		assert.NoError(t, transporttest.Dropped(addr, s.Send), s.Name)
	}
	close(release)
	select {
	case err := <-done:
		require.Error(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("New did not return after its exchange failed")
	}
}

// A flood of refused connections logs one WARN a second, with the count so far, and
// counts every one (the launcher's logs once had 511 such lines).
func TestRefusedConnectionsRateLimited(t *testing.T) {
	var logs transporttest.Recorder
	tr := &Transport{log: logs.Logger(), refusedLog: rate.Sometimes{Interval: time.Hour}}
	for i := 0; i < 500; i++ {
		tr.refusedWarn("moex tcp: refused connection", "rank", 0)
	}
	assert.Equal(t, uint64(500), tr.refused.Load())
	warned := logs.Records()
	require.Len(t, warned, 1)
	n, ok := warned[0].Int("refused_so_far")
	assert.True(t, ok)
	assert.Equal(t, int64(1), n)
}
