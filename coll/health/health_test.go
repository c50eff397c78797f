package health

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recorder collects a watchdog's verdicts.
type recorder struct {
	mu    sync.Mutex
	fired []time.Duration
	warns []time.Duration
	dead  bool
}

func (r *recorder) dog(timeout, warnAfter time.Duration) *Watchdog {
	return NewWatchdog(timeout, warnAfter,
		func() bool { r.mu.Lock(); defer r.mu.Unlock(); return r.dead },
		func(idle time.Duration) { r.mu.Lock(); r.fired = append(r.fired, idle); r.mu.Unlock() },
		func(idle time.Duration) { r.mu.Lock(); r.warns = append(r.warns, idle); r.mu.Unlock() })
}

func (r *recorder) counts() (fired, warned int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.fired), len(r.warns)
}

// An operation that makes no progress fires the watchdog at the timeout, once, after
// one warning; in fake time, so exactly.
func TestWatchdogFiresAtTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var r recorder
		w := r.dog(10*time.Second, 3*time.Second)
		defer w.Stop()
		w.Begin()
		time.Sleep(3*time.Second - time.Millisecond)
		synctest.Wait()
		fired, warned := r.counts()
		assert.Equal(t, [2]int{0, 0}, [2]int{fired, warned}, "nothing before the warning")
		time.Sleep(2 * time.Millisecond)
		synctest.Wait()
		fired, warned = r.counts()
		assert.Equal(t, [2]int{0, 1}, [2]int{fired, warned}, "the warning at 3 s")
		time.Sleep(7 * time.Second)
		synctest.Wait()
		fired, warned = r.counts()
		require.Equal(t, [2]int{1, 1}, [2]int{fired, warned}, "the verdict at 10 s")
		assert.Equal(t, 10*time.Second, r.fired[0])
		time.Sleep(time.Minute)
		synctest.Wait()
		fired, _ = r.counts()
		assert.Equal(t, 1, fired, "once")
	})
}

// Progress postpones the verdict; operations that end in time never fire it, and a
// watchdog with nothing running stays quiet however long.
func TestWatchdogProgressAndIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var r recorder
		w := r.dog(10*time.Second, time.Minute)
		defer w.Stop()
		w.Begin()
		for range 5 {
			time.Sleep(8 * time.Second)
			w.Progressed()
		}
		w.End()
		assert.False(t, w.Busy())
		time.Sleep(time.Hour)
		synctest.Wait()
		fired, warned := r.counts()
		assert.Equal(t, [2]int{0, 0}, [2]int{fired, warned})
		// Operations in a stream: the timer set by the first serves all.
		for range 100 {
			w.Begin()
			time.Sleep(time.Second)
			w.End()
		}
		w.Begin()
		time.Sleep(10 * time.Second)
		synctest.Wait()
		fired, _ = r.counts()
		assert.Equal(t, 1, fired, "a stall after a stream of operations still fires")
	})
}

// A watchdog whose communicator has ended does nothing.
func TestWatchdogDead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := recorder{dead: true}
		w := r.dog(time.Second, time.Minute)
		defer w.Stop()
		w.Begin()
		time.Sleep(time.Minute)
		synctest.Wait()
		fired, _ := r.counts()
		assert.Zero(t, fired)
	})
}

// prober is a world of ranks for FindStuck: each rank's answer, or none (stopped).
type prober struct {
	answers map[int]Reply // ranks that answer
	replies chan Reply
	asked   []int
}

func (p *prober) ask(rank int) bool {
	if rank == 0 { // this rank
		return false
	}
	p.asked = append(p.asked, rank)
	if r, ok := p.answers[rank]; ok {
		r.From = rank
		p.replies <- r
	}
	return true
}

func newProber(answers map[int]Reply) *prober {
	return &prober{answers: answers, replies: make(chan Reply, 64)}
}

// The chain of waits is followed to its end: rank 0 waits for 1, 1 for 2, 2 for 3,
// and 3 does not answer.
func TestFindStuckFollowsTheChain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newProber(map[int]Reply{1: {InOp: true, Waiting: []int{2}}, 2: {InOp: true, Waiting: []int{3, 0}}})
		got := FindStuck([]int{1}, 200*time.Millisecond, p.ask, p.replies, nil)
		assert.Equal(t, []int{3}, got)
		assert.Equal(t, []int{1, 2, 3}, p.asked, "each asked once, this rank never")
	})
}

// Everyone answers: the ranks in no operation are at the end; a cycle of waiting ranks
// names nobody.
func TestFindStuckIdleAndCycle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newProber(map[int]Reply{1: {InOp: true, Waiting: []int{2}}, 2: {InOp: false}})
		assert.Equal(t, []int{2}, FindStuck([]int{1}, time.Second, p.ask, p.replies, nil))
		p = newProber(map[int]Reply{1: {InOp: true, Waiting: []int{2}}, 2: {InOp: true, Waiting: []int{1}}})
		assert.Empty(t, FindStuck([]int{1}, time.Second, p.ask, p.replies, nil))
		done := make(chan struct{})
		close(done)
		p = newProber(nil)
		assert.Nil(t, FindStuck([]int{1, 2}, time.Second, p.ask, p.replies, done), "an ended communicator names nobody")
	})
}

// A notice reads back as written, its reason cut to MaxReason.
func TestNoticeRoundTrip(t *testing.T) {
	long := string(make([]byte, 2*MaxReason))
	for _, c := range []struct {
		kind          Kind
		blame, origin int
		reason        string
	}{{Timeout, 3, 1, "no progress"}, {Peer, -1, 0, ""}, {Closed, 7, 5, long}} {
		m, err := Parse(Notice(c.kind, c.blame, c.origin, c.reason))
		require.NoError(t, err)
		assert.Equal(t, c.kind, m.Kind)
		assert.Equal(t, c.blame, m.Blame)
		assert.Equal(t, c.origin, m.Origin)
		assert.Equal(t, c.reason[:min(len(c.reason), MaxReason)], string(m.Body))
	}
	_, err := Parse(make([]byte, HeaderLen-1))
	assert.ErrorIs(t, err, ErrShort)
	m, err := Parse(ReplyMessage(true, []int{4, 2}))
	require.NoError(t, err)
	assert.Equal(t, ProbeReply, m.Kind)
	assert.Equal(t, Reply{InOp: true, Waiting: []int{4, 2}}, ParseReply(m.Body, 8))
	assert.Equal(t, "timeout", Timeout.String())
	assert.Equal(t, "probe", Probe.String())
}
