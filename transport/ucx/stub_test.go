//go:build !ucx

package ucx

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// Without -tags ucx, New says so and how to get it.
func TestStubSaysNotBuilt(t *testing.T) {
	_, err := New(context.Background(), Config{Rank: 0, Size: 1})
	if !errors.Is(err, ErrNotBuilt) || !strings.Contains(err.Error(), "-tags ucx") {
		t.Fatalf("got %v, want ErrNotBuilt naming -tags ucx", err)
	}
	if Built() || Version() != "" {
		t.Fatal("stub claims UCX")
	}
}
