//go:build !ucx

package ucx

import (
	"context"
	"errors"

	"github.com/moex-ai/moex/transport"
)

// ErrNotBuilt is returned by New in builds without -tags ucx.
var ErrNotBuilt = errors.New("ucx: moex was not built with -tags ucx (install libucx-dev and build with -tags ucx)")

// Built reports whether this binary has the UCX transport.
func Built() bool { return false }

// Version returns the UCX library version, or "".
func Version() string { return "" }

// Transport is the UCX endpoint (a stub in this build).
type Transport struct{ transport.Transport }

// New always fails in builds without -tags ucx.
func New(ctx context.Context, cfg Config) (*Transport, error) { return nil, ErrNotBuilt }

// Lanes is unavailable in this build.
func (t *Transport) Lanes(peer int) []string { return nil }

// RDMA is unavailable in this build.
func (t *Transport) RDMA() bool { return false }

// AllRDMA is unavailable in this build.
func (t *Transport) AllRDMA() bool { return false }
