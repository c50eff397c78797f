package combine_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

func routings(p, experts, k int, tokens []int, seed uint64) []*router.Routing {
	rs := make([]*router.Routing, p)
	for o := range rs {
		rng := rand.New(rand.NewPCG(seed, uint64(o)))
		t := tokens[o]
		r := &router.Routing{T: t, K: k, E: experts, Experts: make([]int32, t*k), Weights: make([]float32, t*k)}
		for i := 0; i < t; i++ {
			for j, e := range rng.Perm(experts)[:k] {
				r.Experts[i*k+j], r.Weights[i*k+j] = int32(e), 0.5
				if rng.IntN(9) == 0 {
					r.Experts[i*k+j] = -1
				}
			}
		}
		rs[o] = r
	}
	return rs
}

// The planner alone: rows are conserved (every non-dropped choice lands at one expert of
// the rank its placement names, a token goes once to each such rank), and the byte
// matrices follow the format.
func TestPlan(t *testing.T) {
	const p, experts, k, hid = 5, 12, 3, 256
	pl, err := router.NewPlacement(router.Contiguous, experts, p)
	require.NoError(t, err)
	require.NoError(t, pl.Replicate([]int{0, 7}, 3))
	tokens := []int{17, 0, 9, 30, 4}
	rs := routings(p, experts, k, tokens, 3)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered} {
		for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
			cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: wire, Placement: pl, Mode: mode, MaxTokens: 30}
			plan, err := combine.NewPlan[float32](cfg, combine.Config{PartialDType: dtype.BF16}, rs, false)
			require.NoError(t, err)
			choices, rows := 0, 0
			for o, r := range rs {
				perRank := make([]int, p)
				for i, e := range r.Experts {
					if e >= 0 {
						choices++
						q := pl.RankOf(int(e), o, i/k)
						perRank[q]++
						assert.Contains(t, plan.Layouts[o].Rows[q], int32(i/k))
					}
				}
				assert.Equal(t, perRank, plan.Choices[o], "rank %d's choices per destination", o)
				for q := 0; q < p; q++ {
					rows += plan.Rows[o][q]
				}
			}
			got := 0
			for _, er := range plan.ExpertRows {
				for _, n := range er {
					got += n
				}
			}
			assert.Equal(t, choices, got, "every choice at one expert")
			assert.LessOrEqual(t, rows, choices, "a token once per rank")
			f := plan.Format
			switch wire {
			case dtype.FP8E4M3:
				assert.Equal(t, hid, f.Payload)
				assert.Equal(t, 2, f.Scales)
				assert.Equal(t, hid+8+16, f.WireBytesPerChoice())
			case dtype.I8:
				assert.Equal(t, 1, f.Scales)
			case dtype.BF16:
				assert.Equal(t, 2*hid, f.Payload)
				assert.Zero(t, f.Scales)
			}
			assert.Equal(t, 2*hid, plan.CombineFormat.Row)
			db, cb := plan.DispatchBytes(), plan.CombineBytes()
			for i := 0; i < p; i++ {
				assert.Zero(t, db[i][i])
				for j := 0; j < p; j++ {
					if i == j {
						continue
					}
					switch mode {
					case dispatch.LowLatency:
						assert.Equal(t, 32+plan.Rows[i][j]*(f.MetaBytes(0)+f.Payload+f.ScaleBytes())+8*plan.Choices[i][j], db[i][j], "a 32-byte header")
					case dispatch.Gathered: // every token to every rank, every token's sum back
						assert.Equal(t, tokens[i]*(f.GatheredMeta()+f.Payload+f.ScaleBytes()), db[i][j])
						assert.Equal(t, tokens[j]*plan.CombineFormat.Row, cb[i][j])
						continue
					default: // rows of metadata, payload and scales, 8-aligned
						assert.Equal(t, 32+plan.Rows[i][j]*align8(8+f.Payload+f.ScaleBytes())+8*plan.Choices[i][j], db[i][j], "a 32-byte header")
					}
					assert.Equal(t, 32+plan.Rows[j][i]*plan.CombineFormat.Row, cb[i][j], "combine %d->%d: the rows %d sent %d", i, j, j, i)
				}
			}
		}
	}
	// Bad routing, and too many tokens for the low-latency mode, are ErrInput.
	bad := routings(p, experts, k, tokens, 3)
	bad[3].Experts[0] = experts
	_, err = combine.NewPlan[float32](dispatch.Config{Hidden: hid, TopK: k, Placement: pl}, combine.Config{}, bad, false)
	assert.ErrorIs(t, err, dispatch.ErrInput)
	_, err = combine.NewPlan[float32](dispatch.Config{Hidden: hid, TopK: k, Placement: pl, Mode: dispatch.LowLatency, MaxTokens: 10}, combine.Config{}, rs, false)
	assert.ErrorIs(t, err, dispatch.ErrInput)
	_, err = combine.NewPlan[float32](dispatch.Config{Hidden: hid, TopK: k, Placement: pl}, combine.Config{}, rs[:2], false)
	assert.ErrorIs(t, err, dispatch.ErrConfig)
}

// The fingerprint tells configurations and placements apart.
func TestFingerprint(t *testing.T) {
	a, _ := router.NewPlacement(router.Contiguous, 8, 4)
	b, _ := router.NewPlacement(router.Contiguous, 8, 4)
	cfg := dispatch.Config{Hidden: 8, TopK: 2, Placement: a, WireDType: dtype.BF16, InFlight: 2}
	same := cfg
	same.Placement = b
	assert.Equal(t, dispatch.Fingerprint(cfg), dispatch.Fingerprint(same))
	require.NoError(t, b.Replicate([]int{3}, 2))
	assert.NotEqual(t, dispatch.Fingerprint(cfg), dispatch.Fingerprint(same), "another replica")
	other := cfg
	other.Hidden = 16
	assert.NotEqual(t, dispatch.Fingerprint(cfg), dispatch.Fingerprint(other))
	other = cfg
	other.Mode = dispatch.LowLatency
	assert.NotEqual(t, dispatch.Fingerprint(cfg), dispatch.Fingerprint(other))
}

// At DeepSeek-V3's sizes (hidden 7168, top-8, 256 experts, 8 ranks), fp8 puts at most
// 0.52x bf16's bytes on the wire, in every mode: its rows carry 7168 B of payload and 224 B
// of scales where bf16's carry 14336 B, the same metadata and headers beside them.
func TestFP8WireBytes(t *testing.T) {
	for _, m := range []struct {
		name                  string
		hidden, experts, topK int
	}{{"deepseek-v3", 7168, 256, 8}, {"qwen3-30b-a3b", 2048, 128, 8}} {
		pl, err := router.NewPlacement(router.Contiguous, m.experts, 8)
		require.NoError(t, err)
		tokens := []int{16, 16, 16, 16, 16, 16, 16, 16}
		rs := routings(8, m.experts, m.topK, tokens, 5)
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
			total := map[dtype.Type]int{}
			for _, wire := range []dtype.Type{dtype.BF16, dtype.FP8E4M3} {
				plan, err := combine.NewPlan[float32](dispatch.Config{Hidden: m.hidden, TopK: m.topK, WireDType: wire, Placement: pl, Mode: mode, MaxTokens: 16}, combine.Config{}, rs, false)
				require.NoError(t, err)
				for _, row := range plan.DispatchBytes() {
					for _, n := range row {
						total[wire] += n
					}
				}
			}
			ratio := float64(total[dtype.FP8E4M3]) / float64(total[dtype.BF16])
			t.Logf("%s %v: fp8 %d B, bf16 %d B on the wire: %.4f", m.name, mode, total[dtype.FP8E4M3], total[dtype.BF16], ratio)
			assert.LessOrEqual(t, ratio, 0.52, "%s %v", m.name, mode)
		}
	}
}

func align8(n int) int { return (n + 7) &^ 7 }

// At DeepSeek-V3's sizes on 2 hosts of 4 ranks, a token's 8 experts sit on about 2.6
// ranks of the other host and on the other host once: the two-level dispatch puts at
// most half of the flat dispatch's bytes across hosts (and the combine's partial sums
// likewise), whether the ranks sit on the hosts in blocks or alternate; with one rank a
// host there is nothing to save.
func TestTwoLevelHalvesDeepSeekCrossing(t *testing.T) {
	pl, err := router.NewPlacement(router.Contiguous, 256, 8)
	require.NoError(t, err)
	rs := routings(8, 256, 8, []int{64, 64, 64, 64, 64, 64, 64, 64}, 11)
	for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency} {
		plan, err := combine.NewPlan[float32](dispatch.Config{Hidden: 7168, TopK: 8, WireDType: dtype.BF16, Placement: pl, Mode: mode, MaxTokens: 64}, combine.Config{}, rs, false)
		require.NoError(t, err)
		for _, hosts := range [][]int{{0, 0, 0, 0, 1, 1, 1, 1}, {0, 1, 0, 1, 0, 1, 0, 1}} {
			ht, err := plan.Hosts(hosts)
			require.NoError(t, err)
			flat, two := ht.Flat, ht.TwoLevel
			t.Logf("%v %v: across hosts flat %d B, two-level %d B (%.2f); within flat %d B, two-level %d B",
				mode, hosts, flat.DispatchAcross, two.DispatchAcross, float64(two.DispatchAcross)/float64(flat.DispatchAcross), flat.DispatchWithin, two.DispatchWithin)
			assert.LessOrEqual(t, float64(two.DispatchAcross), 0.5*float64(flat.DispatchAcross), "%v %v", mode, hosts)
			assert.LessOrEqual(t, float64(two.CombineAcross), 0.5*float64(flat.CombineAcross), "%v %v", mode, hosts)
			assert.Greater(t, two.DispatchWithin, flat.DispatchWithin, "the relays hand rows on within the host")
		}
		ht, err := plan.Hosts([]int{0, 1, 2, 3, 4, 5, 6, 7})
		require.NoError(t, err)
		assert.Equal(t, ht.Flat.DispatchAcross, ht.TwoLevel.DispatchAcross, "a rank a host: the same rows across")
		assert.Zero(t, ht.TwoLevel.DispatchWithin)
	}
	_, err = (&combine.Plan{}).Hosts([]int{0})
	assert.Error(t, err)
}

// The model picks two levels where a token's experts spread over several ranks of
// another host (DeepSeek-V3's top-8 of 256), flat where it has little to gain on a fast
// network (Mixtral's top-2 of 8), and flat on one host.
func TestChooseTwoLevel(t *testing.T) {
	hosts := []int{0, 0, 0, 0, 1, 1, 1, 1}
	for _, c := range []struct {
		experts, k int
		gbits      float64
		want       bool
	}{{256, 8, 0, true}, {256, 8, 1, true}, {8, 2, 0, false}} {
		pl, err := router.NewPlacement(router.Contiguous, c.experts, 8)
		require.NoError(t, err)
		errs := onRanks(t, 8, coll.Config{Hosts: hosts, NetGbits: c.gbits}, false, func(cm *coll.Comm) error {
			got, why := dispatch.ChooseTwoLevel(cm, dispatch.Config{Hidden: 7168, TopK: c.k, Placement: pl, MaxTokens: 128})
			if cm.Rank() == 0 {
				t.Logf("%d experts, top-%d, %v Gbit/s: %s", c.experts, c.k, c.gbits, why)
			}
			if got != c.want {
				return fmt.Errorf("%d experts, top-%d: two-level %v, want %v (%s)", c.experts, c.k, got, c.want, why)
			}
			return nil
		})
		for r, err := range errs {
			require.NoError(t, err, "rank %d", r)
		}
	}
	pl, err := router.NewPlacement(router.Contiguous, 256, 4)
	require.NoError(t, err)
	errs := onRanks(t, 4, coll.Config{}, false, func(cm *coll.Comm) error {
		if got, why := dispatch.ChooseTwoLevel(cm, dispatch.Config{Hidden: 7168, TopK: 8, Placement: pl}); got {
			return fmt.Errorf("one host: two-level (%s)", why)
		}
		return nil
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// What the executors move is what the planner plans: on every mode, wire type, way back
// and P=1..8, the schedule each rank's executors laid out at run time (Handle.Schedule,
// from the counts they exchanged and the headers they read) is, block by block, the one
// the pure planner made for that rank from every rank's routing; the bytes each rank's
// stats count (what its executors put on the wire and read in place) sum it; and the
// combined rows are right.
func TestExecutorsFollowSchedule(t *testing.T) {
	const experts, k, hid = 12, 3, 64
	type back struct {
		name string
		cfg  combine.Config
	}
	for p := 1; p <= 8; p++ {
		pl, err := router.NewPlacement(router.RoundRobin, experts, p)
		require.NoError(t, err)
		tokens := make([]int, p)
		for r := range tokens {
			tokens[r] = (r*7 + 5) % 13 // 0 for some ranks at some P
		}
		rs := routings(p, experts, k, tokens, uint64(p))
		for _, mode := range []dispatch.Mode{dispatch.Normal, dispatch.LowLatency, dispatch.Gathered} {
			backs := []back{{"partials", combine.Config{}}, {"bf16 partials", combine.Config{PartialDType: dtype.BF16}}}
			if mode != dispatch.Gathered {
				backs = append(backs, back{"fp8 partials", combine.Config{PartialDType: dtype.FP8E4M3, SendPartials: mode == dispatch.LowLatency}},
					back{"sum at origin", combine.Config{SumAtOrigin: true, SendPartials: mode == dispatch.LowLatency}})
			}
			for _, wire := range []dtype.Type{dtype.F32, dtype.BF16, dtype.FP8E4M3, dtype.I8} {
				for _, b := range backs {
					name := fmt.Sprintf("P=%d/%v/%v/%s", p, mode, wire, b.name)
					cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: wire, Placement: pl, Mode: mode, MaxTokens: 13}
					checkSchedules(t, name, cfg, b.cfg, rs)
				}
			}
		}
		// The Auto mode: its step runs as the low-latency mode where every rank's tokens
		// fit in MaxTokens, as the normal mode where one rank's do not.
		for _, maxTokens := range []int{13, 6} {
			for _, b := range []back{{"partials", combine.Config{}}, {"sum at origin", combine.Config{SumAtOrigin: true, SendPartials: true}}} {
				cfg := dispatch.Config{Hidden: hid, TopK: k, WireDType: dtype.BF16, Placement: pl, MaxTokens: maxTokens}
				checkSchedules(t, fmt.Sprintf("P=%d/auto, MaxTokens %d/%s", p, maxTokens, b.name), cfg, b.cfg, rs)
			}
		}
	}
}

// checkSchedules runs one step of rs on coll.Local ranks and compares each rank's
// schedule and stats with the plan's.
func checkSchedules(t *testing.T, name string, cfg dispatch.Config, ccfg combine.Config, rs []*router.Routing) {
	t.Helper()
	p, hid := len(rs), cfg.Hidden
	plan, err := combine.NewPlan[float32](cfg, ccfg, rs, true) // coll.Local maps every rank's memory
	require.NoError(t, err, name)
	got := make([]dispatch.Schedule, p)
	dstats, cstats := make([]dispatch.Stats, p), make([]combine.Stats, p)
	errs := onRanks(t, p, coll.Config{}, true, func(c *coll.Comm) error {
		ctx := context.Background()
		me := c.Rank()
		d, cb, err := newPairOf[float32](ctx, c, cfg, ccfg)
		if err != nil {
			return err
		}
		defer d.Close()
		defer cb.Close()
		x := make([]float32, rs[me].T*hid)
		for i := range x {
			x[i] = float32(i%7) - 3
		}
		out, h, err := d.Dispatch(ctx, x, rs[me])
		if err != nil {
			return err
		}
		y := make([]float32, out.Rows()*hid)
		for j := 0; j < out.Rows(); j++ {
			if e := out.Entry(j); e != nil {
				copy(y[j*hid:], e)
			} else if q, _ := out.QEntry(j); q != nil {
				out.Dequantize(j, y[j*hid:(j+1)*hid])
			}
		}
		res := make([]float32, len(x))
		if err := cb.Combine(ctx, h, y, res); err != nil {
			return err
		}
		got[me] = h.Schedule() // a copy
		dstats[me], cstats[me] = d.Stats(), cb.Stats()
		return nil
	})
	for r, err := range errs {
		require.NoError(t, err, "%s: rank %d", name, r)
	}
	for r := 0; r < p; r++ {
		want := plan.Schedules[r]
		require.Equal(t, want, got[r], "%s: rank %d's schedule", name, r)
		var sent, recv, csent int
		for q := 0; q < p; q++ {
			if q != r {
				sent += want.Dispatch.Send[q].Total() + want.Dispatch.Send[q].Read
				recv += want.Dispatch.Recv[q].Total() + want.Dispatch.Recv[q].Read
				csent += want.Combine.Send[q].Total()
			}
		}
		assert.Equal(t, sent, dstats[r].BytesSent, "%s: rank %d's dispatch bytes sent", name, r)
		assert.Equal(t, recv, dstats[r].BytesReceived, "%s: rank %d's dispatch bytes received", name, r)
		assert.Equal(t, csent, cstats[r].BytesSent, "%s: rank %d's combine bytes sent", name, r)
		for q := 0; q < p; q++ {
			assert.Equal(t, want.Dispatch.Send[q].Rows, dstats[r].RowsPerRank[q], "%s: rank %d's rows for rank %d", name, r, q)
			if cfg.Mode != dispatch.Gathered { // where every token goes to every rank
				assert.Equal(t, plan.Rows[r][q], dstats[r].RowsPerRank[q], "%s: rank %d's rows for rank %d", name, r, q)
			}
		}
	}
}
