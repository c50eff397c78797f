package coll

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Each rank fills its part of a board; after a collective, every rank reads every part
// in place and finds what its owner wrote.
func TestBoard(t *testing.T) {
	const p, size = 4, 3 * 4096
	errs := world(t, p, Config{}, func(c *Comm) error {
		ctx := context.Background()
		b, err := c.NewBoard(ctx, size)
		if err != nil {
			return err
		}
		defer b.Close()
		if b.Size() != size || len(b.Local()) != size {
			return fmt.Errorf("size %d, local part %d bytes, want %d", b.Size(), len(b.Local()), size)
		}
		for round := 0; round < 3; round++ {
			for i := 0; i < size; i += 8 {
				binary.LittleEndian.PutUint64(b.Local()[i:], uint64(c.Rank()<<32|round<<16|i))
			}
			if err := Barrier(ctx, c); err != nil {
				return err
			}
			for q := 0; q < p; q++ {
				part := b.Peer(q)
				if len(part) != size {
					return fmt.Errorf("rank %d's part: %d bytes", q, len(part))
				}
				for i := 0; i < size; i += 8 {
					if got, want := binary.LittleEndian.Uint64(part[i:]), uint64(q<<32|round<<16|i); got != want {
						return fmt.Errorf("round %d: rank %d's byte %d: %#x, want %#x", round, q, i, got, want)
					}
				}
			}
			if err := Barrier(ctx, c); err != nil { // everyone has read before the next round writes
				return err
			}
		}
		return nil
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
}

// Without windows every rank gets ErrNoBoard; ranks that disagree on the size all get
// ErrMismatch; a size out of range is an ArgError.
func TestBoardErrors(t *testing.T) {
	ctx := context.Background()
	errs := world(t, 3, Config{NoWindows: true}, func(c *Comm) error {
		_, err := c.NewBoard(ctx, 4096)
		return err
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, ErrNoBoard, "rank %d", r)
	}
	errs = world(t, 3, Config{}, func(c *Comm) error {
		_, err := c.NewBoard(ctx, 4096*(1+c.Rank()%2))
		return err
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, ErrMismatch, "rank %d", r)
	}
	errs = world(t, 2, Config{}, func(c *Comm) error {
		_, err := c.NewBoard(ctx, 0)
		return err
	})
	for r, err := range errs {
		var ae *ArgError
		assert.True(t, errors.As(err, &ae), "rank %d: %v", r, err)
	}
	errs = world(t, 1, Config{}, func(c *Comm) error {
		_, err := c.NewBoard(ctx, 4096)
		return err
	})
	assert.ErrorIs(t, errs[0], ErrNoBoard, "a single rank")
}
