package coll

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/moex-ai/moex/coll/health"
	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// A lost rank comes back: a new process takes the rank of one that died (a joiner), the
// live ranks admit it with Grow, and every one of them, the joiner included, gets a
// communicator of them all. The joiner's transport connects to the live ranks first (tcp:
// it listens, each live rank dials it); Rejoin then waits for the communicator's
// description, which the lowest live rank sends once every live rank has connected.

// Joiner is a process that takes over a rank whose process died.
type Joiner struct {
	Rank int    // the rank it takes over, in the job's transport (a rank of the world)
	Addr string // where it listens for the live ranks (tcp: host:port)
	Host string // its host's identity (transport.HostID), for the ranks' placement
}

// Errors of Grow.
var (
	// ErrRankLive: a joiner claims a rank that is a member of the communicator (or, in a
	// job that meets in etcd, a process started for a rank whose process lives).
	ErrRankLive = bootstrap.ErrRankLive
	// ErrRankClaimed: two joiners claim one rank.
	ErrRankClaimed = errors.New("coll: two joiners claim the rank")
	// ErrJoinFailed: a live rank could not connect to a joiner.
	ErrJoinFailed = errors.New("coll: a live rank could not connect to the joiner")
)

// JoinError says that Grow did not admit the joiner for Rank, on every live rank alike:
// Err is ErrRankLive, ErrRankClaimed, or ErrJoinFailed (with transport.ErrAuth where the
// joiner did not prove the job's secret), Member the live rank (of the world) that could
// not connect to it (-1 where none tried).
type JoinError struct {
	Rank   int   // the rank (of the world) the joiner claimed
	Member int   // the live rank (of the world) that could not connect to it; -1: none tried
	Err    error // why: ErrRankLive, ErrRankClaimed or ErrJoinFailed
}

func (e *JoinError) Error() string {
	if e.Member >= 0 {
		return fmt.Sprintf("coll: joiner for rank %d not admitted: rank %d: %v", e.Rank, e.Member, e.Err)
	}
	return fmt.Sprintf("coll: joiner for rank %d not admitted: %v", e.Rank, e.Err)
}

func (e *JoinError) Unwrap() error { return e.Err }

// joinTagFor is the tag of a grown communicator's description to the joiner listening
// at addr: the address (which each process that takes a rank over picks anew) is in the
// tag, so that a description meant for one process, from a Grow that was then abandoned
// or from another communicator's, never completes another's Rejoin.
func joinTagFor(addr string) transport.Tag {
	h := fnv.New64a()
	h.Write([]byte(addr))
	v := h.Sum64()
	return transport.Tag{Comm: 0xFFFFFFF1, Seq: uint32(v), Tag: uint32(v >> 32)}
}

// maxJoinAddr bounds a joiner's address.
const maxJoinAddr = 256

// Grow admits joiners, processes that took over ranks whose processes died, and returns
// a communicator of c's ranks and theirs, in the order of their ranks in the job's
// transport (a joiner takes its rank's place). It is collective over c's ranks, which
// must pass the same joiners (else every rank fails with ErrMismatch); each joiner calls
// Rejoin. c (typically what Shrink returned after the deaths) stays usable, and the new
// communicator shares its transport.
//
// Every live rank connects to every joiner (transport.Readmitter: tcp, shm), then the lowest
// describes the communicator to the joiners and all of them meet in a Barrier. Grow
// fails on every live rank alike with a *JoinError when a joiner claims a live rank or a
// rank another joiner claims, or when a live rank could not connect to one (its secret
// is wrong, it died); a live rank or joiner that dies meanwhile makes every other fail
// (a PeerError, or ErrTimeout) rather than wait. Grow never hangs past c's timeout.
func (c *Comm) Grow(ctx context.Context, joiners []Joiner) (g *Comm, err error) {
	if c.closed.Load() {
		return nil, ErrClosed
	}
	if len(joiners) == 0 || len(joiners) > c.tr.Size() {
		return nil, &ArgError{Arg: "joiners", Reason: fmt.Sprintf("%d for %d ranks", len(joiners), c.tr.Size())}
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	// Every rank checks that the others pass the same joiners, and learns their hosts.
	h := fnv.New64a()
	for _, j := range joiners {
		fmt.Fprintf(h, "%d\x00%s\x00%s\x00", j.Rank, j.Addr, j.Host)
	}
	mine := []int64{int64(h.Sum64()), int64(hostKey(transport.HostID()))}
	all := make([]int64, 2*c.size)
	if err := AllGather(ctx, c, mine, all); err != nil {
		return nil, err
	}
	for q := 0; q < c.size; q++ {
		if all[2*q] != mine[0] {
			return nil, fmt.Errorf("%w: ranks %d and %d pass different joiners to Grow", ErrMismatch, c.ranks[q], c.ranks[c.rank])
		}
	}
	if err := c.checkJoiners(joiners); err != nil {
		return nil, err
	}
	members := slices.Clone(c.ranks)
	slices.Sort(members)
	// Connect to every joiner; then every rank learns whether every other did. A Grow
	// that fails from here on undoes this rank's connections: no joiner stays connected
	// to some live ranks and not others.
	var admitted []int // the joiners this rank connected to
	defer func() {
		if err != nil {
			for _, r := range admitted {
				transport.ReadmitterOf(c.tr, r).Evict(r)
			}
		}
	}()
	status := []int64{-1, 0} // the joiner this rank could not connect to, and whether its secret was wrong
	for _, j := range joiners {
		rm := transport.ReadmitterOf(c.tr, j.Rank)
		var err error
		if rm == nil {
			err = fmt.Errorf("the transport to rank %d (%s) cannot take a joiner", j.Rank, c.tr.Name())
		} else if err = rm.Readmit(ctx, j.Rank, j.Addr, members); err == nil {
			admitted = append(admitted, j.Rank)
		}
		if err != nil {
			c.log.Warn("moex: could not connect to a joiner", "rank", c.ranks[c.rank], "joiner", j.Rank, "addr", j.Addr, "err", err)
			status[0] = int64(j.Rank)
			if errors.Is(err, transport.ErrAuth) {
				status[1] = 1
			}
			break
		}
	}
	statuses := make([]int64, 2*c.size)
	if err := AllGather(ctx, c, status, statuses); err != nil {
		return nil, err
	}
	for q := 0; q < c.size; q++ {
		if r := statuses[2*q]; r >= 0 {
			err := ErrJoinFailed
			if statuses[2*q+1] == 1 {
				err = fmt.Errorf("%w: %w", ErrJoinFailed, transport.ErrAuth)
			}
			return nil, &JoinError{Rank: int(r), Member: c.ranks[q], Err: err}
		}
	}
	// The grown communicator: c's ranks and the joiners, in transport order.
	keys := map[int]uint64{}
	for q := 0; q < c.size; q++ {
		keys[c.ranks[q]] = uint64(all[2*q+1])
	}
	for _, j := range joiners {
		keys[j.Rank] = hostKey(j.Host)
	}
	ranks := make([]int, 0, len(keys))
	for r := range keys {
		ranks = append(ranks, r)
	}
	slices.Sort(ranks)
	hosts := make([]int, len(ranks))
	for i, r := range ranks {
		hosts[i] = int(keys[r] >> 1) // hostsDense renumbers them
	}
	hosts = hostsDense(hosts)
	c.issueMu.Lock()
	c.grows++
	n := c.grows
	c.issueMu.Unlock()
	id := derivedID(0xfc, c.id, n)
	me := slices.Index(ranks, c.ranks[c.rank])
	parents := make([]int, len(ranks))
	for i, r := range ranks {
		parents[i] = slices.Index(c.ranks, r) // -1: a joiner
	}
	if c.ranks[c.rank] == members[0] { // the lowest live rank describes it to the joiners
		desc := joinDesc{id: id, ranks: ranks, hosts: hosts, parents: parents, link: c.link, intra: c.intra, closeBarrier: c.closeBarrier}.encode()
		for _, j := range joiners {
			req, err := c.tr.Isend(j.Rank, joinTagFor(j.Addr), desc)
			if err == nil {
				_, err = req.Wait(ctx)
			}
			if err != nil {
				return nil, &JoinError{Rank: j.Rank, Member: c.ranks[c.rank], Err: fmt.Errorf("%w: %w", ErrJoinFailed, err)}
			}
		}
	}
	g = newComm(c.tr, id, ranks, hosts, me, c.cfg, c.link)
	g.why, g.intra, g.closeBarrier, g.parent, g.registry = c.why, c.intra, c.closeBarrier, parents, c.registry
	if c.owned != nil {
		c.owned.refs.Add(1)
		g.owned = c.owned
	}
	g.listen()
	if err := Barrier(ctx, g); err != nil {
		g.Close()
		return nil, err
	}
	c.log.Info("moex: communicator grown", "comm", c.id, "rank", c.ranks[c.rank], "new_comm", g.id, "size", g.size, "joined", joinerRanks(joiners))
	return g, nil
}

// checkJoiners fails, alike on every rank, a joiner that claims a live rank or one
// another joiner claims, or that cannot be one.
func (c *Comm) checkJoiners(joiners []Joiner) error {
	claimed := map[int]bool{}
	for _, j := range joiners {
		switch {
		case j.Rank < 0 || j.Rank >= c.tr.Size() || j.Addr == "" || len(j.Addr) > maxJoinAddr || len(j.Host) > maxJoinAddr:
			return &ArgError{Arg: "joiners", Reason: fmt.Sprintf("rank %d of %d at %q (at most %d bytes)", j.Rank, c.tr.Size(), j.Addr, maxJoinAddr)}
		case slices.Contains(c.ranks, j.Rank):
			return &JoinError{Rank: j.Rank, Member: -1, Err: ErrRankLive}
		case claimed[j.Rank]:
			return &JoinError{Rank: j.Rank, Member: -1, Err: ErrRankClaimed}
		}
		claimed[j.Rank] = true
	}
	return nil
}

func joinerRanks(js []Joiner) []int {
	rs := make([]int, len(js))
	for i, j := range js {
		rs[i] = j.Rank
	}
	return rs
}

// hostKey names a host by its identity.
func hostKey(id string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(id))
	return h.Sum64()
}

// joinDesc describes a grown communicator to a joiner: its id, each rank's rank in the
// transport and host, and the link costs the live ranks plan with (so that the joiner
// chooses the algorithms they choose).
type joinDesc struct {
	id                    uint32
	ranks, hosts, parents []int // parents: each rank's in the communicator grown from, -1 for a joiner
	link, intra           LinkCost
	closeBarrier          bool // Close waits for every rank first (as the live ranks' does)
}

const joinDescHead = 12 + 6*8

func (d joinDesc) encode() []byte {
	le := binary.LittleEndian
	b := le.AppendUint32(nil, d.id)
	b = le.AppendUint32(b, uint32(len(d.ranks)))
	flags := uint32(0)
	if d.closeBarrier {
		flags |= 1
	}
	b = le.AppendUint32(b, flags)
	for _, l := range []LinkCost{d.link, d.intra} {
		b = le.AppendUint64(b, uint64(l.Alpha))
		b = le.AppendUint64(b, math.Float64bits(l.Beta))
		b = le.AppendUint64(b, math.Float64bits(l.Gamma))
	}
	for i := range d.ranks {
		b = le.AppendUint32(b, uint32(d.ranks[i]))
		b = le.AppendUint32(b, uint32(d.hosts[i]))
		b = le.AppendUint32(b, uint32(int32(d.parents[i])))
	}
	return b
}

func decodeJoin(b []byte, size int) (joinDesc, error) {
	le := binary.LittleEndian
	var d joinDesc
	if len(b) < joinDescHead {
		return d, fmt.Errorf("%w: a description of %d bytes", transport.ErrProtocol, len(b))
	}
	d.id = le.Uint32(b)
	n := int(le.Uint32(b[4:]))
	if n < 2 || n > size || len(b) != joinDescHead+12*n {
		return d, fmt.Errorf("%w: a description of %d ranks in %d bytes", transport.ErrProtocol, n, len(b))
	}
	d.closeBarrier = le.Uint32(b[8:])&1 != 0
	for i, l := range []*LinkCost{&d.link, &d.intra} {
		at := 12 + 24*i
		l.Alpha = time.Duration(le.Uint64(b[at:]))
		l.Beta, l.Gamma = math.Float64frombits(le.Uint64(b[at+8:])), math.Float64frombits(le.Uint64(b[at+16:]))
	}
	d.ranks, d.hosts, d.parents = make([]int, n), make([]int, n), make([]int, n)
	for i := range d.ranks {
		at := joinDescHead + 12*i
		d.ranks[i], d.hosts[i], d.parents[i] = int(le.Uint32(b[at:])), int(le.Uint32(b[at+4:])), int(int32(le.Uint32(b[at+8:])))
		if d.ranks[i] >= size || d.hosts[i] >= n || d.parents[i] < -1 || d.parents[i] >= n || (i > 0 && d.ranks[i] <= d.ranks[i-1]) {
			return d, fmt.Errorf("%w: a description with rank %d on host %d", transport.ErrProtocol, d.ranks[i], d.hosts[i])
		}
	}
	return d, nil
}

// Rejoin returns the communicator a joiner gets from the live ranks' Grow: t is its
// transport, connected to the live ranks (tcp: Replacement.Accept), addr where it
// listened for them (the Addr of the Joiner they pass to Grow: it tags the description
// meant for this process), members the live ranks as they named them. It waits, for at most cfg.Timeout, for the lowest live rank's
// description of the communicator, then meets every rank in a Barrier. The
// communicator does not own t: close t after it. cfg is as for New.
func Rejoin(ctx context.Context, t transport.Transport, addr string, members []int, cfg Config) (*Comm, error) {
	if t == nil || len(members) == 0 {
		return nil, &ArgError{Arg: "t", Reason: "no transport, or no live rank"}
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	buf := make([]byte, joinDescHead+12*t.Size())
	req, err := t.Irecv(slices.Min(members), joinTagFor(addr), buf)
	if err != nil {
		return nil, err
	}
	n, err := req.Wait(ctx)
	if err != nil {
		return nil, fmt.Errorf("coll: waiting for the live ranks to admit rank %d: %w", t.Rank(), err)
	}
	d, err := decodeJoin(buf[:n], t.Size())
	if err != nil {
		return nil, err
	}
	me := slices.Index(d.ranks, t.Rank())
	if me < 0 {
		return nil, fmt.Errorf("%w: the grown communicator leaves this rank (%d) out", transport.ErrProtocol, t.Rank())
	}
	if cfg.Wrap != nil {
		t = cfg.Wrap(t.Rank(), t)
	}
	cfg.Link, cfg.HostLink, cfg.NetGbits = &d.link, &d.intra, 0 // as the live ranks plan
	c := newComm(t, d.id, d.ranks, d.hosts, me, cfg, d.link)
	c.why = t.Name() + ": a joiner's transport (coll.Rejoin)"
	c.crowded = cfg.Poll.Oversubscribed
	c.parent, c.closeBarrier = d.parents, d.closeBarrier
	c.owned = newOwner()
	c.listen()
	if err := Barrier(ctx, c); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func init() { joinInit = initJoining }

// initJoining is Init for a process that takes over rank env.Rank of a running job: it
// listens, says where in the job's registry, waits (MOEX_INIT_TIMEOUT) for the live
// ranks to admit it (their Admit), and returns the communicator they grew, which owns
// the transport and the registry client.
func initJoining(ctx context.Context, env bootstrap.Env, cfg Config) (*Comm, error) {
	health.ReportJoin(env.Rank, health.Joining)
	ictx, cancel := context.WithTimeout(ctx, cfg.InitTimeout)
	defer cancel()
	rep, err := bootstrap.ListenReplacement(ictx, env, *cfg.Poll, cfg.Logger)
	if err != nil {
		return nil, err
	}
	// The live ranks may refuse this process (its rank is alive, another claims it too, or
	// they could not reach it): it then stops waiting for them, with their reason.
	actx, refuse := context.WithCancelCause(ictx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		if why, err := rep.Refused(actx); err == nil {
			refuse(&JoinError{Rank: env.Rank, Member: -1, Err: refusal(why)})
		}
	}()
	tr, members, err := rep.Accept(actx)
	refuse(nil)
	<-watched
	if err != nil {
		rep.Close()
		var je *JoinError
		if errors.As(context.Cause(actx), &je) {
			return nil, je
		}
		return nil, fmt.Errorf("coll: rank %d waited for the live ranks to admit it: %w", env.Rank, err)
	}
	if cfg.Wrap != nil {
		tr = cfg.Wrap(env.Rank, tr)
	}
	poll := rep.Poll() // the starting ranks' policy (bootstrap.JoinerPolicy)
	cfg.Poll = &poll
	c, err := Rejoin(ictx, tr, rep.Addr(), members, cfg)
	if err != nil {
		tr.Close()
		rep.Registry().Close()
		return nil, err
	}
	c.why = tr.Name() + ": a process that took over rank " + strconv.Itoa(env.Rank) + " of a running job"
	c.registry = rep.Registry()
	if bootstrap.IsURL(env.Registry) { // a store that outlives start-up (etcd) holds the live ranks
		if err := bootstrap.SayLive(ictx, c.registry, env.Rank, env.Size, tr.Name()); err != nil {
			cfg.Logger.Warn("moex: saying this rank is live in the registry failed", "rank", env.Rank, "err", err)
		}
	}
	c.owned = newOwner(tr.Close, c.registry.Close)
	health.ReportJoin(env.Rank, health.Joined)
	cfg.Logger.Info("moex: took over a rank", "rank", env.Rank, "size", c.Size(), "live", members)
	return c, nil
}

// How long Admit waits for the registry, and how long it leaves one that did not answer.
const (
	registryWait  = time.Second
	registryRetry = 10 * time.Second
)

// maxAdmit bounds the joiners one Admit takes.
const maxAdmit = 64

// ErrNoRegistry: Admit on a communicator of a job without a registry (MOEX_REGISTRY).
var ErrNoRegistry = errors.New("coll: the job has no registry (moex run --restarts sets one)")

// Admit grows c with the processes waiting in the job's registry to take over ranks that
// are not c's (started with MOEX_JOINING=1, as moex run --restarts starts them): it is
// collective over c. The lowest rank reads the registry and tells the others whom it
// found; then every rank calls Grow with them (see Grow for what is checked and how it
// fails, on every rank alike). It returns nil and no error when nobody waits. The
// registry entries of the joiners it tried are removed, admitted or not: a refused
// joiner gives up, and its launcher may start another.
//
// A serving loop calls Admit between steps, on the communicator it serves with (it is
// one small Broadcast when nobody waits), and moves its experts with dispatch.Grow when
// it returns a communicator.
func (c *Comm) Admit(ctx context.Context) (*Comm, error) {
	if c.registry == nil {
		return nil, ErrNoRegistry
	}
	var found []bootstrap.JoinEntry
	if c.rank == 0 && time.Now().After(c.registryDown) {
		// The others wait in a Broadcast meanwhile: a registry that does not answer soon
		// (etcd lost) admits nobody this time, and is not asked again for a while, so
		// that serving goes on at its pace.
		rctx, cancel := context.WithTimeout(ctx, min(c.cfg.Timeout/2, registryWait))
		keys, vals, err := c.registry.Scan(rctx, bootstrap.JoinPrefix)
		cancel()
		if err != nil {
			c.registryDown = time.Now().Add(registryRetry)
			c.log.Warn("moex: reading the job's registry failed; nobody is admitted meanwhile", "rank", c.ranks[c.rank], "retry_in", registryRetry, "err", err)
		}
		for i, k := range keys {
			e, err := bootstrap.ParseJoinEntry(k, vals[i])
			switch {
			case err != nil || e.Rank >= c.tr.Size():
			case slices.Contains(c.ranks, e.Rank): // a second claimant of a live rank
				rctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
				c.refuseJoiner(rctx, k, ErrRankLive)
				cancel()
			case len(found) < maxAdmit:
				found = append(found, e)
			}
		}
	}
	var msg []byte
	for _, e := range found {
		msg = fmt.Appendf(msg, "%d\x00%s\x00%s\x00%s\x00", e.Rank, e.Addr, e.Host, e.Key)
	}
	n := []int64{int64(len(msg))}
	if err := Broadcast(ctx, c, n, 0); err != nil {
		return nil, err
	}
	if n[0] == 0 {
		return nil, nil
	}
	if n[0] > maxAdmit*4*(maxJoinAddr+16) {
		return nil, fmt.Errorf("%w: a list of joiners of %d bytes", ErrMismatch, n[0])
	}
	if c.rank != 0 {
		msg = make([]byte, n[0])
	}
	if err := Broadcast(ctx, c, msg, 0); err != nil {
		return nil, err
	}
	fields := strings.Split(strings.TrimSuffix(string(msg), "\x00"), "\x00")
	if len(fields)%4 != 0 {
		return nil, fmt.Errorf("%w: a malformed list of joiners", ErrMismatch)
	}
	var joiners []Joiner
	var keys []string
	for i := 0; i < len(fields); i += 4 {
		r, err := strconv.Atoi(fields[i])
		if err != nil {
			return nil, fmt.Errorf("%w: a malformed list of joiners", ErrMismatch)
		}
		joiners = append(joiners, Joiner{Rank: r, Addr: fields[i+1], Host: fields[i+2]})
		keys = append(keys, fields[i+3])
	}
	g, err := c.Grow(ctx, joiners)
	if c.rank == 0 {
		var je *JoinError
		errors.As(err, &je)
		rctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
		for i, k := range keys {
			switch {
			case err == nil:
			case je != nil && je.Rank == joiners[i].Rank:
				c.refuseJoiner(rctx, k, je.Err)
			default:
				c.refuseJoiner(rctx, k, ErrJoinFailed)
			}
			_ = c.registry.Delete(rctx, k)
		}
		cancel()
	}
	return g, err
}

// refuseJoiner tells the joiner of registry entry key why it was refused (see
// initJoining), and removes its entry.
func (c *Comm) refuseJoiner(ctx context.Context, key string, why error) {
	reason := "failed"
	switch {
	case errors.Is(why, ErrRankLive):
		reason = "live"
	case errors.Is(why, ErrRankClaimed):
		reason = "claimed"
	}
	c.log.Warn("moex: refused a process that claimed a rank", "rank", c.ranks[c.rank], "entry", key, "why", why)
	_ = c.registry.Set(ctx, bootstrap.RefusedPrefix+key, []byte(reason))
	_ = c.registry.Delete(ctx, key)
}

// refusal is the error of a refusal the live ranks wrote (refuseJoiner).
func refusal(why string) error {
	switch why {
	case "live":
		return ErrRankLive
	case "claimed":
		return ErrRankClaimed
	}
	return ErrJoinFailed
}
