package core

import (
	"errors"
	"testing"
	"time"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport"
)

// A request that does not complete within the grace period gets its peer failed with a
// timeout naming what was waited for; the failure completes it and the wait returns.
func TestAwaitGrace(t *testing.T) {
	var r Req
	r.Init()
	var failed error
	r.AwaitGrace(busypoll.New(busypoll.Config{Mode: busypoll.Block}), 10*time.Millisecond, "receive", func(err error) {
		failed = err
		r.Complete(0, err)
	})
	if !errors.Is(failed, transport.ErrTimeout) || !r.Test() {
		t.Fatalf("failed with %v, completed %v", failed, r.Test())
	}
	// One that completes in time is left alone.
	var q Req
	q.Init()
	q.Complete(5, nil)
	q.AwaitGrace(busypoll.New(busypoll.Config{}), time.Second, "transfer", func(err error) { t.Fatalf("failed a completed request: %v", err) })
	if n, err := q.Result(); n != 5 || err != nil {
		t.Fatalf("result %d %v", n, err)
	}
}
