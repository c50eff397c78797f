package bootstrap

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/moex-ai/moex/transport"
)

// KV is a job's key-value store, as the rendezvous and the registry use it: moex's own
// (Store: rank 0 serves it while the job starts, moex run --restarts for the job's life)
// or one a driver gives for an address with a scheme (MOEX_ADDR=etcd://host:port/job with
// package bootstrap/etcd imported). Keys are the job's: a driver keeps each job under a
// prefix of its own. A method that fails because the start-up failed returns a
// *StartupError; every method honours ctx.
type KV interface {
	// Claim registers this client as rank of a job of size ranks; nonce tells this
	// process from another that claims the same rank: during start-up both then fail
	// with ErrDuplicateRank, and so does every rank that waits. In a store that outlives
	// start-up (a driver's), a claim of a running job's rank fails with ErrRankLive where
	// the rank's process lives, and with ErrJobRunning where it died (this process may
	// take the rank over: coll.Init then does).
	Claim(ctx context.Context, rank, size int, nonce string) error
	// Status returns every rank's start-up stage ("" for a rank not heard from), now.
	Status(ctx context.Context) ([]string, error)
	// Set stores val under key (a driver's: bound to this client's life).
	Set(ctx context.Context, key string, val []byte) error
	// Get waits until every key is set and returns their values.
	Get(ctx context.Context, keys ...string) ([][]byte, error)
	// Scan returns every key that starts with prefix and its value, now, in key order.
	Scan(ctx context.Context, prefix string) (keys []string, vals [][]byte, err error)
	// Delete removes key (a key that is not there is no error).
	Delete(ctx context.Context, key string) error
	// AllGather publishes val as rank's entry under prefix and returns every rank's entry.
	AllGather(ctx context.Context, prefix string, rank, size int, val []byte) ([][]byte, error)
	// Close leaves the store (a driver's: what this client set goes with it). Again is a
	// no-op; a call waiting meanwhile fails.
	Close() error
}

var _ KV = (*Store)(nil)

// KVDriver makes clients of a store reached by an address with a scheme (etcd://...). A
// package that provides one registers it in its init with RegisterKV, as database/sql
// drivers do, so that a program that never uses it does not compile its client.
type KVDriver interface {
	// Dial connects to the store at u (MOEX_ADDR's or MOEX_REGISTRY's URL), for the job
	// u names, and proves token (the job secret): a job of the same name with another
	// secret is refused with transport.ErrAuth. It retries until ctx ends.
	Dial(ctx context.Context, u *url.URL, token []byte) (KV, error)
}

var drivers struct {
	sync.Mutex
	m map[string]KVDriver
}

// RegisterKV makes d the driver of addresses with scheme (without "://"). It panics
// when scheme has a driver already.
func RegisterKV(scheme string, d KVDriver) {
	drivers.Lock()
	defer drivers.Unlock()
	if _, dup := drivers.m[scheme]; dup || d == nil {
		panic("bootstrap: RegisterKV twice, or a nil driver, for " + scheme)
	}
	if drivers.m == nil {
		drivers.m = map[string]KVDriver{}
	}
	drivers.m[scheme] = d
}

// ErrNoDriver: an address names a store whose driver this program does not import.
var ErrNoDriver = errors.New("bootstrap: no driver for the store's address")

// driverImports names the package that provides the driver of each known scheme.
var driverImports = map[string]string{"etcd": "github.com/moex-ai/moex/transport/bootstrap/etcd"}

// storeURL parses addr, the value of variable (MOEX_ADDR, MOEX_REGISTRY): a host:port of
// moex's own store (nil URL), or a URL whose scheme has a driver.
func storeURL(variable, addr string) (*url.URL, KVDriver, error) {
	if !strings.Contains(addr, "://") {
		return nil, nil, nil
	}
	u, err := ParseStoreURL(addr)
	if err != nil {
		return nil, nil, &transport.EnvError{Var: variable, Value: addr, Reason: "want host:port, or scheme://host:port/job"}
	}
	drivers.Lock()
	d := drivers.m[u.Scheme]
	drivers.Unlock()
	if d == nil {
		imp, known := driverImports[u.Scheme]
		if !known {
			return nil, nil, fmt.Errorf("%w: %w", ErrNoDriver, &transport.EnvError{Var: variable, Value: addr, Reason: fmt.Sprintf("no store is reached by %s:// (known: host:port, %s)", u.Scheme, strings.Join(slices.Sorted(maps.Keys(driverImports)), "://, ")+"://")})
		}
		return nil, nil, fmt.Errorf("%w: %w", ErrNoDriver, &transport.EnvError{Var: variable, Value: addr,
			Reason: fmt.Sprintf("this program does not include the %s driver: import _ %q (the moex command does)", u.Scheme, imp)})
	}
	return u, d, nil
}

// ParseStoreURL reads scheme://hosts/path?query, where hosts may list several
// host:port, comma-separated (etcd's endpoints), which url.Parse refuses.
func ParseStoreURL(addr string) (*url.URL, error) {
	scheme, rest, ok := strings.Cut(addr, "://")
	if !ok || scheme == "" {
		return nil, fmt.Errorf("%q: no scheme", addr)
	}
	rest, query, _ := strings.Cut(rest, "?")
	host, path, _ := strings.Cut(rest, "/")
	if host == "" {
		return nil, fmt.Errorf("%q: no host", addr)
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return nil, fmt.Errorf("%q: %w", addr, err)
	}
	return &url.URL{Scheme: strings.ToLower(scheme), Host: host, Path: "/" + path, RawQuery: q.Encode()}, nil
}

// DialKV connects to the store at addr: moex's own at host:port (DialStore), or a
// driver's for a URL (etcd://host:port/job).
func DialKV(ctx context.Context, addr string, token []byte) (KV, error) {
	u, d, err := storeURL("MOEX_ADDR", addr)
	switch {
	case err != nil:
		return nil, err
	case d != nil:
		return d.Dial(ctx, u, token)
	}
	return DialStore(ctx, addr, token)
}

// DialRegistry connects to the job's registry at addr (Env.Registry): moex's own at
// host:port (moex run --restarts serves it), or a driver's for a URL.
func DialRegistry(ctx context.Context, addr string, token []byte) (KV, error) {
	u, d, err := storeURL("MOEX_REGISTRY", addr)
	switch {
	case err != nil:
		return nil, err
	case d != nil:
		return d.Dial(ctx, u, token)
	}
	return dialStore(ctx, addr, token, "the job's registry at "+addr+" (its launcher serves it) does not answer")
}

// IsURL reports whether addr names a driver's store (scheme://...), not moex's own.
func IsURL(addr string) bool { return strings.Contains(addr, "://") }

// Errors of a claim in a store that outlives start-up (a driver's).
var (
	// ErrRankLive: the rank is a live member of the running job.
	ErrRankLive = errors.New("bootstrap: the rank is alive in the running job")
	// ErrJobRunning: the job runs and the rank's process is gone: this process may take
	// it over (coll.Init does, as a process started with MOEX_JOINING=1).
	ErrJobRunning = errors.New("bootstrap: the job is running without this rank")
)

// MemberPrefix is where a store that outlives start-up holds each live rank's claim
// (MemberPrefix<rank>): a process that takes a rank over says it there once admitted, and
// the ranks that find a rank dead remove it (coll.Comm.Shrink).
const MemberPrefix = "rank/"

// RunningPrefix is where a store that outlives start-up holds the ranks that finished it
// (RunningPrefix<rank>, set at Ready): the job is running while one is there.
const RunningPrefix = "running/"

// MemberEntry is what MemberPrefix<rank> holds: the claimant's nonce and the job's size.
func MemberEntry(nonce string, size int) string { return nonce + " " + strconv.Itoa(size) }

// MemberSize is the job's size a MemberEntry says; false where it says none.
func MemberSize(entry []byte) (int, bool) {
	_, n, ok := strings.Cut(string(entry), " ")
	size, err := strconv.Atoi(n)
	return size, ok && err == nil
}

// runningEntry is what RunningPrefix<rank> holds: the rank's transport (Name) and host.
func runningEntry(transportName string) []byte {
	return []byte(transportName + "\n" + transport.HostID())
}

// SayLive records in reg, a store that outlives start-up (etcd), that this process is
// rank of a job of size ranks and reaches the others over transportName, bound to the
// client's life: a process that took the rank over says so once admitted (a starting
// rank says it with its claim and at Ready).
func SayLive(ctx context.Context, reg KV, rank, size int, transportName string) error {
	var nonce [8]byte
	_, _ = rand.Read(nonce[:])
	r := strconv.Itoa(rank)
	return errors.Join(reg.Set(ctx, MemberPrefix+r, []byte(MemberEntry(hex.EncodeToString(nonce[:]), size))),
		reg.Set(ctx, RunningPrefix+r, runningEntry(transportName)))
}

// ForgetRank removes rank's entries from reg: the live ranks found its process dead
// (coll.Comm.Shrink), so a process started again for it takes it over at once rather
// than being refused while the dead one's lease lives.
func ForgetRank(ctx context.Context, reg KV, rank int) error {
	r := strconv.Itoa(rank)
	return errors.Join(reg.Delete(ctx, MemberPrefix+r), reg.Delete(ctx, RunningPrefix+r))
}
