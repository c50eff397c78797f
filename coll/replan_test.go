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
