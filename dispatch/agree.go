package dispatch

import (
	"context"
	"fmt"
	"strings"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/coll/health"
)

// ConfigMismatchError says which field of the configuration the ranks disagree on, when
// New finds it (in the modes where New is collective: Auto and LowLatency): Field, the
// odd Ranks (whose Value differs from the most ranks'; on a tie, from the lowest rank's)
// and the others (Rest, with Want). Every rank gets the same one, and a launcher (moex
// run) blames the odd ranks. It matches ErrMismatch.
type ConfigMismatchError struct {
	Field string // the Config field ("Placement": the placement's experts or their ranks)
	Ranks []int  // the odd ranks
	Value string // their value
	Want  string // the others' value
	Rest  []int  // the others
}

func (e *ConfigMismatchError) Error() string {
	return fmt.Sprintf("dispatch: ranks disagree on Config.%s: %s %s %s, %s %s %s", e.Field,
		rankList(e.Ranks), have(len(e.Ranks)), e.Value, rankList(e.Rest), have(len(e.Rest)), e.Want)
}

func (e *ConfigMismatchError) Unwrap() error { return ErrMismatch }

func rankList(rs []int) string {
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = fmt.Sprint(r)
	}
	if len(rs) == 1 {
		return "rank " + s[0]
	}
	return "ranks " + strings.Join(s, ", ")
}

func have(n int) string {
	if n == 1 {
		return "has"
	}
	return "have"
}

// configField is one field of what New agrees on: its name, and its value as a number
// and as text.
type configField struct {
	name string
	val  func(cfg Config) int64
	text func(v int64) string
}

func num(v int64) string { return fmt.Sprint(v) }

var configFields = []configField{
	{"Hidden", func(c Config) int64 { return int64(c.Hidden) }, num},
	{"TopK", func(c Config) int64 { return int64(c.TopK) }, num},
	{"WireDType", func(c Config) int64 { return int64(c.WireDType) }, func(v int64) string { return dtype.Type(v).String() }},
	{"Mode", func(c Config) int64 { return int64(c.Mode) }, func(v int64) string { return Mode(v).String() }},
	{"MaxTokens", func(c Config) int64 { return int64(c.MaxTokens) }, num},
	{"MaxBufferBytes", func(c Config) int64 { return int64(c.MaxBufferBytes) }, num},
	{"InFlight", func(c Config) int64 { return int64(c.InFlight) }, num},
	{"Align", func(c Config) int64 { return int64(c.Align) }, num},
	{"Quantized", func(c Config) int64 { return int64(b2i(c.Quantized)) }, boolText},
	{"PowerOfTwoScales", func(c Config) int64 { return int64(b2i(c.PowerOfTwoScales)) }, boolText},
	{"MaxLocalExperts", func(c Config) int64 { return int64(c.MaxLocalExperts) }, num},
	{"PushRows", func(c Config) int64 { return int64(b2i(c.PushRows)) }, boolText},
	{"Placement", func(c Config) int64 { return int64(PlacementFingerprint(c.Placement)) }, func(v int64) string { return fmt.Sprintf("fingerprint %#x", uint64(v)) }},
}

func boolText(v int64) string { return fmt.Sprint(v != 0) }

// agreeConfig checks, in one all-gather, that every rank of c makes its dispatcher with
// the same configuration (defaults filled; mode as the caller gave it): where one
// differs, every rank returns the same *ConfigMismatchError, naming the first field that
// differs and the odd ranks, and tells a launcher (moex run) that those ranks are to
// blame. It is collective.
func agreeConfig(ctx context.Context, c *coll.Comm, cfg Config) error {
	p, w := c.Size(), len(configFields)
	mine := make([]int64, w)
	for i, f := range configFields {
		mine[i] = f.val(cfg)
	}
	all := make([]int64, p*w)
	if err := coll.AllGather(ctx, c, mine, all); err != nil {
		return err
	}
	for i, f := range configFields {
		votes := map[int64]int{}
		for q := 0; q < p; q++ {
			votes[all[q*w+i]]++
		}
		if len(votes) == 1 {
			continue
		}
		want := all[i] // the most ranks' value; on a tie, the lowest rank's
		for q := 0; q < p; q++ {
			if v := all[q*w+i]; votes[v] > votes[want] {
				want = v
			}
		}
		e := &ConfigMismatchError{Field: f.name, Want: f.text(want)}
		for q := 0; q < p; q++ {
			if v := all[q*w+i]; v != want {
				e.Ranks = append(e.Ranks, q)
				if e.Value == "" {
					e.Value = f.text(v)
				} else if e.Value != f.text(v) {
					e.Value = "other values"
				}
			} else {
				e.Rest = append(e.Rest, q)
			}
		}
		health.ReportBlame(c.WorldRank(c.Rank()), c.WorldRank(e.Ranks[0]), health.Mismatch)
		return e
	}
	return nil
}
