package coll

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
)

// AlltoAllv with random uneven counts, ranks that send or receive nothing, under every
// algorithm (property-based: many random layouts).
func TestAlltoAllvRandom(t *testing.T) {
	ctx := context.Background()
	for _, p := range testPs {
		for _, algo := range Algorithms[OpAlltoAllv] {
			t.Run(fmt.Sprintf("P=%d/%v", p, algo), func(t *testing.T) {
				cs := newLocal(t, p, Config{Algo: map[OpKind]Algo{OpAlltoAllv: algo}})
				rng := rand.New(rand.NewPCG(uint64(p), uint64(algo)))
				for trial := 0; trial < 12; trial++ {
					m := make([][]int, p)
					for i := range m {
						m[i] = make([]int, p)
						for j := range m[i] {
							switch {
							case trial%4 == 1 && i == p-1: // a rank that sends nothing
							case trial%4 == 2 && j == 0: // a rank that receives nothing
							case rng.IntN(4) == 0:
							default:
								m[i][j] = rng.IntN(3000)
							}
						}
					}
					checkAlltoAllv(t, ctx, cs, m, trial%2 == 0)
				}
			})
		}
	}
}

func checkAlltoAllv(t *testing.T, ctx context.Context, cs []*Comm, m [][]int, displaced bool) {
	t.Helper()
	p := len(cs)
	outs := make([][]float32, p)
	rdispl := make([][]int, p)
	noErr(t, runOn(cs, func(c *Comm) error {
		r := c.Rank()
		sc, rc := make([]int, p), make([]int, p)
		for j := 0; j < p; j++ {
			sc[j], rc[j] = m[r][j], m[j][r]
		}
		var sd, rd []int
		stotal, rtotal := 0, 0
		if displaced { // gaps between blocks, reverse order on the send side
			sd, rd = make([]int, p), make([]int, p)
			for j := p - 1; j >= 0; j-- {
				sd[j] = stotal
				stotal += sc[j] + 5
			}
			for j := 0; j < p; j++ {
				rd[j] = rtotal
				rtotal += rc[j] + 3
			}
		} else {
			for j := 0; j < p; j++ {
				stotal += sc[j]
				rtotal += rc[j]
			}
		}
		send := make([]float32, stotal)
		off := 0
		for j := 0; j < p; j++ {
			o := off
			if sd != nil {
				o = sd[j]
			}
			for k := 0; k < sc[j]; k++ {
				send[o+k] = float32(r*1e6 + j*1e4 + k)
			}
			off += sc[j]
		}
		recv := make([]float32, rtotal)
		outs[r], rdispl[r] = recv, rd
		return AlltoAllv(ctx, c, send, sc, sd, recv, rc, rd)
	}))
	for r := 0; r < p; r++ {
		off := 0
		for i := 0; i < p; i++ {
			o := off
			if rdispl[r] != nil {
				o = rdispl[r][i]
			}
			for k := 0; k < m[i][r]; k++ {
				if got, want := outs[r][o+k], float32(i*1e6+r*1e4+k); got != want {
					t.Fatalf("rank %d, element %d from rank %d: got %v want %v", r, k, i, got, want)
				}
			}
			off += m[i][r]
		}
	}
}

func TestPlanAlltoAllvReuse(t *testing.T) {
	ctx := context.Background()
	p := 4
	m := [][]int{{1, 0, 3, 2}, {0, 0, 0, 0}, {5, 1, 0, 1}, {2, 2, 2, 2}}
	for _, algo := range []Algo{AlgoAuto, Linear, Pairwise, Bruck} {
		noErr(t, world(t, p, Config{Algo: map[OpKind]Algo{OpAlltoAllv: algo}}, func(c *Comm) error {
			vp, err := c.PlanAlltoAllv(m, 8)
			if err != nil {
				return err
			}
			for it := 0; it < 3; it++ {
				send := make([]byte, vp.SendBytes())
				for i := range send {
					send[i] = byte(c.Rank()*50 + i + it)
				}
				recv := make([]byte, vp.RecvBytes())
				if err := c.RunAlltoAllv(ctx, vp, send, recv); err != nil {
					return err
				}
				off := 0
				for i := 0; i < p; i++ {
					// rank i's block for us starts after its blocks for ranks < c.Rank()
					so := 0
					for j := 0; j < c.Rank(); j++ {
						so += m[i][j] * 8
					}
					for k := 0; k < m[i][c.Rank()]*8; k++ {
						if recv[off+k] != byte(i*50+so+k+it) {
							return fmt.Errorf("algo %v: byte %d from rank %d wrong", algo, k, i)
						}
					}
					off += m[i][c.Rank()] * 8
				}
			}
			return nil
		}))
	}
}
