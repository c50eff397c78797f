package coll

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/transporttest"
)

// faultyLocal makes n local ranks whose transports inject faults by rule(rank, msg).
func faultyLocal(t *testing.T, n int, cfg Config, rule func(rank int, m transporttest.Msg) transporttest.Fault) ([]*Comm, []*transporttest.Faulty) {
	t.Helper()
	fs := make([]*transporttest.Faulty, n)
	cfg.Wrap = func(rank int, tr transport.Transport) transport.Transport {
		fs[rank] = transporttest.NewFaulty(tr, func(m transporttest.Msg) transporttest.Fault {
			if m.Tag.Seq == ctlSeq {
				return transporttest.Pass // notices and probes: the faults under test are the data's
			}
			return rule(rank, m)
		})
		return fs[rank]
	}
	return newLocal(t, n, cfg), fs
}

// data is a message of an operation (not the control channel's).
func data(m transporttest.Msg) bool { return m.Tag.Seq != ctlSeq && m.Tag.Seq != p2pSeq }

// errWrongSum is allReduceOK's error for a sum that differs from the reference.
var errWrongSum = errors.New("wrong sum")

// allReduceOK runs an AllReduce of 1000 elements on every rank and checks the sums.
func allReduceOK(cs []*Comm) []error {
	return runOn(cs, func(c *Comm) error {
		x := make([]float32, 1000)
		for i := range x {
			x[i] = float32(c.Rank() + i%3)
		}
		if err := AllReduce(context.Background(), c, nil, x, dtype.Sum); err != nil {
			return err
		}
		p := c.Size()
		for i, v := range x {
			if want := float32(p*(p-1)/2 + p*(i%3)); v != want {
				return errWrongSum
			}
		}
		return nil
	})
}

// A message lost on the way: every rank fails with ErrTimeout, none hangs, and the rank
// that waited for the lost message names its sender.
func TestFaultDrop(t *testing.T) {
	cs, fs := faultyLocal(t, 4, Config{Timeout: 400 * time.Millisecond, Algo: map[OpKind]Algo{OpAllReduce: Ring}},
		func(rank int, m transporttest.Msg) transporttest.Fault {
			if rank == 1 && m.Peer == 2 && m.N == 0 && data(m) {
				return transporttest.Drop
			}
			return transporttest.Pass
		})
	errs := allReduceOK(cs)
	assert.Equal(t, 1, fs[1].Fired(transporttest.Drop))
	for r, err := range errs {
		require.ErrorIs(t, err, ErrTimeout, "rank %d", r)
	}
	var te *TimeoutError
	require.ErrorAs(t, errs[2], &te)
	if te.remote == "" { // its own timeout (not another's notice)
		assert.Contains(t, te.Waiting, 1, "rank 2 waited for rank 1's message")
	}
}

// Late messages change nothing but the time: the results are exact.
func TestFaultDelay(t *testing.T) {
	for _, algo := range []Algo{Ring, RecDoubling} {
		cs, fs := faultyLocal(t, 4, Config{Timeout: 10 * time.Second, Algo: map[OpKind]Algo{OpAllReduce: algo}},
			func(rank int, m transporttest.Msg) transporttest.Fault {
				if data(m) && (rank+m.N)%2 == 0 {
					return transporttest.Delay
				}
				return transporttest.Pass
			})
		for _, f := range fs {
			f.DelayBy = 5 * time.Millisecond
		}
		for i := 0; i < 3; i++ {
			noErr(t, allReduceOK(cs))
		}
		delayed := 0
		for _, f := range fs {
			delayed += f.Fired(transporttest.Delay)
		}
		assert.Positive(t, delayed, "%v: the rule delayed messages", algo)
	}
}

// A message delivered twice (an operation's, which carries its sequence number): the
// copy is never taken for a later operation's message; the results stay exact.
func TestFaultDuplicate(t *testing.T) {
	cs, fs := faultyLocal(t, 3, Config{Timeout: 10 * time.Second}, func(rank int, m transporttest.Msg) transporttest.Fault {
		if data(m) && rank == 0 {
			return transporttest.Duplicate
		}
		return transporttest.Pass
	})
	for i := 0; i < 5; i++ {
		noErr(t, allReduceOK(cs))
	}
	assert.Positive(t, fs[0].Fired(transporttest.Duplicate), "rank 0 sent copies")
	assert.Zero(t, fs[1].Fired(transporttest.Duplicate)+fs[2].Fired(transporttest.Duplicate), "only rank 0's rule fires")
}

// A cable cut between ranks 1 and 2: every rank fails the operation, each with an error
// that names one end of the cut (a PeerError there, an AbortError carrying it elsewhere).
func TestFaultCut(t *testing.T) {
	cs, fs := faultyLocal(t, 4, Config{Timeout: 10 * time.Second, Algo: map[OpKind]Algo{OpAllReduce: Ring}},
		func(int, transporttest.Msg) transporttest.Fault { return transporttest.Pass })
	noErr(t, allReduceOK(cs))
	fs[1].Cut(2)
	fs[2].Cut(1)
	start := time.Now()
	errs := allReduceOK(cs)
	assert.Less(t, time.Since(start), 5*time.Second, "a cut link is seen at once, not at the timeout")
	for r, err := range errs {
		var pe *PeerError
		require.ErrorAs(t, err, &pe, "rank %d: %v", r, err)
		assert.Contains(t, []int{1, 2}, pe.Rank, "rank %d", r)
	}
}

// A bit flipped on the way (above the wire, where no checksum sees it): the rank that
// receives it computes a wrong sum, and only it; the others stay exact. (tcp's
// MOEX_CHECKSUM guards the wire itself; this is the test that the wrapper reaches the
// data.)
func TestFaultFlipReachesTheData(t *testing.T) {
	cs, fs := faultyLocal(t, 2, Config{Timeout: 10 * time.Second, Algo: map[OpKind]Algo{OpAllReduce: Ring}},
		func(rank int, m transporttest.Msg) transporttest.Fault {
			if rank == 0 && data(m) && m.N == 0 {
				return transporttest.Flip
			}
			return transporttest.Pass
		})
	fs[0].FlipBit = 30 // a high exponent bit of the first float
	errs := allReduceOK(cs)
	require.ErrorIs(t, errors.Join(errs...), errWrongSum, "a flipped bit went unnoticed by the sums")
	assert.Equal(t, 1, fs[0].Fired(transporttest.Flip))
}
