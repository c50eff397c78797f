package coll

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A 4 KiB Broadcast in which one rank's buffer is one element short (a non-root rank's,
// or the root's): every rank gets an error in that call or in its next one, here a
// second Broadcast (a rooted operation, in which the send-only ranks would hear from
// nobody); with Config.Verify every rank gets it in that call. Nothing hangs.
func TestShortRootedBuffer(t *testing.T) {
	for _, verify := range []bool{false, true} {
		for _, short := range []int{0, 1, 3} {
			cs := newLocal(t, 4, Config{Timeout: 10 * time.Second, Verify: verify})
			errs := make([][2]error, len(cs))
			var wg sync.WaitGroup
			for _, c := range cs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range 2 {
						n := 1024
						if c.Rank() == short && i == 0 {
							n--
						}
						x := make([]float32, n)
						errs[c.Rank()][i] = Broadcast(context.Background(), c, x, 0)
					}
				}()
			}
			wg.Wait()
			for r, e := range errs {
				switch {
				case verify:
					require.Error(t, e[0], "verify, short rank %d: rank %d's first call", short, r)
				case e[0] == nil:
					require.Error(t, e[1], "short rank %d: rank %d finished the first call and the next", short, r)
				}
				err := errors.Join(e[0], e[1])
				assert.ErrorIs(t, err, ErrMismatch, "short rank %d: rank %d", short, r)
			}
		}
	}
}

// Small rooted operations in a row cost the agreement only when the one before did not
// confirm itself: an AllReduce between them confirms, so a Broadcast after it does not
// verify; a Broadcast after a Broadcast does.
func TestRootedConfirmation(t *testing.T) {
	c := newLocal(t, 2, Config{})[0]
	bc := call{op: OpBroadcast, dt: dtype.F32, count: 16}
	ar := call{op: OpAllReduce, dt: dtype.F32, count: 16}
	assert.False(t, c.confirms(&bc), "the first")
	assert.True(t, c.confirms(&bc), "after an unverified Broadcast")
	assert.False(t, c.confirms(&bc), "after a Broadcast that verified")
	assert.False(t, c.confirms(&ar), "AllReduce never needs it")
	assert.False(t, c.confirms(&bc), "after an AllReduce")
	av := call{op: OpAlltoAllv}
	assert.True(t, c.confirms(&av), "an AlltoAllv after an unverified Broadcast")
}
