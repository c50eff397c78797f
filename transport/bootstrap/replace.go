package bootstrap

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/moex-ai/moex/busypoll"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/shm"
	"github.com/moex-ai/moex/transport/tcp"
)

// A process that takes over a dead rank of a running job (Env.Joining) says in the job's
// registry (Env.Registry) where it listens, under JoinPrefix/<rank>/<nonce>; the live
// ranks read the registry (coll.Comm.Admit), dial it, and give it the rank.

// JoinPrefix is where the registry holds the processes waiting to take over ranks, and
// RefusedPrefix where the live ranks say why they refused one (under RefusedPrefix and
// its entry's key).
const (
	JoinPrefix    = "join/"
	RefusedPrefix = "refused/"
)

// JoinEntry is a registry entry of a process waiting to take over a rank.
type JoinEntry struct {
	Key  string // its key in the registry
	Rank int    // the rank it takes over
	Addr string // where it listens for the live ranks
	Host string // its host's identity (transport.HostID)
}

// ParseJoinEntry reads a registry entry under JoinPrefix.
func ParseJoinEntry(key string, val []byte) (JoinEntry, error) {
	rest, ok := strings.CutPrefix(key, JoinPrefix)
	rank, _, ok2 := strings.Cut(rest, "/")
	r, err := strconv.Atoi(rank)
	addr, host, ok3 := strings.Cut(string(val), "\n")
	if !ok || !ok2 || err != nil || r < 0 || !ok3 || addr == "" {
		return JoinEntry{}, fmt.Errorf("%w: registry entry %q = %q", transport.ErrProtocol, key, val)
	}
	return JoinEntry{Key: key, Rank: r, Addr: addr, Host: host}, nil
}

// Replacement is this process taking over a rank of a running job: it waits for the live
// ranks (over tcp, or shared memory) and has said where in the job's registry.
type Replacement struct {
	env      Env
	rep      replacer
	registry KV
	key      string
	poll     busypoll.Config
}

// replacer is a transport's side of a replacement (tcp.Replacement, shm.Joiner).
type replacer interface {
	Addr() string
	Accept(ctx context.Context) (transport.Transport, []int, error)
	Close() error
}

type tcpReplacer struct{ *tcp.Replacement }

func (r tcpReplacer) Accept(ctx context.Context) (transport.Transport, []int, error) {
	t, members, err := r.Replacement.Accept(ctx)
	if err != nil {
		return nil, nil, err
	}
	return t, members, nil
}

type shmReplacer struct{ *shm.Joiner }

func (r shmReplacer) Accept(ctx context.Context) (transport.Transport, []int, error) {
	t, members, err := r.Joiner.Accept(ctx)
	if err != nil {
		return nil, nil, err
	}
	return t, members, nil
}

// ListenReplacement starts taking over env.Rank of the running job env describes (its
// Registry set): it waits for the live ranks over the job's transport, shared memory
// where MOEX_TRANSPORT=shm (every rank on this host), else tcp (a job must then run over
// tcp: MOEX_TRANSPORT=tcp), connects to the registry, which checks the job's secret, and
// puts its entry there.
func ListenReplacement(ctx context.Context, env Env, poll busypoll.Config, log *slog.Logger) (*Replacement, error) {
	if !env.Joining || env.Registry == "" {
		return nil, &ArgError{Arg: "MOEX_JOINING", Reason: "not a process taking over a rank (MOEX_JOINING=1 and MOEX_REGISTRY)"}
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg, err := DialRegistry(ctx, env.Registry, []byte(env.Token))
	if err != nil {
		return nil, err
	}
	if env.Transport == "" || env.Transport == "auto" {
		if env.Transport, err = liveTransport(ctx, reg); err != nil {
			reg.Close()
			return nil, err
		}
	}
	poll, err = JoinerPolicy(env, poll, log)
	if err != nil {
		reg.Close()
		return nil, err
	}
	rep, err := listenReplacement(env, poll, log)
	if err != nil {
		reg.Close()
		return nil, err
	}
	var nonce [8]byte
	_, _ = rand.Read(nonce[:])
	r := &Replacement{env: env, rep: rep, registry: reg, key: JoinPrefix + strconv.Itoa(env.Rank) + "/" + hex.EncodeToString(nonce[:]), poll: poll}
	if err := reg.Set(ctx, r.key, []byte(rep.Addr()+"\n"+transport.HostID())); err != nil {
		r.Close()
		return nil, err
	}
	log.Info("moex: waiting to take over a rank", "rank", env.Rank, "listen", rep.Addr(), "registry", env.Registry)
	return r, nil
}

// Addr is where this process waits for the live ranks: the Addr of the coll.Joiner they
// admit it as.
func (r *Replacement) Addr() string { return r.rep.Addr() }

// liveTransport is the transport a process that takes a rank over reaches the live ranks
// with where MOEX_TRANSPORT leaves it to moex, from what the live ranks said of theirs
// when they started (in a store that outlives start-up: RunningPrefix): shared memory
// where every live rank uses it on this host, else tcp. In a job that mixes them (shared
// memory on each host, tcp across) every live rank reaches the new process over tcp, its
// own host's too (transport.Mux.Readmit).
func liveTransport(ctx context.Context, reg KV) (string, error) {
	_, vals, err := reg.Scan(ctx, RunningPrefix)
	if err != nil || len(vals) == 0 {
		return "tcp", err
	}
	for _, v := range vals {
		if string(v) != string(runningEntry("shm")) { // another transport, or another host
			return "tcp", nil
		}
	}
	return "shm", nil
}

// JoinerPolicy sets up a process that takes over a rank as Open sets up one that starts
// (see hostPolicy): its waiting policy, returned, with Oversubscribed set where the ranks
// of its host outnumber its CPUs; its CPU binding; and its GOMAXPROCS share. A joiner
// meets no rendezvous that would count the ranks of its host, so it takes them from its
// launcher (env.LocalRank and env.LocalSize: MOEX_LOCAL_SIZE, LOCAL_WORLD_SIZE, ...);
// where the launcher does not say, every rank of the job is taken to be on this host,
// the cautious guess (a joiner that spins on a crowded host slows every rank).
func JoinerPolicy(env Env, poll busypoll.Config, log *slog.Logger) (busypoll.Config, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	localRank, localSize := env.LocalRank, env.LocalSize
	if localSize < 1 {
		localSize = env.Size
	}
	if localRank < 0 || localRank >= localSize {
		localRank = env.Rank % localSize
	}
	poll, autoProcs, err := hostPolicy(env, localRank, localSize, poll, log)
	if err != nil {
		return poll, err
	}
	if autoProcs {
		name := "tcp"
		if env.Transport == "shm" {
			name = "shm"
		}
		shareProcs(env, name, localSize, log)
	}
	log.Info("moex: a joiner's waiting policy", "rank", env.Rank, "ranks_on_host", localSize, "oversubscribed", poll.Oversubscribed)
	return poll, nil
}

// Poll is the waiting policy the replacement's transport runs with (JoinerPolicy's).
func (r *Replacement) Poll() busypoll.Config { return r.poll }

// listenReplacement starts the transport's side of a replacement (see ListenReplacement).
func listenReplacement(env Env, poll busypoll.Config, log *slog.Logger) (replacer, error) {
	switch env.Transport {
	case "shm":
		cfg := shm.Config{Rank: env.Rank, Size: env.Size, Logger: log}
		if err := cfg.ConfigFromEnv(os.Getenv); err != nil {
			return nil, err
		}
		cfg.Poll = poll
		j, err := shm.Join(cfg)
		if err != nil {
			return nil, err
		}
		return shmReplacer{j}, nil
	case "", "auto", "tcp":
	default:
		return nil, &ArgError{Arg: "MOEX_TRANSPORT", Reason: fmt.Sprintf("%s: a process taking over a rank reaches the live ranks over tcp or shm", env.Transport)}
	}
	bind, err := env.BindHost()
	if err != nil {
		return nil, err
	}
	cfg := tcp.Config{Rank: env.Rank, Size: env.Size, Bind: bind, Token: []byte(env.Token), Logger: log}
	if err := cfg.ConfigFromEnv(os.Getenv); err != nil {
		return nil, err
	}
	cfg.Poll = poll
	rep, err := tcp.Listen(cfg)
	if err != nil {
		return nil, err
	}
	return tcpReplacer{rep}, nil
}

// Accept waits, within ctx, for the live ranks to connect, and returns the transport and
// the live ranks. The registry entry is removed either way (the live ranks remove it too).
func (r *Replacement) Accept(ctx context.Context) (transport.Transport, []int, error) {
	t, members, err := r.rep.Accept(ctx)
	dctx, cancel := context.WithTimeout(context.Background(), r.env.Timeout)
	defer cancel()
	_ = r.registry.Delete(dctx, r.key)
	if err != nil {
		return nil, nil, err
	}
	return t, members, nil
}

// Refused waits, until ctx ends, for the live ranks to refuse this replacement, and
// returns why, as they wrote it (over a connection of its own to the registry, so that
// the replacement's other calls go on meanwhile).
func (r *Replacement) Refused(ctx context.Context) (string, error) {
	reg, err := DialRegistry(ctx, r.env.Registry, []byte(r.env.Token))
	if err != nil {
		return "", err
	}
	defer reg.Close()
	vals, err := reg.Get(ctx, RefusedPrefix+r.key)
	if err != nil {
		return "", err
	}
	_ = reg.Delete(ctx, RefusedPrefix+r.key) // read once: the registry keeps no refusals
	return string(vals[0]), nil
}

// Registry is the client of the job's registry, kept open (a communicator holds it to
// admit later replacements); the caller closes it.
func (r *Replacement) Registry() KV { return r.registry }

// Close releases a replacement that was not accepted, and the registry client.
func (r *Replacement) Close() error {
	_ = r.rep.Close()
	return r.registry.Close()
}
