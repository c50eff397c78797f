package coll

import (
	"context"
	"fmt"
	"github.com/moex-ai/moex/coll/algos"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/moex-ai/moex/internal/long"

	"github.com/moex-ai/moex/coll/dtype"
)

// hostLayouts are pretend placements of ranks on hosts: blocks, alternating, several
// hosts, and hosts with unequal numbers of ranks (which get the flat ring).
var hostLayouts = [][]int{
	{0, 0, 1, 1},
	{0, 1, 0, 1},
	{0, 0, 0, 1, 1, 1},
	{0, 0, 1, 1, 2, 2},
	{0, 1, 2, 3, 0, 1, 2, 3},
	{0, 0, 0, 0, 1, 1, 1, 1},
	{5, 5, 5, 9},
	{0, 1, 2},
}

// The hierarchical AllReduce equals the reference, bit for bit on every rank, for every
// layout, in and out of place, with sizes smaller than the number of chunks.
func TestAllReduceHier(t *testing.T) {
	ctx := context.Background()
	types := []dtype.Type{dtype.F32, dtype.BF16, dtype.I64, dtype.F64}
	for _, hosts := range hostLayouts {
		p := len(hosts)
		t.Run(fmt.Sprint(hosts), func(t *testing.T) {
			cs := newLocal(t, p, Config{Hosts: hosts, Algo: map[OpKind]Algo{OpAllReduce: Hier}})
			for _, dt := range types {
				for _, op := range []dtype.Op{dtype.Sum, dtype.Avg, dtype.Max} {
					sizes := []int{0, 1, 3, 13, 1001}
					if dt == dtype.F32 && op == dtype.Sum {
						sizes = append(sizes, (1<<20)/4)
					}
					for _, n := range sizes {
						checkAllReduce(t, ctx, cs, dt, op, n)
					}
				}
			}
		})
	}
}

// crossings counts the transfers of a plan that go to a rank on another host.
func crossings(pl *algos.Plan, hosts []int, rank int) int {
	n := 0
	for _, s := range pl.Steps {
		for _, x := range s.Sends {
			if hosts[x.Peer] != hosts[rank] {
				n++
			}
		}
	}
	return n
}

// Only 2(H-1) messages per rank cross hosts in the hierarchical plan, whatever the rank
// order; a flat ring over alternating hosts crosses at every one of its 2(P-1) steps.
func TestHierPlanCrossesHostsLess(t *testing.T) {
	hosts := []int{0, 1, 0, 1, 0, 1, 0, 1}
	topo := algos.NewTopology(hosts)
	for r := range hosts {
		sh := algos.Shape{P: len(hosts), Rank: r, Es: 4, Count: 1 << 20}
		if got := crossings(algos.PlanAllReduceHier(sh, topo), hosts, r); got != 2*(2-1) {
			t.Errorf("rank %d: hierarchical plan crosses hosts %d times, want 2", r, got)
		}
		if got := crossings(algos.PlanAllReduceRing(sh), hosts, r); got != 2*(len(hosts)-1) {
			t.Errorf("rank %d: flat ring crosses hosts %d times, want %d", r, got, 2*(len(hosts)-1))
		}
	}
}

// With a network between hosts and shared memory within them, the model picks the
// hierarchical AllReduce for large messages when hosts hold several ranks each, or when
// the rank order alternates hosts; on one host it never offers it. (With two ranks per
// host in blocks the flat ring is as good: its per-host traffic is about the same and
// its local and network hops overlap, and the model says so.)
func TestModelPicksHier(t *testing.T) {
	for _, hosts := range [][]int{{0, 0, 0, 0, 1, 1, 1, 1}, {0, 1, 0, 1, 0, 1, 0, 1}, {0, 1, 2, 3, 0, 1, 2, 3}} {
		cs := newLocal(t, len(hosts), Config{Hosts: hosts, Link: &CostNet, HostLink: &CostShm})
		for _, n := range []int{1 << 20, 64 << 20} {
			if a := cs[0].choose(OpAllReduce, n); a != Hier {
				t.Errorf("hosts %v, %d B: model chose %v, want hier", hosts, n, a)
			}
		}
	}
	cs := newLocal(t, 8, Config{})
	for _, n := range []int{8, 1 << 20, 64 << 20} {
		if a := cs[0].choose(OpAllReduce, n); a == Hier {
			t.Errorf("one host, %d B: model chose hier", n)
		}
	}
}

// The hierarchical AllGather and ReduceScatter deliver what the flat ones do, for every
// layout (unequal hosts fall back to the ring), in and out of place.
func TestAllGatherReduceScatterHier(t *testing.T) {
	ctx := context.Background()
	for _, hosts := range hostLayouts {
		t.Run(fmt.Sprint(hosts), func(t *testing.T) {
			cs := newLocal(t, len(hosts), Config{Hosts: hosts, Algo: map[OpKind]Algo{OpAllGather: Hier, OpReduceScatter: Hier}})
			types := []dtype.Type{dtype.F32, dtype.U8} // the quick cut: the widest and narrowest
			if long.Enabled() {
				types = append(types, dtype.BF16, dtype.I64)
			}
			for _, dt := range types {
				for _, n := range []int{0, 1, 13, (256 << 10) / dt.Size()} {
					checkAllGather(t, ctx, cs, dt, n, false)
					checkAllGather(t, ctx, cs, dt, n, true)
					checkReduceScatter(t, ctx, cs, dt, n)
				}
			}
		})
	}
}

// Across alternating hosts a rank sends H-1 blocks to other hosts in the hierarchical
// AllGather and ReduceScatter, against P-1 for the flat rings.
func TestHierGatherScatterCrossLess(t *testing.T) {
	hosts := []int{0, 1, 0, 1, 0, 1, 0, 1}
	topo := algos.NewTopology(hosts)
	for r := range hosts {
		sh := algos.Shape{P: len(hosts), Rank: r, Es: 4, Count: 1000}
		for _, c := range []struct {
			name       string
			hier, flat *algos.Plan
		}{
			{"allgather", algos.PlanAllGatherHier(sh, topo), algos.PlanAllGatherRing(sh)},
			{"reducescatter", algos.PlanReduceScatterHier(sh, topo), algos.PlanReduceScatterRing(sh)},
		} {
			if got := crossings(c.hier, hosts, r); got != 1 {
				t.Errorf("rank %d: hierarchical %s crosses hosts %d times, want 1", r, c.name, got)
			}
			if got := crossings(c.flat, hosts, r); got != len(hosts)-1 {
				t.Errorf("rank %d: flat %s crosses hosts %d times, want %d", r, c.name, got, len(hosts)-1)
			}
		}
	}
	cs := newLocal(t, len(hosts), Config{Hosts: hosts, Link: &CostNet, HostLink: &CostShm})
	for _, op := range []OpKind{OpAllGather, OpReduceScatter} {
		if a := cs[0].choose(op, 4<<20); a != Hier {
			t.Errorf("alternating hosts, %v of 4 MiB blocks: model chose %v, want hier", op, a)
		}
	}
}

// The two-level AlltoAll and AlltoAllv deliver what the flat ones do, for every layout
// (hosts with unequal numbers of ranks and one host included), in and out of place, with
// blocks that are empty, unaligned and large, counts exchanged or planned from the
// whole matrix.
func TestAlltoAllHier(t *testing.T) {
	ctx := context.Background()
	layouts := append(slices.Clone(hostLayouts), []int{0, 0, 0, 1}, []int{3, 1, 1, 3, 3})
	for _, hosts := range layouts {
		t.Run(fmt.Sprint(hosts), func(t *testing.T) {
			p := len(hosts)
			cs := newLocal(t, p, Config{Hosts: hosts, Algo: map[OpKind]Algo{OpAlltoAll: Hier, OpAlltoAllv: Hier}})
			for _, dt := range []dtype.Type{dtype.U8, dtype.BF16, dtype.F32, dtype.F64} {
				for _, n := range []int{0, 1, 13, (64 << 10) / dt.Size()} {
					checkAlltoAll(t, ctx, cs, dt, n, false)
					checkAlltoAll(t, ctx, cs, dt, n, true)
				}
			}
			rng := rand.New(rand.NewPCG(uint64(p), 7))
			for trial := 0; trial < 6; trial++ {
				m := make([][]int, p)
				for i := range m {
					m[i] = make([]int, p)
					for j := range m[i] {
						if trial%3 != 1 || i != p-1 { // trial 1: the last rank sends nothing
							m[i][j] = rng.IntN(3) * rng.IntN(2000)
						}
					}
				}
				checkAlltoAllv(t, ctx, cs, m, trial%2 == 0)
				checkPlannedAlltoAllv(t, ctx, cs, m)
			}
		})
	}
}

// checkPlannedAlltoAllv runs the AlltoAllv of m (float32 elements) from a VPlan and
// checks every byte.
func checkPlannedAlltoAllv(t *testing.T, ctx context.Context, cs []*Comm, m [][]int) {
	t.Helper()
	p := len(cs)
	algos := make([]Algo, p)
	noErr(t, runOn(cs, func(c *Comm) error {
		r := c.Rank()
		vp, err := c.PlanAlltoAllv(m, 4)
		if err != nil {
			return err
		}
		algos[r] = vp.Algo
		send := make([]float32, vp.SendBytes()/4)
		o := 0
		for j := 0; j < p; j++ {
			for k := 0; k < m[r][j]; k++ {
				send[o] = float32(r*1e6 + j*1e4 + k)
				o++
			}
		}
		recv := make([]float32, vp.RecvBytes()/4)
		if err := c.RunAlltoAllv(ctx, vp, dtype.Bytes(send), dtype.Bytes(recv)); err != nil {
			return err
		}
		o = 0
		for i := 0; i < p; i++ {
			for k := 0; k < m[i][r]; k++ {
				if want := float32(i*1e6 + r*1e4 + k); recv[o] != want {
					return fmt.Errorf("rank %d, element %d from rank %d: %v, want %v", r, k, i, recv[o], want)
				}
				o++
			}
		}
		return nil
	}))
	for r, a := range algos {
		if a != Hier {
			t.Fatalf("rank %d planned %v, want hier (MOEX_ALGO)", r, a)
		}
	}
}

// A rank of the two-level AlltoAll sends H-1 messages to other hosts, whatever the rank
// order; the flat one sends a message to every rank elsewhere.
func TestAlltoAllHierCrossesLess(t *testing.T) {
	for _, hosts := range [][]int{{0, 1, 0, 1, 0, 1, 0, 1}, {0, 0, 0, 0, 1, 1, 1, 1}, {0, 1, 2, 0, 1, 2}, {0, 0, 0, 1}} {
		topo := algos.NewTopology(hosts)
		p := len(hosts)
		l := algos.EvenLayout(p, 1000)
		for r := range hosts {
			var hier, flat algos.Plan
			algos.PlanAlltoAllHier(&hier, topo, r, l, func(int, int) int { return 1000 })
			algos.PlanAlltoAllLinear(&flat, p, r, l)
			elsewhere := p - len(topo.Members[topo.HostOf[r]])
			if got := crossings(&hier, hosts, r); got != topo.Hosts-1 {
				t.Errorf("hosts %v rank %d: two-level plan sends %d messages to other hosts, want %d", hosts, r, got, topo.Hosts-1)
			}
			if got := crossings(&flat, hosts, r); got != elsewhere {
				t.Errorf("hosts %v rank %d: flat plan sends %d messages to other hosts, want %d", hosts, r, got, elsewhere)
			}
		}
	}
}

// Across hosts the model counts messages per link: two-level for small blocks, where
// messages cost more than bytes, and flat for large ones, where relaying costs a copy
// more and saves nothing on the link; on one host it never offers two-level.
func TestModelPicksHierAlltoAll(t *testing.T) {
	for _, hosts := range [][]int{{0, 0, 0, 0, 1, 1, 1, 1}, {0, 1, 0, 1, 0, 1, 0, 1}} {
		cs := newLocal(t, len(hosts), Config{Hosts: hosts, Link: &CostNet, HostLink: &CostShm})
		for _, op := range []OpKind{OpAlltoAll, OpAlltoAllv} {
			if a := cs[0].choose(op, 256); a != Hier {
				t.Errorf("hosts %v, %v of 256 B blocks: model chose %v, want hier", hosts, op, a)
			}
			if a := cs[0].choose(op, 4<<20); a == Hier {
				t.Errorf("hosts %v, %v of 4 MiB blocks: model chose hier", hosts, op)
			}
		}
	}
	cs := newLocal(t, 8, Config{})
	for _, n := range []int{8, 1 << 20} {
		if a := cs[0].choose(OpAlltoAll, n); a == Hier {
			t.Errorf("one host, %d B: model chose hier", n)
		}
	}
}
