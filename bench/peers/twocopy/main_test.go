//go:build linux

package main

import (
	"bytes"
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestMain runs the ranks: run starts them as copies of this binary, with rankEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(rankEnv) != "" {
		if err := run(os.Args[1:], os.Stdout); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// Every rank receives every other rank's block intact, for even and odd rank counts.
func TestTwoCopyDelivers(t *testing.T) {
	for _, p := range []int{2, 3, 4} {
		var out bytes.Buffer
		n := 4 * p * 300 // blocks that are not a whole number of cache lines
		if err := run([]string{"-ranks", strconv.Itoa(p), "-bytes", strconv.Itoa(n), "-iters", "50"}, &out); err != nil {
			t.Fatalf("P=%d: %v", p, err)
		}
		var res result
		if err := json.Unmarshal(out.Bytes(), &res); err != nil {
			t.Fatalf("P=%d: %v in %q", p, err, out.String())
		}
		if res.Wrong != 0 || res.Iters != 50 || res.Ranks != p || res.Bytes != n || !(res.TimeUS > 0) {
			t.Errorf("P=%d: %+v, want no wrong elements, 50 operations, a time", p, res)
		}
	}
}

func TestTwoCopyRejectsBadSizes(t *testing.T) {
	for _, args := range [][]string{{"-ranks", "1"}, {"-ranks", "65"}, {"-ranks", "3", "-bytes", "100"}, {"-bytes", "0"}} {
		if err := run(args, new(bytes.Buffer)); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}

// A rank that fails (here: told to by failEnv, before it maps anything) must not leave
// the others polling for its counter: run kills them and names it.
func TestTwoCopyRankFailureEnds(t *testing.T) {
	t.Setenv(failEnv, "2")
	done := make(chan error, 1)
	go func() { done <- run([]string{"-ranks", "3", "-bytes", "1200", "-iters", "50"}, new(bytes.Buffer)) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "rank 2") {
			t.Fatalf("got %v, want an error naming rank 2", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("run did not return after a rank failed")
	}
}
