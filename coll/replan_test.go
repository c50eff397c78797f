package coll

import (
	"context"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"math/rand/v2"
	"testing"

	"github.com/moex-ai/moex/coll/dtype"
	"github.com/stretchr/testify/assert"
)

// Replanning an AlltoAllv for new matrices (the MoE dispatch path), under every algorithm.
func TestReplanAlltoAllv(t *testing.T) {
	for _, p := range []int{2, 3, 5, 7} {
		for _, algo := range Algorithms[OpAlltoAllv] {
			t.Run(fmt.Sprintf("P=%d/%v", p, algo), func(t *testing.T) {
				noErr(t, world(t, p, Config{Algo: map[OpKind]Algo{OpAlltoAllv: algo}}, func(c *Comm) error {
					var vp VPlan
					for trial := 0; trial < 6; trial++ {
						rng := rand.New(rand.NewPCG(uint64(trial), 1))
						m := make([][]int, p)
						for i := range m {
							m[i] = make([]int, p)
							for j := range m[i] {
								if i != j && rng.IntN(3) > 0 {
									m[i][j] = rng.IntN(40)
								}
							}
						}
						const unit = 24
						if err := c.ReplanAlltoAllv(&vp, m, unit); err != nil {
							return err
						}
						send := make([]byte, vp.SendBytes())
						off := 0
						for j := 0; j < p; j++ {
							for k := 0; k < m[c.Rank()][j]*unit; k++ {
								send[off] = byte(c.Rank()*31 + j*7 + k)
								off++
							}
						}
						recv := make([]byte, vp.RecvBytes())
						if err := c.RunAlltoAllv(context.Background(), &vp, send, recv); err != nil {
							return fmt.Errorf("trial %d: %w", trial, err)
						}
						off = 0
						for i := 0; i < p; i++ {
							for k := 0; k < m[i][c.Rank()]*unit; k++ {
								if recv[off] != byte(i*31+c.Rank()*7+k) {
									return fmt.Errorf("trial %d: byte %d from %d wrong", trial, k, i)
								}
								off++
							}
						}
					}
					return nil
				}))
			})
		}
	}
}

// Describe answers for every operation, the variable-size ones by their fixed-size form.
func TestDescribeEveryOp(t *testing.T) {
	cs := newLocal(t, 2, Config{})
	for op := OpBarrier; op < algos.OpKindEnd; op++ {
		d := cs[0].Describe(op, dtype.F32, 1024, 0)
		assert.Contains(t, d, "rank 0", op.String())
	}
	assert.Contains(t, cs[0].Describe(OpAlltoAllv, dtype.F32, 1024, 0), "alltoall/")
}

// ReplanAlltoAllvAt moves each block from where its sender put it to where its receiver
// wants it, blocks in any order with gaps between them, under every algorithm; the gaps
// of the receive buffer keep their bytes.
func TestReplanAlltoAllvAt(t *testing.T) {
	const unit, gapByte = 8, 0xAA
	// lay places p blocks of n[j] units in a random order, with gaps of 0..2 units.
	lay := func(rng *rand.Rand, n []int) []int {
		off, o := make([]int, len(n)), 0
		for _, j := range rng.Perm(len(n)) {
			o += rng.IntN(3)
			off[j] = o
			o += n[j]
		}
		return off
	}
	for _, p := range []int{1, 2, 3, 5, 8} {
		for _, algo := range Algorithms[OpAlltoAllv] {
			t.Run(fmt.Sprintf("P=%d/%v", p, algo), func(t *testing.T) {
				noErr(t, world(t, p, Config{Algo: map[OpKind]Algo{OpAlltoAllv: algo}}, func(c *Comm) error {
					var vp VPlan
					me := c.Rank()
					for trial := 0; trial < 4; trial++ {
						rng := rand.New(rand.NewPCG(uint64(trial), 2)) // the same on every rank
						m, sendOff := make([][]int, p), make([][]int, p)
						for i := range m {
							m[i] = make([]int, p)
							for j := range m[i] {
								if rng.IntN(4) > 0 {
									m[i][j] = rng.IntN(20)
								}
							}
						}
						for i := range m {
							sendOff[i] = lay(rng, m[i])
						}
						from := make([]int, p)
						for i := range from {
							from[i] = m[i][me]
						}
						recvOff := lay(rand.New(rand.NewPCG(uint64(trial), uint64(me))), from)
						if err := c.ReplanAlltoAllvAt(&vp, m, unit, sendOff, recvOff); err != nil {
							return err
						}
						// (Local ranks have no shared areas: Shared plans the first algorithm;
						// sharedV, over shm, runs it.)
						if vp.Algo != algo && p > 1 && algo != Shared {
							return fmt.Errorf("planned %v, want %v", vp.Algo, algo)
						}
						send := make([]byte, vp.SendBytes())
						for i := range send {
							send[i] = 0xEE
						}
						for j := 0; j < p; j++ {
							for k := 0; k < m[me][j]*unit; k++ {
								send[sendOff[me][j]*unit+k] = byte(me*31 + j*7 + k)
							}
						}
						recv := make([]byte, vp.RecvBytes())
						for i := range recv {
							recv[i] = gapByte
						}
						if err := c.RunAlltoAllv(context.Background(), &vp, send, recv); err != nil {
							return fmt.Errorf("trial %d: %w", trial, err)
						}
						want := make([]byte, len(recv))
						for i := range want {
							want[i] = gapByte
						}
						for i := 0; i < p; i++ {
							for k := 0; k < m[i][me]*unit; k++ {
								want[recvOff[i]*unit+k] = byte(i*31 + me*7 + k)
							}
						}
						if !assert.Equal(t, want, recv, "trial %d, rank %d", trial, me) {
							return fmt.Errorf("trial %d: rank %d received the wrong bytes", trial, me)
						}
					}
					return nil
				}))
			})
		}
	}
}

// Offsets that cannot be a layout are ArgErrors naming them, before anything moves.
func TestReplanAlltoAllvAtRefused(t *testing.T) {
	cs := newLocal(t, 2, Config{})
	m := [][]int{{1, 2}, {3, 4}}
	var vp VPlan
	for _, c := range []struct {
		arg     string
		sendOff [][]int
		recvOff []int
	}{
		{"sendOff", [][]int{{0, 1}}, []int{0, 4}},
		{"sendOff[1][0]", [][]int{{0, 1}, {-1, 3}}, []int{0, 4}},
		{"recvOff", [][]int{{0, 1}, {0, 3}}, []int{0}},
		{"recvOff[1]", [][]int{{0, 1}, {0, 3}}, []int{0, -4}},
		{"recvOff", [][]int{{0, 1}, {0, 3}}, []int{0, 0}}, // the blocks from 0 and 1 overlap
	} {
		var ae *ArgError
		err := cs[0].ReplanAlltoAllvAt(&vp, m, 4, c.sendOff, c.recvOff)
		if assert.ErrorAs(t, err, &ae, c.arg) {
			assert.Equal(t, c.arg, ae.Arg)
		}
	}
}
