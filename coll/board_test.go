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

// A span board shows every rank's part side by side, at the page-rounded stride, the
// same memory as Local and Peer; a plain board has no span; a rank that asks for a plain
// board while the others ask for a span fails every rank alike.
func TestSpanBoard(t *testing.T) {
	const p, size = 3, 2*4096 + 24
	ctx := context.Background()
	errs := world(t, p, Config{}, func(c *Comm) error {
		b, err := c.NewSpanBoard(ctx, size)
		if err != nil {
			return err
		}
		defer b.Close()
		stride := b.Stride()
		if stride%4096 != 0 || stride < size || len(b.Span()) != p*stride {
			return fmt.Errorf("stride %d, span %d bytes", stride, len(b.Span()))
		}
		for i := 0; i < size; i++ {
			b.Local()[i] = byte(c.Rank()*7 + i)
		}
		if err := Barrier(ctx, c); err != nil {
			return err
		}
		for q := 0; q < p; q++ {
			part := b.Span()[q*stride : q*stride+size]
			for i := range part {
				if part[i] != byte(q*7+i) {
					return fmt.Errorf("rank %d's part in the span, byte %d: %d", q, i, part[i])
				}
			}
		}
		plain, err := c.NewBoard(ctx, size)
		if err != nil {
			return err
		}
		defer plain.Close()
		if plain.Span() != nil {
			return errors.New("a plain board has a span")
		}
		return nil
	})
	for r, err := range errs {
		require.NoError(t, err, "rank %d", r)
	}
	errs = world(t, p, Config{NoWindows: true}, func(c *Comm) error {
		_, err := c.NewSpanBoard(ctx, size)
		return err
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, ErrNoBoard, "rank %d", r)
	}
	errs = world(t, p, Config{}, func(c *Comm) error {
		if c.Rank() == 1 {
			_, err := c.NewBoard(ctx, size)
			return err
		}
		_, err := c.NewSpanBoard(ctx, size)
		return err
	})
	for r, err := range errs {
		assert.ErrorIs(t, err, ErrMismatch, "rank %d", r)
	}
}
