package coll

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll/dtype"
)

// Profiling names the straggler: rank 2 enters every AllReduce 200 ms after the others.
// They wait for it (Wait holds those 200 ms), it does not, and every rank's profile says
// rank 2 arrived last. Results stay correct with profiling (and verification) on.
func TestProfileNamesTheStraggler(t *testing.T) {
	const p, late, rounds = 4, 2, 2
	const delay = 200 * time.Millisecond
	for _, verify := range []bool{false, true} {
		cs := newLocal(t, p, Config{Profile: true, Verify: verify})
		ctx := context.Background()
		noErr(t, runOn(cs, func(c *Comm) error {
			for i := 0; i < rounds; i++ {
				if c.Rank() == late {
					time.Sleep(delay)
				}
				x := []float32{float32(c.Rank()), 1}
				if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
					return err
				}
				if x[0] != 0+1+2+3 || x[1] != p {
					t.Errorf("rank %d: allreduce gave %v", c.Rank(), x)
				}
			}
			return nil
		}))
		for _, c := range cs {
			prof := c.ProfileOf(OpAllReduce)
			if prof.Count != rounds {
				t.Fatalf("rank %d: %d allreduces profiled, want %d", c.Rank(), prof.Count, rounds)
			}
			if prof.Last[late] != rounds {
				t.Errorf("rank %d: last arrivals %v, want rank %d every time", c.Rank(), prof.Last, late)
			}
			if c.Rank() != late && prof.Wait < rounds*delay/2 {
				t.Errorf("rank %d waited %v in %d rounds behind a %v straggler", c.Rank(), prof.Wait, rounds, delay)
			}
			if prof.Skew < rounds*delay/2 {
				t.Errorf("rank %d: skew %v, want about %v", c.Rank(), prof.Skew, rounds*delay)
			}
			t.Logf("rank %d: %v", c.Rank(), prof)
			if len(c.Profile()) != 1 {
				t.Errorf("rank %d: profiles of %d kinds, want 1", c.Rank(), len(c.Profile()))
			}
		}
		if got := cs[late].ProfileOf(OpAllReduce).Wait; got > cs[0].ProfileOf(OpAllReduce).Wait {
			t.Errorf("the straggler waited %v, more than rank 0 (%v)", got, cs[0].ProfileOf(OpAllReduce).Wait)
		}
	}
	// Off by default: nothing recorded.
	cs := newLocal(t, 2, Config{})
	noErr(t, runOn(cs, func(c *Comm) error { return Barrier(context.Background(), c) }))
	if prof := cs[0].Profile(); prof != nil {
		t.Fatalf("profile without Config.Profile: %v", prof)
	}
}

// With TraceDir every rank writes, at Close, a Chrome-trace file of its operations: each
// op a slice with its algorithm, split into wait and move, naming the rank that came last.
func TestTraceFiles(t *testing.T) {
	dir := t.TempDir()
	const p, late = 3, 1
	cs, err := Local(p, Config{TraceDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	noErr(t, runOn(cs, func(c *Comm) error {
		if c.Rank() == late {
			time.Sleep(50 * time.Millisecond)
		}
		x := make([]float32, 1000)
		if err := AllReduce(ctx, c, nil, x, dtype.Sum); err != nil {
			return err
		}
		return AlltoAll(ctx, c, make([]int32, 3*p), make([]int32, 3*p))
	}))
	paths := make([]string, p)
	for r, c := range cs {
		paths[r] = c.TracePath()
		if err := c.Close(); err != nil {
			t.Fatalf("rank %d close: %v", r, err)
		}
	}
	for r, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		var doc struct {
			TraceEvents []struct {
				Name string         `json:"name"`
				Ph   string         `json:"ph"`
				Ts   float64        `json:"ts"`
				Dur  float64        `json:"dur"`
				Pid  int            `json:"pid"`
				Args map[string]any `json:"args"`
			} `json:"traceEvents"`
		}
		if err := json.Unmarshal(b, &doc); err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		var ops []string
		waits := 0
		for _, e := range doc.TraceEvents {
			if e.Pid != r {
				t.Fatalf("rank %d: event of pid %d", r, e.Pid)
			}
			switch e.Name {
			case "allreduce", "alltoall":
				ops = append(ops, e.Name)
				if e.Ph != "X" || e.Ts <= 0 || e.Args["algo"] == "" {
					t.Fatalf("rank %d: event %+v", r, e)
				}
				if e.Name == "allreduce" && e.Args["last_rank"] != float64(late) {
					t.Errorf("rank %d: allreduce names rank %v as last, want %d", r, e.Args["last_rank"], late)
				}
			case "wait":
				waits++
			}
		}
		if len(ops) != 2 || ops[0] != "allreduce" || ops[1] != "alltoall" || waits != 2 {
			t.Fatalf("rank %d: ops %v, %d waits", r, ops, waits)
		}
	}
}

// An exchange, profiled, names the rank whose blocks it waited for: rank 2 fills its
// blocks 100 ms after the others. Every other rank's wait is charged to rank 2, which
// arrived last every time; rank 2 waits for nobody. Windows and messages alike, with the
// data checked.
func TestExchangeProfileNamesTheStraggler(t *testing.T) {
	const p, late, rounds = 4, 2, 2
	const delay = 100 * time.Millisecond
	fields := []int{64, 1 << 10}
	for _, windows := range []bool{true, false} {
		t.Run(fmt.Sprintf("windows=%v", windows), func(t *testing.T) {
			cs := newLocal(t, p, Config{Profile: true, NoWindows: !windows})
			ctx := context.Background()
			noErr(t, runOn(cs, func(c *Comm) error { return lateExchanges(ctx, c, fields, rounds, late, delay) }))
			for _, c := range cs {
				prof := c.ProfileOf(OpExchange)
				require.Equal(t, rounds, prof.Count, "rank %d", c.Rank())
				var sum time.Duration
				for _, d := range prof.WaitFor {
					sum += d
				}
				assert.Equal(t, prof.Wait, sum, "rank %d: the wait is charged to the ranks", c.Rank())
				if c.Rank() == late {
					assert.Less(t, prof.Wait, rounds*delay/2, "the straggler waits for nobody")
					continue
				}
				assert.Equal(t, rounds, prof.Last[late], "rank %d: last arrivals %v", c.Rank(), prof.Last)
				assert.GreaterOrEqual(t, prof.WaitFor[late], rounds*delay/2, "rank %d: waited for rank %d %v", c.Rank(), late, prof.WaitFor)
				for q, d := range prof.WaitFor {
					if q != late {
						assert.Less(t, d, prof.WaitFor[late], "rank %d: charged rank %d more than the straggler", c.Rank(), q)
					}
				}
				t.Logf("rank %d: %v", c.Rank(), prof)
			}
		})
	}
	// Off by default: nothing recorded.
	cs := newLocal(t, 2, Config{})
	noErr(t, runOn(cs, func(c *Comm) error {
		x, err := c.NewExchange(context.Background(), ExchangeConfig{Fields: []int{8}})
		if err != nil {
			return err
		}
		defer x.Close()
		return exchangeRounds(c, x, []int{8}, 1)
	}))
	assert.Zero(t, cs[0].ProfileOf(OpExchange).Count)
}

// A traced exchange is a slice of its sends then its wait, naming the rank that came last
// and charging each rank with its part of the wait.
func TestTraceExchange(t *testing.T) {
	dir := t.TempDir()
	const p, late = 3, 1
	const delay = 50 * time.Millisecond
	cs, err := Local(p, Config{TraceDir: dir})
	require.NoError(t, err)
	ctx := context.Background()
	noErr(t, runOn(cs, func(c *Comm) error { return lateExchanges(ctx, c, []int{64, 1 << 10}, 1, late, delay) }))
	for r, c := range cs {
		path := c.TracePath()
		require.NoError(t, c.Close(), "rank %d", r)
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		var doc struct {
			TraceEvents []struct {
				Name string         `json:"name"`
				Dur  float64        `json:"dur"`
				Args map[string]any `json:"args"`
			} `json:"traceEvents"`
		}
		require.NoError(t, json.Unmarshal(b, &doc))
		var names []string
		for _, e := range doc.TraceEvents {
			names = append(names, e.Name)
			if e.Name != "exchange" {
				continue
			}
			if r == late {
				assert.Less(t, e.Args["wait_us"], float64(delay/time.Microsecond)/2, "the late rank waited for nobody")
				assert.GreaterOrEqual(t, e.Dur, float64(delay/time.Microsecond), "its sends came after its delay")
				continue
			}
			assert.Equal(t, float64(late), e.Args["last_rank"], "rank %d", r)
			waitFor, _ := e.Args["wait_for_us"].(map[string]any)
			assert.GreaterOrEqual(t, waitFor[fmt.Sprint(late)], float64(delay/time.Microsecond)/2, "rank %d: %v", r, waitFor)
		}
		require.GreaterOrEqual(t, len(names), 3)
		assert.Equal(t, []string{"exchange", "send", "wait"}, names[len(names)-3:], "rank %d: after NewExchange's all-gathers", r)
	}
}

// lateExchanges runs rounds of exchanges of the given fields on c, rank late filling its
// blocks delay after beginning each, and checks the bytes that arrived in field 1.
func lateExchanges(ctx context.Context, c *Comm, fields []int, rounds, late int, delay time.Duration) error {
	x, err := c.NewExchange(ctx, ExchangeConfig{Fields: fields})
	if err != nil {
		return err
	}
	defer x.Close()
	for i := 0; i < rounds; i++ {
		o, err := x.Begin(ctx)
		if err != nil {
			return err
		}
		if c.Rank() == late {
			time.Sleep(delay)
		}
		for q := 0; q < c.Size(); q++ {
			dst, err := o.Dest(ctx, q)
			if err != nil {
				return err
			}
			xfill(dst[1][:100], o.Epoch(), c.Rank(), q, 1)
			if err := o.Send(q, 0, 100); err != nil {
				return err
			}
		}
		if err := o.Wait(ctx); err != nil {
			return err
		}
		for q := 0; q < c.Size(); q++ {
			if err := xcheck(o.Recv(q, 1), o.Epoch(), q, c.Rank(), 1); err != nil {
				return err
			}
		}
	}
	return nil
}
