// Package etcd lets moex jobs meet in etcd (its v3 API, etcd 3.4 and later): with
// MOEX_ADDR=etcd://host:port/job, every rank is a client of etcd, no rank serves a store,
// and the job's membership outlives start-up, so that a process started again for a rank
// whose process died finds the running job and takes the rank over by itself (coll.Init
// returns the grown communicator once the live ranks admit it: coll.Comm.Admit).
//
// A program enables it by importing it for its side effect, as a database/sql driver:
//
//	import _ "github.com/moex-ai/moex/transport/bootstrap/etcd"
//
// The moex command does; a program that does not, given an etcd:// address, fails at
// coll.Init with an error naming this import (bootstrap.ErrNoDriver).
//
// The address is etcd://host:port[,host:port...]/job[?ttl=5s]: etcd's client endpoints,
// the job's name (letters, digits, '.', '_', '-'), under which every key of the job lives
// (/moex/job/), and how long a process's entries outlive it when it dies without leaving
// (its lease's TTL; default 5s, at least 2s). Each rank's entries are bound to a lease its
// client keeps alive, so a dead process's go with it; the ranks that find a rank dead
// remove its entry at once (coll.Comm.Shrink). A job started again under the same name
// within the TTL of a whole job's crash may find the dead processes' claims (refused:
// ErrDuplicateRank) or their failure: start it again after the TTL, or under a new name.
// The job secret (MOEX_JOB_TOKEN) still authenticates the ranks to each other; a process
// whose secret differs from that of the running ranks of the same job name is refused
// (transport.ErrAuth).
package etcd

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/moex-ai/moex/transport"
	"github.com/moex-ai/moex/transport/bootstrap"
)

func init() { bootstrap.RegisterKV("etcd", driver{}) }

// DefaultTTL is how long a process's entries outlive it when it dies without leaving.
const DefaultTTL = 5 * time.Second

// Bounds of the address's parts.
const (
	MinTTL     = 2 * time.Second // etcd's own minimum lease, with its default timing
	MaxTTL     = 5 * time.Minute
	maxScan    = 4096 // entries one Scan returns
	maxJobName = 128
)

var jobName = regexp.MustCompile(`^[A-Za-z0-9._-]+$`)

type driver struct{}

// Config is what an etcd:// address says.
type Config struct {
	Endpoints []string      // etcd's client endpoints, host:port
	Job       string        // the job's name: its keys live under /moex/<Job>/
	TTL       time.Duration // how long a dead process's entries outlive it
}

// ParseURL reads an etcd:// address (see the package's documentation).
func ParseURL(u *url.URL) (Config, error) {
	addr := u.String()
	bad := func(why string) (Config, error) {
		return Config{}, &transport.EnvError{Var: "MOEX_ADDR", Value: addr, Reason: why + " (want etcd://host:port[,host:port...]/job[?ttl=5s])"}
	}
	if u.Scheme != "etcd" || u.Host == "" {
		return bad("not an etcd address")
	}
	cfg := Config{Job: strings.Trim(u.Path, "/"), TTL: DefaultTTL}
	for _, ep := range strings.Split(u.Host, ",") {
		if ep == "" {
			return bad("an empty endpoint")
		}
		if !strings.Contains(ep, ":") {
			ep += ":2379"
		}
		cfg.Endpoints = append(cfg.Endpoints, ep)
	}
	if cfg.Job == "" || len(cfg.Job) > maxJobName || !jobName.MatchString(cfg.Job) {
		return bad(fmt.Sprintf("the job's name %q: want 1 to %d letters, digits, '.', '_' or '-'", cfg.Job, maxJobName))
	}
	for k, v := range u.Query() {
		switch k {
		case "ttl":
			d, err := time.ParseDuration(v[0])
			if err != nil || d < MinTTL || d > MaxTTL {
				return bad(fmt.Sprintf("ttl=%s: want a duration from %v to %v", v[0], MinTTL, MaxTTL))
			}
			cfg.TTL = d
		default:
			return bad(fmt.Sprintf("unknown parameter %q", k))
		}
	}
	return cfg, nil
}

// Dial implements bootstrap.KVDriver.
func (driver) Dial(ctx context.Context, u *url.URL, token []byte) (bootstrap.KV, error) {
	cfg, err := ParseURL(u)
	if err != nil {
		return nil, err
	}
	return Dial(ctx, cfg, token)
}

// KV is a client of a job in etcd (bootstrap.KV): what it sets is bound to its lease,
// which it keeps alive until Close.
type KV struct {
	cfg    Config
	where  string // etcd://endpoints/job, for errors
	prefix string
	c      *clientv3.Client
	lease  clientv3.LeaseID
	stop   context.CancelFunc
	kept   chan struct{} // closed when the keep-alive ends

	mu   sync.Mutex
	size int // the job's ranks, from this client's claim

	closeOnce sync.Once
}

// Dial connects to etcd at cfg.Endpoints, retrying until ctx ends, takes a lease and
// checks the job's secret: a job of the same name whose ranks prove another secret
// refuses this client (transport.ErrAuth).
func Dial(ctx context.Context, cfg Config, token []byte) (*KV, error) {
	where := "etcd://" + strings.Join(cfg.Endpoints, ",") + "/" + cfg.Job
	var c *clientv3.Client
	var lastErr error
	for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		dl := 2 * time.Second
		if d, ok := ctx.Deadline(); ok {
			dl = min(dl, time.Until(d))
		}
		if dl > 0 {
			var err error
			c, err = clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: dl, Logger: zap.NewNop()})
			if err == nil {
				break
			}
			lastErr = err
		}
		select {
		case <-ctx.Done():
			return nil, &bootstrap.StartupError{Rank: -1, Err: transport.Because(transport.CtxError(ctx.Err()),
				"etcd at %s does not answer (last error: %v)", where, lastErr)}
		case <-time.After(backoff):
		}
	}
	fail := func(err error) (*KV, error) {
		c.Close()
		return nil, err
	}
	ttl := int64((cfg.TTL + time.Second - 1) / time.Second)
	g, err := c.Grant(ctx, ttl)
	if err != nil {
		if ctx.Err() != nil {
			err = transport.Because(transport.CtxError(ctx.Err()), "etcd at %s does not answer (%v)", where, err)
		} else {
			err = fmt.Errorf("etcd at %s: a lease: %w", where, err)
		}
		return fail(&bootstrap.StartupError{Rank: -1, Err: err})
	}
	kctx, stop := context.WithCancel(context.Background())
	ch, err := c.KeepAlive(kctx, g.ID)
	if err != nil {
		stop()
		return fail(&bootstrap.StartupError{Rank: -1, Err: fmt.Errorf("etcd at %s: keeping a lease alive: %w", where, err)})
	}
	kv := &KV{cfg: cfg, where: where, prefix: "/moex/" + cfg.Job + "/", c: c, lease: g.ID, stop: stop, kept: make(chan struct{})}
	go func() {
		defer close(kv.kept)
		for range ch { // the client renews the lease; its answers only need draining
		}
	}()
	if err := kv.checkSecret(ctx, token); err != nil {
		kv.Close()
		return nil, err
	}
	return kv, nil
}

// checkSecret refuses a job of this name whose ranks prove another secret, then says
// this client's (bound to its lease, as every entry).
func (kv *KV) checkSecret(ctx context.Context, token []byte) error {
	h := sha256.Sum256(append([]byte("moex etcd job secret\x00"+kv.cfg.Job+"\x00"), token...))
	mine := hex.EncodeToString(h[:])
	resp, err := kv.c.Get(ctx, kv.prefix+"secret/", clientv3.WithPrefix(), clientv3.WithLimit(16))
	if err != nil {
		return kv.failed("reading the job's secret", err)
	}
	for _, e := range resp.Kvs {
		if string(e.Value) != mine {
			return &bootstrap.StartupError{Rank: -1, Err: transport.Because(transport.ErrAuth,
				"%s: the ranks of a running job of that name prove another secret (another job's, or MOEX_JOB_TOKEN differs)", kv.where)}
		}
	}
	_, err = kv.c.Put(ctx, kv.prefix+"secret/"+strconv.FormatInt(int64(kv.lease), 16), mine, clientv3.WithLease(kv.lease))
	if err != nil {
		return kv.failed("saying the job's secret", err)
	}
	return nil
}

// failed is err of etcd, in what, as the error of a call.
func (kv *KV) failed(what string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return transport.Because(transport.CtxError(err), "etcd at %s: %s: no answer", kv.where, what)
	}
	return fmt.Errorf("etcd at %s: %s: %w", kv.where, what, err)
}

// Lease is the client's lease: what it sets lives while it does.
func (kv *KV) Lease() int64 { return int64(kv.lease) }

// Set implements bootstrap.KV: val under key, bound to the client's lease.
func (kv *KV) Set(ctx context.Context, key string, val []byte) error {
	if _, err := kv.c.Put(ctx, kv.prefix+key, string(val), clientv3.WithLease(kv.lease)); err != nil {
		return kv.failed("set "+key, err)
	}
	return nil
}

// Delete implements bootstrap.KV.
func (kv *KV) Delete(ctx context.Context, key string) error {
	if _, err := kv.c.Delete(ctx, kv.prefix+key); err != nil {
		return kv.failed("delete "+key, err)
	}
	return nil
}

// Scan implements bootstrap.KV (at most 4096 entries).
func (kv *KV) Scan(ctx context.Context, prefix string) ([]string, [][]byte, error) {
	resp, err := kv.c.Get(ctx, kv.prefix+prefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend), clientv3.WithLimit(maxScan))
	if err != nil {
		return nil, nil, kv.failed("scan "+prefix, err)
	}
	keys, vals := make([]string, len(resp.Kvs)), make([][]byte, len(resp.Kvs))
	for i, e := range resp.Kvs {
		keys[i], vals[i] = strings.TrimPrefix(string(e.Key), kv.prefix), e.Value
	}
	return keys, vals, nil
}

// failKey is where a failed start-up is said: "gone RANK STAGE" or "dup RANK".
const failKey = "failed"

// running reports whether the job finished start-up and runs (a rank says so at Ready).
func (kv *KV) running(ctx context.Context) (bool, error) {
	resp, err := kv.c.Get(ctx, kv.prefix+bootstrap.RunningPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return false, kv.failed("reading whether the job runs", err)
	}
	return resp.Count > 0, nil
}

// Claim implements bootstrap.KV. While the job starts, the first claim of a rank holds
// it (bound to the client's lease) and a second, another process's, fails the start-up
// of every rank (ErrDuplicateRank); once it runs, a claim fails with ErrRankLive where
// the rank's entry is there and ErrJobRunning where it is gone.
func (kv *KV) Claim(ctx context.Context, rank, size int, nonce string) error {
	kv.mu.Lock()
	kv.size = size
	kv.mu.Unlock()
	key := kv.prefix + bootstrap.MemberPrefix + strconv.Itoa(rank)
	run, err := kv.running(ctx)
	if err != nil {
		return err
	}
	if run {
		resp, err := kv.c.Get(ctx, key, clientv3.WithCountOnly())
		if err != nil {
			return kv.failed("reading rank "+strconv.Itoa(rank)+"'s entry", err)
		}
		if resp.Count > 0 {
			return transport.Because(bootstrap.ErrRankLive, "%s: rank %d is a live member of the running job", kv.where, rank)
		}
		return transport.Because(bootstrap.ErrJobRunning, "%s: the job runs and rank %d's process is gone", kv.where, rank)
	}
	val := bootstrap.MemberEntry(nonce, size)
	resp, err := kv.c.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, val, clientv3.WithLease(kv.lease))).Else(clientv3.OpGet(key)).Commit()
	if err != nil {
		return kv.failed("claiming rank "+strconv.Itoa(rank), err)
	}
	if !resp.Succeeded {
		if rs := resp.Responses[0].GetResponseRange(); rs != nil && len(rs.Kvs) > 0 && string(rs.Kvs[0].Value) == val {
			return nil // this process's claim, again
		}
		_ = kv.sayFailed(ctx, "dup "+strconv.Itoa(rank))
		return &bootstrap.StartupError{Rank: rank, Err: transport.Because(bootstrap.ErrDuplicateRank, "two processes claim rank %d of %s", rank, kv.where)}
	}
	// What a process of an earlier job of this name left for this rank (a dead one's,
	// whose lease lives on) goes: the claim makes this process the rank's only writer.
	if _, err := kv.c.Txn(ctx).Then(clientv3.OpDelete(kv.prefix+byRank(rank), clientv3.WithPrefix()),
		clientv3.OpDelete(kv.prefix+"stage/"+strconv.Itoa(rank))).Commit(); err != nil {
		return kv.failed("clearing rank "+strconv.Itoa(rank)+"'s old entries", err)
	}
	// Every rank must say the same size.
	keys, vals, err := kv.Scan(ctx, bootstrap.MemberPrefix)
	if err != nil {
		return err
	}
	for i, v := range vals {
		if n, _ := bootstrap.MemberSize(v); n != size {
			return &bootstrap.StartupError{Rank: rank, Err: transport.Because(transport.ErrMismatch,
				"%s: %s says the job has %d ranks, this process %d", kv.where, keys[i], n, size)}
		}
	}
	return nil
}

// sayFailed records why the start-up failed, unless it is said already, for every rank
// that waits.
func (kv *KV) sayFailed(ctx context.Context, why string) error {
	k := kv.prefix + failKey
	_, err := kv.c.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, why, clientv3.WithLease(kv.lease))).Commit()
	return err
}

// failure is the *StartupError of what failKey says.
func (kv *KV) failure(why string) error {
	f := strings.Fields(why)
	rank := -1
	if len(f) > 1 {
		rank, _ = strconv.Atoi(f[1])
	}
	if len(f) > 0 && f[0] == "dup" {
		return &bootstrap.StartupError{Rank: rank, Err: transport.Because(bootstrap.ErrDuplicateRank, "two processes claim rank %d of %s", rank, kv.where)}
	}
	stage := ""
	if len(f) > 2 {
		stage = f[2]
	}
	return &bootstrap.StartupError{Rank: rank, Err: &transport.PeerError{Rank: rank, Op: "start-up",
		Err: fmt.Errorf("%w during start-up (its entry in %s is gone; it had reached %q)", transport.ErrPeerClosed, kv.where, stage)}}
}

// Get implements bootstrap.KV: it waits for every key, watching the job's keys from the
// revision it read them at. While the job starts, a rank whose entry goes (its process
// left, or its lease expired) fails the start-up of every rank that waits, as a second
// claim of a rank does.
func (kv *KV) Get(ctx context.Context, keys ...string) ([][]byte, error) {
	ops := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		ops[i] = clientv3.OpGet(kv.prefix + k)
	}
	return kv.await(ctx, "get", ops, func(rs []*etcdserverpb.ResponseOp) ([][]byte, bool) {
		vals := make([][]byte, len(keys))
		for i, r := range rs {
			kvs := r.GetResponseRange().Kvs
			if len(kvs) == 0 {
				return nil, false
			}
			vals[i] = kvs[0].Value
		}
		return vals, true
	})
}

// await reads ops in one transaction, with the start-up's failure (failKey), until take
// finds in their answers every value it waits for, watching the job's keys from each
// read's revision in between (waitChange). A failed start-up ends it with its
// *StartupError.
func (kv *KV) await(ctx context.Context, what string, ops []clientv3.Op, take func([]*etcdserverpb.ResponseOp) ([][]byte, bool)) ([][]byte, error) {
	ops = append(ops, clientv3.OpGet(kv.prefix+failKey))
	for {
		resp, err := kv.c.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, kv.failed(what, err)
		}
		n := len(resp.Responses) - 1
		if f := resp.Responses[n].GetResponseRange().Kvs; len(f) > 0 {
			return nil, kv.failure(string(f[0].Value))
		}
		if vals, ok := take(resp.Responses[:n]); ok {
			return vals, nil
		}
		if err := kv.waitChange(ctx, resp.Header.Revision); err != nil {
			return nil, err
		}
	}
}

// waitChange waits for a change to the job's keys after revision rev. A member's entry
// that goes while the job starts fails the start-up (said at failKey for every rank).
func (kv *KV) waitChange(ctx context.Context, rev int64) error {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	wc := kv.c.Watch(wctx, kv.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithPrevKV())
	for wr := range wc {
		if err := wr.Err(); err != nil {
			return kv.failed("watching the job's keys", err)
		}
		stages := map[string]string{}
		var gone []string
		for _, ev := range wr.Events {
			k := strings.TrimPrefix(string(ev.Kv.Key), kv.prefix)
			if ev.Type != clientv3.EventTypeDelete {
				continue
			}
			if r, ok := strings.CutPrefix(k, "stage/"); ok && ev.PrevKv != nil {
				stages[r] = string(ev.PrevKv.Value)
			}
			if r, ok := strings.CutPrefix(k, bootstrap.MemberPrefix); ok {
				gone = append(gone, r)
			}
		}
		if len(gone) > 0 {
			run, err := kv.running(ctx)
			if err != nil {
				return err
			}
			if !run {
				_ = kv.sayFailed(ctx, "gone "+gone[0]+" "+stages[gone[0]])
			}
		}
		if len(wr.Events) > 0 {
			return nil
		}
	}
	if ctx.Err() != nil {
		return kv.failed("waiting", ctx.Err())
	}
	return kv.failed("watching the job's keys", errors.New("the watch ended"))
}

// AllGather implements bootstrap.KV. Rank r's entry is under its own prefix (byRank), which
// its claim clears: an entry a dead process of an earlier job of the same name left (its
// lease not yet expired) is never read for this one's.
func (kv *KV) AllGather(ctx context.Context, prefix string, rank, size int, val []byte) ([][]byte, error) {
	if err := kv.Set(ctx, byRank(rank)+prefix, val); err != nil {
		return nil, err
	}
	// Each entry counts once written after its rank's claim (a dead process's, of an
	// earlier job of this name, is older than the claim that clears it).
	ops := make([]clientv3.Op, 0, 2*size)
	for q := range size {
		ops = append(ops, clientv3.OpGet(kv.prefix+bootstrap.MemberPrefix+strconv.Itoa(q)), clientv3.OpGet(kv.prefix+byRank(q)+prefix))
	}
	return kv.await(ctx, "all-gather", ops, func(rs []*etcdserverpb.ResponseOp) ([][]byte, bool) {
		vals := make([][]byte, size)
		for q := range size {
			claim, entry := rs[2*q].GetResponseRange().Kvs, rs[2*q+1].GetResponseRange().Kvs
			if len(claim) == 0 || len(entry) == 0 || entry[0].ModRevision < claim[0].CreateRevision {
				return nil, false
			}
			vals[q] = entry[0].Value
		}
		return vals, true
	})
}

// byRank is where rank r's start-up entries are.
func byRank(r int) string { return "byrank/" + strconv.Itoa(r) + "/" }

// Status implements bootstrap.KV: every rank's stage, as far as the entries still say
// (a rank whose entry went is "left" where the failure names it).
func (kv *KV) Status(ctx context.Context) ([]string, error) {
	kv.mu.Lock()
	size := kv.size
	kv.mu.Unlock()
	_, claims, err := kv.Scan(ctx, bootstrap.MemberPrefix)
	if err != nil {
		return nil, err
	}
	for _, v := range claims {
		if m, ok := bootstrap.MemberSize(v); ok && m > size && m <= bootstrap.MaxStoreRanks {
			size = m
		}
	}
	keys, vals, err := kv.Scan(ctx, "stage/")
	if err != nil {
		return nil, err
	}
	stages := make([]string, size)
	for i, k := range keys {
		if r, err := strconv.Atoi(strings.TrimPrefix(k, "stage/")); err == nil && r >= 0 && r < size {
			stages[r] = string(vals[i])
		}
	}
	if resp, err := kv.c.Get(ctx, kv.prefix+failKey); err == nil && len(resp.Kvs) > 0 {
		if f := strings.Fields(string(resp.Kvs[0].Value)); len(f) > 2 && f[0] == "gone" {
			if r, err := strconv.Atoi(f[1]); err == nil && r >= 0 && r < size {
				stages[r] = "left at " + f[2]
			}
		}
	}
	return stages, nil
}

// Close implements bootstrap.KV: it revokes the client's lease, so that what it set
// goes at once (where etcd does not answer within a second, when the lease expires), and
// closes the connection.
func (kv *KV) Close() error {
	var err error
	kv.closeOnce.Do(func() {
		kv.stop()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, _ = kv.c.Revoke(ctx, kv.lease)
		cancel()
		if err = kv.c.Close(); err != nil && !errors.Is(err, context.Canceled) {
			err = kv.failed("leaving", err)
		} else {
			err = nil
		}
		<-kv.kept
	})
	return err
}

// crash closes the connection without revoking the lease, as a process that dies: its
// entries go when the lease expires (tests).
func (kv *KV) crash() {
	kv.closeOnce.Do(func() {
		kv.stop()
		kv.c.Close()
		<-kv.kept
	})
}
