package coll

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/moex-ai/moex/transport/bootstrap"
)

// registry is a job registry that answers or not (as one beyond a cut link), and
// records what was deleted from it.
type registry struct {
	bootstrap.KV
	down    bool
	mu      sync.Mutex
	deleted []string
}

var errUnreachableRegistry = errors.New("the registry does not answer")

func (r *registry) Delete(_ context.Context, key string) error {
	if r.down {
		return errUnreachableRegistry
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.deleted = append(r.deleted, key)
	return nil
}

// A Shrink with a job registry removes the lost ranks' entries from it; where the
// registry does not answer, survivors that are at most half of the ranks fail alike with
// a PeerError matching ErrCutOff (they may be the side of a split cut off from the
// others), while a majority goes on.
func TestShrinkCutOff(t *testing.T) {
	for _, c := range []struct {
		name    string
		dead    []int
		down    bool
		wantCut bool
	}{
		{"half, registry answers", []int{2, 3}, false, false},
		{"half, registry silent", []int{2, 3}, true, true},
		{"majority, registry silent", []int{3}, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			reg := &registry{down: c.down}
			cs := newLocal(t, 4, Config{Timeout: 5 * time.Second})
			for _, x := range cs {
				x.registry = reg
			}
			for _, d := range c.dead {
				kill(cs[d])
			}
			errs := survivors(cs, c.dead, func(x *Comm) error {
				sub, err := x.Shrink(context.Background())
				if err != nil {
					return err
				}
				defer sub.Close()
				return checkWorks(context.Background(), sub)
			})
			require.Len(t, errs, 4-len(c.dead))
			for r, err := range errs {
				if !c.wantCut {
					require.NoError(t, err, "rank %d", r)
					continue
				}
				require.ErrorIs(t, err, ErrCutOff, "rank %d", r)
				var pe *PeerError
				require.ErrorAs(t, err, &pe, "rank %d", r)
				assert.Contains(t, c.dead, pe.Rank)
			}
			if !c.down {
				assert.ElementsMatch(t, []string{bootstrap.MemberPrefix + "2", bootstrap.RunningPrefix + "2",
					bootstrap.MemberPrefix + "3", bootstrap.RunningPrefix + "3"}, reg.deleted)
			}
		})
	}
}
