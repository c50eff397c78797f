package dispatch_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/router"
)

// A rank made with another configuration is named, with the field and both values, on
// every rank and in the same call to New; the odd one is the rank whose value differs
// from the most ranks' (on a tie, from rank 0's). In the Auto and low-latency modes.
func TestConfigMismatchNamed(t *testing.T) {
	for _, c := range []struct {
		p, odd       int
		mode         dispatch.Mode
		change       func(cfg *dispatch.Config)
		field        string
		value, want  string
		rest, blamed []int
	}{
		{4, 2, dispatch.Auto, func(cfg *dispatch.Config) { cfg.Hidden = 32 }, "Hidden", "32", "16", []int{0, 1, 3}, []int{2}},
		{2, 1, dispatch.LowLatency, func(cfg *dispatch.Config) { cfg.MaxTokens = 9 }, "MaxTokens", "9", "8", []int{0}, []int{1}},
		{3, 0, dispatch.Auto, func(cfg *dispatch.Config) { cfg.PushRows = true }, "PushRows", "true", "false", []int{1, 2}, []int{0}},
		{3, 1, dispatch.LowLatency, func(cfg *dispatch.Config) {
			pl, _ := router.NewPlacement(router.RoundRobin, 6, 3)
			cfg.Placement = pl
		}, "Placement", "", "", []int{0, 2}, []int{1}},
	} {
		name := fmt.Sprintf("p=%d/%v/%s", c.p, c.mode, c.field)
		errs := onRanks(t, c.p, func(cm *coll.Comm) error {
			pl, err := router.NewPlacement(router.Contiguous, 6, c.p)
			if err != nil {
				return err
			}
			cfg := dispatch.Config{Hidden: 16, TopK: 2, Placement: pl, Mode: c.mode, MaxTokens: 8}
			if cm.Rank() == c.odd {
				c.change(&cfg)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			d, err := dispatch.New[float32](ctx, cm, cfg)
			if err == nil {
				d.Close()
			}
			return err
		})
		for r, err := range errs {
			var me *dispatch.ConfigMismatchError
			require.ErrorAs(t, err, &me, "%s: rank %d", name, r)
			assert.ErrorIs(t, err, dispatch.ErrMismatch)
			assert.Equal(t, c.field, me.Field, name)
			assert.Equal(t, c.blamed, me.Ranks, name)
			assert.Equal(t, c.rest, me.Rest, name)
			if c.value != "" {
				assert.Equal(t, c.value, me.Value, name)
				assert.Equal(t, c.want, me.Want, name)
			}
		}
	}
}

// TestHelperMismatchRank is one rank of TestConfigMismatchBlamed, started by moex run.
func TestHelperMismatchRank(t *testing.T) {
	if os.Getenv("MOEX_DISPATCH_HELPER") != "mismatch" {
		t.Skip("helper rank: runs only under TestConfigMismatchBlamed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := coll.Init(ctx, coll.Config{})
	require.NoError(t, err)
	defer c.Close()
	pl, err := router.NewPlacement(router.Contiguous, 8, c.Size())
	require.NoError(t, err)
	cfg := dispatch.Config{Hidden: 16, TopK: 2, Placement: pl}
	if c.Rank() == 2 {
		cfg.Hidden = 32
	}
	_, err = dispatch.New[float32](ctx, c, cfg)
	var me *dispatch.ConfigMismatchError
	fmt.Printf("rank %d: mismatch=%v: %v\n", c.Rank(), errors.As(err, &me), err)
	os.Exit(1)
}

// Under moex run, a rank made with another Hidden fails every rank, each naming the
// field, and the launcher blames that rank, not the first to exit.
func TestConfigMismatchBlamed(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "moex")
	out, err := exec.Command("go", "build", "-o", exe, "github.com/moex-ai/moex/cmd/moex").CombinedOutput()
	require.NoError(t, err, "building moex: %s", out)
	cmd := exec.Command(exe, "run", "-n", "4", "--keep-going", "--", os.Args[0], "-test.run=^TestHelperMismatchRank$")
	cmd.Env = append(os.Environ(), "MOEX_DISPATCH_HELPER=mismatch", "MOEX_TRANSPORT=shm")
	out, err = cmd.CombinedOutput()
	require.Error(t, err, "%s", out)
	for r := 0; r < 4; r++ {
		assert.Contains(t, string(out), fmt.Sprintf("rank %d: mismatch=true: dispatch: ranks disagree on Config.Hidden: rank 2 has 32, ranks 0, 1, 3 have 16", r), "%s", out)
	}
	assert.Contains(t, string(out), "launch: rank 2 exited with code 1 (named by 3 other rank(s)", "%s", out)
}
