package transport

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
)

// Rendezvous is a rank's membership in a starting job: rank 0 serves the store at
// Env.Addr, every rank is a client of it, and AllGather exchanges one blob per rank.
type Rendezvous struct {
	Env    Env
	store  *Store
	server *StoreServer

	mu sync.Mutex
	n  int
}

// Join starts (on rank 0) and connects to the rendezvous store described by env. A job of
// one rank needs no store.
func Join(ctx context.Context, env Env, log *slog.Logger) (*Rendezvous, error) {
	rv := &Rendezvous{Env: env}
	if env.Size == 1 {
		return rv, nil
	}
	if env.Rank == 0 {
		host, port, err := net.SplitHostPort(env.Addr)
		if err != nil {
			return nil, &EnvError{Var: "MOEX_ADDR", Value: env.Addr, Reason: "want host:port"}
		}
		bind := host
		if ip := net.ParseIP(host); ip == nil && host != "localhost" {
			bind = "" // a host name: listen on every address (the name resolves elsewhere)
		}
		srv, err := ServeStore(net.JoinHostPort(bind, port), []byte(env.Token), log)
		if err != nil {
			return nil, err
		}
		rv.server = srv
	}
	st, err := DialStore(ctx, env.Addr, []byte(env.Token))
	if err != nil {
		rv.Close()
		return nil, err
	}
	rv.store = st
	return rv, nil
}

// AllGather publishes mine and returns every rank's blob, in rank order. Every rank must
// call it the same number of times.
func (rv *Rendezvous) AllGather(ctx context.Context, mine []byte) ([][]byte, error) {
	if rv.Env.Size == 1 {
		return [][]byte{mine}, nil
	}
	rv.mu.Lock()
	rv.n++
	key := "ag/" + strconv.Itoa(rv.n)
	rv.mu.Unlock()
	vals, err := rv.store.AllGather(ctx, key, rv.Env.Rank, rv.Env.Size, mine)
	if err != nil {
		return nil, fmt.Errorf("transport: rendezvous all-gather: %w", err)
	}
	return vals, nil
}

// Close leaves the store; on rank 0 it stops serving.
func (rv *Rendezvous) Close() error {
	var err error
	if rv.store != nil {
		err = rv.store.Close()
	}
	if rv.server != nil {
		if e := rv.server.Close(); err == nil {
			err = e
		}
	}
	return err
}
