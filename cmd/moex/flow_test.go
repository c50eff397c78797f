package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/moex-ai/moex/bench"
	"github.com/moex-ai/moex/coll"
)

// moex flow runs one step and draws it: every section, the links that cross hosts, and
// rows conserved (what ranks send to q is what q's experts receive, a token counted once
// per rank however many of its experts it chose there).
func TestFlow(t *testing.T) {
	cs, err := coll.Local(4, coll.Config{Hosts: []int{0, 0, 1, 1}, Link: &coll.CostNet, HostLink: &coll.CostShm})
	if err != nil {
		t.Fatal(err)
	}
	defer closeAll(cs)
	o := bench.MoEOpts{Model: "tiny-mixtral", Tokens: 40}
	frs, err := onEvery(cs, func(c *coll.Comm) (*bench.FlowRank, error) { return bench.Flow(context.Background(), c, o) })
	if err != nil {
		t.Fatal(err)
	}
	for q := range frs {
		in, rows := 0, 0
		for _, fr := range frs {
			in += fr.RowsTo[q]
		}
		for _, n := range frs[q].RowsPerExpert {
			rows += n
		}
		if in == 0 || in > rows || rows > 2*in {
			t.Fatalf("rank %d: %d rows sent to it, %d rows for its experts (top-2)", q, in, rows)
		}
	}
	var out bytes.Buffer
	printFlow(&out, o, cs[0], frs, true)
	for _, want := range []string{"1. route", "2. counts (AllGather", "3. dispatch (AlltoAllv, linear)", "4. experts",
		"5. combine (AlltoAllv", "6. sum", "(* crosses hosts)", "rank 2 (host 1): experts 4-5", "dispatch schedule, rank 0"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("flow lacks %q:\n%s", want, out.String())
		}
	}
}
