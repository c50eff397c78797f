package shm_test

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport/shm"
)

// Ranks sleep holding their Ps only where they outnumber the CPUs and their process has
// no other rank: two ranks of one process never do, whatever the policy says.
func TestRawParksOnlyForALoneRank(t *testing.T) {
	for _, over := range []bool{false, true} {
		ts := start(t, 2, func(c *shm.Config) { c.Poll = busypoll.Config{Oversubscribed: over} })
		for r, tr := range ts {
			assert.False(t, shm.RawParks(tr), "oversubscribed=%v rank %d: a rank of a process with two", over, r)
		}
	}
}

// A rank alone in its process, where ranks outnumber CPUs, sleeps holding its P; it stops
// while another rank shares the process, and starts again once that one has closed. (The
// package's tests run one at a time: no other transport is open meanwhile.)
func TestRawParksForALoneOversubscribedRank(t *testing.T) {
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("GOMAXPROCS is 1: a rank never holds the process's only P")
	}
	over := func(c *shm.Config) { c.Poll = busypoll.Config{Oversubscribed: true} }
	lone := start(t, 1, over)[0]
	assert.True(t, shm.RawParks(lone), "alone and oversubscribed")
	other := start(t, 1, nil)[0]
	assert.False(t, shm.RawParks(lone), "two ranks in the process")
	assert.False(t, shm.RawParks(other), "not oversubscribed, and two ranks")
	require.NoError(t, other.Close())
	assert.True(t, shm.RawParks(lone), "alone again")
	quiet := start(t, 1, nil)
	require.NoError(t, lone.Close())
	assert.False(t, shm.RawParks(quiet[0]), "alone, with a CPU to itself")
}

// The raw sleep ends at a wake-up, at once when the word has moved on already, and at
// its timeout otherwise (or at a signal).
func TestFutexPark(t *testing.T) {
	var word uint32
	done := make(chan bool)
	go func() { done <- shm.FutexPark(&word, 0, time.Minute) }()
	// Wake until the sleeper returns: a wake before it sleeps is lost, the next one is not.
	var timedOut bool
	for woken := false; !woken; {
		atomic.AddUint32(&word, 1)
		shm.FutexWake(&word)
		select {
		case timedOut = <-done:
			woken = true
		case <-time.After(10 * time.Millisecond):
		}
	}
	assert.False(t, timedOut, "woken, not timed out")
	assert.False(t, shm.FutexPark(&word, atomic.LoadUint32(&word)+1, time.Minute), "the word differs: no sleep")
	// A signal (the runtime's preemption) may end a sleep early, as a wake-up does; one
	// of a few sleeps runs to its timeout.
	timedOut = false
	for try := 0; try < 10 && !timedOut; try++ {
		start := time.Now()
		timedOut = shm.FutexPark(&word, atomic.LoadUint32(&word), 20*time.Millisecond)
		if timedOut {
			assert.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond)
		}
	}
	require.True(t, timedOut, "nobody wakes it: it times out")
}
