package bench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// The summary of a chaos run lays every process's seconds on the wall clock: a second's
// steps are the most any process served, and the time short of ranks the most any process
// counted in it; wrong tokens and failures are summed; regrows are the
// processes that joined, or the most any admitted; the rates come before the first kill
// and after each regrow, up to the next fault.
func TestSummarize(t *testing.T) {
	t0 := time.Unix(1000, 0)
	full, three := ServeSecond{Steps: 100, Ranks: 4}, ServeSecond{Steps: 50, Ranks: 3, ShortMS: 400}
	// An original process killed in its fourth second (its last snapshot), a survivor
	// that served throughout, and the process that took the first one's rank over.
	killed := &ServeReport{Rank: 2, StartUnixNS: t0.UnixNano(), Seconds: []ServeSecond{{Steps: 10, Ranks: 4}, full, full}}
	survivor := &ServeReport{Rank: 1, StartUnixNS: t0.UnixNano(), Steps: 800, Grows: 1, WrongTokens: 1,
		Seconds: []ServeSecond{{Steps: 10, Ranks: 4}, full, full, three, {Steps: 80, Ranks: 4}, full, three, full, full}}
	joiner := &ServeReport{Rank: 2, Joined: true, StartUnixNS: t0.Add(4200 * time.Millisecond).UnixNano(), Steps: 10, Error: "boom",
		Seconds: []ServeSecond{{Steps: 90, Ranks: 4}, full, three, full, full}}
	s := Summarize([]*ServeReport{killed, survivor, joiner}, []time.Time{t0.Add(3500 * time.Millisecond), t0.Add(6200 * time.Millisecond)}, 4)
	assert.Equal(t, 2, s.Kills)
	assert.Equal(t, 1, s.Regrows)
	assert.Equal(t, 1, s.WrongTokens)
	assert.Equal(t, 1, s.Errors)
	assert.Equal(t, 10+100+100+50+90+100+50+100+100, s.Steps)
	assert.Equal(t, 9, s.Seconds)
	assert.InDelta(t, 1-0.8/9, s.FullShare, 1e-9, "short 400 ms in seconds 3 and 6 (the most any process counted)")
	assert.InDelta(t, 100, s.Before, 1e-9, "seconds 1 and 2")
	assert.InDeltaSlice(t, []float64{95, 100}, s.After, 1e-9, "seconds 4-5 (up to the next fault), and 7-8")
}
