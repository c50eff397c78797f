package bench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// The summary of a chaos run: wrong tokens and failures summed, regrows from the
// processes that joined or the most any admitted, the time at full strength and the rates
// before the first kill and after each regrow from the process that served the most.
func TestSummarize(t *testing.T) {
	t0 := time.Unix(1000, 0)
	full, three := ServeSecond{Steps: 100, Ranks: 4}, ServeSecond{Steps: 50, Ranks: 3}
	long := &ServeReport{Rank: 1, StartUnixNS: t0.UnixNano(), Steps: 1000, Grows: 2, WrongTokens: 1,
		Seconds: []ServeSecond{{Steps: 10, Ranks: 4}, full, full, three, {Steps: 80, Ranks: 4}, full, three, full, full}}
	joiner := &ServeReport{Rank: 2, Joined: true, Steps: 10, Error: "boom"}
	s := Summarize([]*ServeReport{long, joiner}, []time.Time{t0.Add(3500 * time.Millisecond), t0.Add(6200 * time.Millisecond)}, 4)
	assert.Equal(t, 2, s.Kills)
	assert.Equal(t, 2, s.Regrows)
	assert.Equal(t, 1, s.WrongTokens)
	assert.Equal(t, 1, s.Errors)
	assert.Equal(t, 1000, s.Steps)
	assert.Equal(t, 9, s.Seconds)
	assert.InDelta(t, 7.0/9, s.FullShare, 1e-9)
	assert.InDelta(t, 100, s.Before, 1e-9, "seconds 1 and 2")
	assert.InDeltaSlice(t, []float64{90, 100}, s.After, 1e-9, "seconds 4-5 (up to the next fault), and 7-8")
}
