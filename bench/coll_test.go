package bench

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
)

// With profiling, a straggler shows up as wait, and is named.
func TestCollProfileStraggler(t *testing.T) {
	const p, late = 3, 1
	cs, err := coll.Local(p, coll.Config{Profile: true})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	o := CollOpts{Op: coll.OpAllReduce, MinBytes: 4096, MaxBytes: 4096, DType: dtype.F32, RedOp: dtype.Sum,
		Iters: 5, Check: true, Profile: true, StraggleRank: late, StraggleDelay: 5 * time.Millisecond}
	var rows []CollResult
	var wg sync.WaitGroup
	errs := make([]error, p)
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := Coll(context.Background(), c, o)
			errs[c.Rank()] = err
			if c.Rank() == 0 {
				rows = r
			}
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	if len(rows) != 1 {
		t.Fatalf("%d rows", len(rows))
	}
	r := rows[0]
	if r.Wrong != 0 {
		t.Fatalf("%d wrong", r.Wrong)
	}
	if r.LastRank == nil || *r.LastRank != late {
		t.Fatalf("last rank %v, want %d", r.LastRank, late)
	}
	if r.WaitUS < 2500 {
		t.Errorf("wait %.1f us per op behind a 5 ms straggler", r.WaitUS)
	}
	var out bytes.Buffer
	PrintColl(&out, rows)
	if !strings.Contains(out.String(), "wait (us)") || !strings.Contains(out.String(), "last rank") {
		t.Errorf("table without the profile columns:\n%s", out.String())
	}
}
