package bootstrap

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moex-ai/moex/transport"
)

// Rendezvous is a rank's membership in a starting job: rank 0 serves the store at
// Env.Addr, every rank is a client of it, and AllGather exchanges one blob per rank.
type Rendezvous struct {
	Env    Env
	store  KV
	server *StoreServer
	// external: the store is a driver's (etcd), which outlives start-up: the rank's
	// client stays, and with it its claim, until Close.
	external  bool
	transport string // what Ready says of this rank there (SetTransport)

	mu   sync.Mutex
	n    int
	file string // rank 0: the rendezvous file it published (Env.AddrFile), removed at the end of start-up
}

// Join starts (on rank 0) and connects to the rendezvous store described by env, and
// claims this rank there (a second process claiming it fails, and so does every rank:
// ErrDuplicateRank). A job of one rank needs no store. Join honours ctx's deadline.
func Join(ctx context.Context, env Env, log *slog.Logger) (*Rendezvous, error) {
	if env.Size == 1 {
		return &Rendezvous{Env: env}, nil
	}
	if env.AddrFile != "" {
		return joinByFile(ctx, env, log)
	}
	if IsURL(env.Addr) {
		return joinKV(ctx, env)
	}
	var srv *StoreServer
	if env.Rank == 0 {
		host, port, err := net.SplitHostPort(env.Addr)
		if err != nil {
			return nil, &transport.EnvError{Var: "MOEX_ADDR", Value: env.Addr, Reason: "want host:port"}
		}
		bind, err := storeBind(env, host)
		if err != nil {
			return nil, err
		}
		if srv, err = ServeStore(net.JoinHostPort(bind, port), []byte(env.Token), log); err != nil {
			if errors.Is(err, syscall.EADDRINUSE) {
				return joinTaken(ctx, env, err)
			}
			if env.AddrNote != "" {
				err = fmt.Errorf("%w (the address is %s; set MOEX_ADDR to choose another)", err, env.AddrNote)
			}
			return nil, err
		}
	}
	return joinAt(ctx, env, srv)
}

// joinTaken is rank 0's start-up when the store's address is taken (inUse). If a store
// of this job answers there, another process serves it as rank 0: this one claims rank 0
// there too, so that the store fails every rank with ErrDuplicateRank, and says so.
// Otherwise another program holds the port.
func joinTaken(ctx context.Context, env Env, inUse error) (*Rendezvous, error) {
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	st, err := DialStore(dctx, env.Addr, []byte(env.Token))
	cancel()
	if err != nil {
		return nil, &StartupError{Expected: env.Size, Rank: 0, Err: transport.Because(inUse,
			"rank 0 cannot serve the rendezvous store: %s is taken by another program (set MOEX_ADDR to a free port): %v", env.Addr, inUse)}
	}
	defer st.Close()
	var nonce [12]byte
	_, _ = rand.Read(nonce[:])
	err = st.Claim(ctx, 0, env.Size, hex.EncodeToString(nonce[:]))
	var se *StartupError
	if errors.As(err, &se) {
		se.Expected = env.Size
		return nil, se
	}
	return nil, &StartupError{Expected: env.Size, Rank: 0, Err: transport.Because(ErrDuplicateRank,
		"two processes claim rank 0: a store of this job already answers at %s", env.Addr)}
}

// joinAt connects to the store at env.Addr (served by srv on rank 0) and claims this
// rank there.
func joinAt(ctx context.Context, env Env, srv *StoreServer) (*Rendezvous, error) {
	rv := &Rendezvous{Env: env, server: srv}
	st, err := DialStore(ctx, env.Addr, []byte(env.Token))
	if err != nil {
		rv.Close()
		return nil, &StartupError{Expected: env.Size, Rank: 0, Err: err}
	}
	rv.store = st
	var nonce [12]byte
	_, _ = rand.Read(nonce[:])
	if err := st.Claim(ctx, env.Rank, env.Size, hex.EncodeToString(nonce[:])); err != nil {
		rv.Close()
		return nil, rv.explain(err)
	}
	return rv, nil
}

// joinKV connects to a driver's store (MOEX_ADDR=etcd://...) and claims this rank there.
// Nobody serves it: every rank is a client alike. A claim of a running job's rank is
// ErrRankLive or ErrJobRunning, as the store says (not a *StartupError: the job is fine).
func joinKV(ctx context.Context, env Env) (*Rendezvous, error) {
	kv, err := DialKV(ctx, env.Addr, []byte(env.Token))
	if err != nil {
		var se *StartupError
		if !errors.As(err, &se) && !errors.Is(err, ErrNoDriver) {
			err = &StartupError{Expected: env.Size, Rank: -1, Err: err}
		}
		return nil, err
	}
	rv := &Rendezvous{Env: env, store: kv, external: true}
	var nonce [12]byte
	_, _ = rand.Read(nonce[:])
	if err := kv.Claim(ctx, env.Rank, env.Size, hex.EncodeToString(nonce[:])); err != nil {
		rv.Close()
		if errors.Is(err, ErrRankLive) || errors.Is(err, ErrJobRunning) {
			return nil, err
		}
		return nil, rv.explain(err)
	}
	return rv, nil
}

// joinByFile joins through Env.AddrFile: rank 0 serves the store on a free loopback
// port with a fresh secret and publishes both in the file (written whole, then renamed
// into place, mode 0600); the others wait for the file within ctx. Rank 0 removes the
// file when the rendezvous closes.
func joinByFile(ctx context.Context, env Env, log *slog.Logger) (*Rendezvous, error) {
	if env.Rank == 0 {
		if env.Token == "" {
			var b [16]byte
			if _, err := rand.Read(b[:]); err != nil {
				return nil, err
			}
			env.Token = hex.EncodeToString(b[:])
		}
		srv, err := ServeStore("127.0.0.1:0", []byte(env.Token), log)
		if err != nil {
			return nil, err
		}
		env.Addr = srv.Addr()
		tmp := env.AddrFile + ".tmp"
		err = os.WriteFile(tmp, []byte(env.Addr+" "+env.Token+"\n"), 0o600)
		if err == nil {
			err = os.Rename(tmp, env.AddrFile)
		}
		if err != nil {
			srv.Close()
			os.Remove(tmp)
			return nil, &StartupError{Expected: env.Size, Rank: 0, Err: fmt.Errorf("publishing the rendezvous address: %w", err)}
		}
		file := env.AddrFile
		env.AddrFile = ""
		rv, err := joinAt(ctx, env, srv)
		if err != nil {
			os.Remove(file)
			return nil, err
		}
		rv.file = file
		return rv, nil
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(env.AddrFile)
		if err == nil {
			f := strings.Fields(string(b))
			if len(f) != 2 {
				return nil, &StartupError{Expected: env.Size, Rank: 0, Err: fmt.Errorf("%w: rendezvous file %s: want \"host:port secret\"", transport.ErrProtocol, env.AddrFile)}
			}
			env.Addr, env.Token, env.AddrFile = f[0], f[1], ""
			return joinAt(ctx, env, nil)
		}
		select {
		case <-ctx.Done():
			return nil, &StartupError{Expected: env.Size, Rank: 0, Err: transport.Because(context.Cause(ctx), "rank 0 has not come: no rendezvous file %s %s", env.AddrFile, gaveUp(ctx))}
		case <-tick.C:
		}
	}
}

// storeBind is the address rank 0's store listens on for MOEX_ADDR's host: an IP as it
// is; a name, the local address it resolves to, else the address ranks bind
// (MOEX_BIND, MOEX_IFACE, or the one that reaches it): never every interface.
func storeBind(env Env, host string) (string, error) {
	if host == "localhost" || net.ParseIP(host) != nil {
		return host, nil
	}
	addrs, _ := net.LookupHost(host)
	local, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		for _, l := range local {
			if ipn, ok := l.(*net.IPNet); ok && ipn.IP.Equal(net.ParseIP(a)) {
				return a, nil
			}
		}
	}
	return env.BindHost()
}

// Stage records at the store that this rank reached stage of start-up (what a failed
// start-up reports for each rank).
func (rv *Rendezvous) Stage(ctx context.Context, stage string) error {
	if rv.Env.Size == 1 {
		return nil
	}
	if err := rv.store.Set(ctx, stageKey(rv.Env.Rank), []byte(stage)); err != nil {
		return rv.explain(err)
	}
	return nil
}

// AllGather publishes mine and returns every rank's blob, in rank order. Every rank must
// call it the same number of times. A failure is a *StartupError.
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
		return nil, rv.explain(fmt.Errorf("rendezvous all-gather: %w", err))
	}
	return vals, nil
}

// SetTransport names this rank's transport (Transport.Name) for Ready to say, in a store
// that outlives start-up (etcd), with its host: a process that later takes a rank over
// reaches the live ranks the same way.
func (rv *Rendezvous) SetTransport(name string) { rv.transport = name }

// Ready says this rank finished start-up, waits until every rank has, and leaves the
// store (rank 0 stops serving it once every rank has left, or after a second): nothing
// after start-up needs it.
func (rv *Rendezvous) Ready(ctx context.Context) error {
	if rv.Env.Size == 1 {
		return nil
	}
	if err := rv.Stage(ctx, StageReady); err != nil {
		return err
	}
	if _, err := rv.AllGather(ctx, nil); err != nil {
		return err
	}
	if rv.external { // the job runs: a process started for a rank whose process dies takes it over
		if err := rv.store.Set(ctx, RunningPrefix+strconv.Itoa(rv.Env.Rank), runningEntry(rv.transport)); err != nil {
			return rv.explain(err)
		}
		return nil
	}
	rv.store.Close()
	if rv.server != nil {
		rv.server.closeWhenLeft(time.Second)
	}
	rv.removeFile()
	return nil
}

// removeFile removes the rendezvous file rank 0 published: every rank has read it once
// start-up is over.
func (rv *Rendezvous) removeFile() {
	if rv.file != "" {
		os.Remove(rv.file)
		rv.file = ""
	}
}

// Watch returns a context that ends, with a *StartupError as its cause, as soon as the
// store learns that the start-up failed (a rank left or was claimed twice), so that set-up
// steps that do not talk to the store (connecting the transports) stop too; and a
// function that stops watching. Call stop before Close.
func (rv *Rendezvous) Watch(ctx context.Context) (context.Context, func()) {
	wctx, cancel := context.WithCancelCause(ctx)
	if rv.Env.Size == 1 {
		return wctx, func() { cancel(nil) }
	}
	st, err := DialKV(ctx, rv.Env.Addr, []byte(rv.Env.Token))
	if err != nil {
		return wctx, func() { cancel(nil) }
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		// A key nobody sets: the store answers only when the start-up failed, or when
		// stop closes the connection.
		_, err := st.Get(context.Background(), "never")
		var se *StartupError
		if errors.As(err, &se) {
			cancel(rv.explain(se))
		}
	}()
	return wctx, func() {
		st.Close()
		<-done
		cancel(nil)
	}
}

// Explain turns err, a failed start-up step, into a *StartupError with every rank's
// stage as the store sees it (asked on a connection of its own).
func (rv *Rendezvous) Explain(err error) error { return rv.explain(err) }

// explain turns a failed store call into a *StartupError with every rank's stage (from
// a connection of its own: the failed one is closed).
func (rv *Rendezvous) explain(err error) error {
	var se *StartupError
	if !errors.As(err, &se) {
		se = &StartupError{Rank: -1, Err: err}
	}
	se.Expected = rv.Env.Size
	if se.Stages == nil {
		// The store lingers for the others' questions (Close); a store that is gone
		// leaves the stages out.
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		if st, derr := DialKV(ctx, rv.Env.Addr, []byte(rv.Env.Token)); derr == nil {
			se.Stages, _ = st.Status(ctx)
			st.Close()
		}
	}
	return se
}

// Close leaves the store; on rank 0 it stops serving once the ranks that came have left
// (or after 2 s): after a failed start-up they learn from it why (a rank still busy
// setting up asks it only when done), and ask it, on their way out, how far every rank
// got.
func (rv *Rendezvous) Close() error {
	rv.removeFile()
	var err error
	if rv.store != nil {
		err = rv.store.Close()
	}
	if rv.server != nil {
		// (A rank blocked in a Get is seen to leave only when the Get ends: the wait is
		// short for that.)
		rv.server.closeWhenLeft(2 * time.Second)
	}
	return err
}
