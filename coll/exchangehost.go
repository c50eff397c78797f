package coll

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/moex-ai/moex/coll/exchange"
	"github.com/moex-ai/moex/obuf"
	"github.com/moex-ai/moex/transport"
)

// Exchange is an AlltoAllv whose block sizes travel with the data, into buffers sized
// once (package exchange has it; Comm.NewExchange makes one on a communicator).
type Exchange = exchange.Exchange

// XOp is one exchange in flight: Begin, Dest and Send each block, Wait, Recv.
type XOp = exchange.Op

// ExchangeConfig sizes an Exchange: the capacity of each field of a block, and how many
// exchanges may be in flight or hold data at once.
type ExchangeConfig = exchange.Config

// MaxExchangeFields is the most fields an exchange block may have.
const MaxExchangeFields = exchange.MaxFields

// ErrBusy: an operation would reuse buffers that an earlier one, not finished, still uses.
var ErrBusy = exchange.ErrBusy

// NewExchange makes an Exchange on c. It is collective: every rank calls it with the
// same configuration.
func (c *Comm) NewExchange(ctx context.Context, cfg ExchangeConfig) (*Exchange, error) {
	x, err := exchange.New(ctx, exchangeHost{c}, cfg)
	if err == nil && c.log.Enabled(ctx, slog.LevelInfo) {
		paths := map[string][]int{}
		for q := 0; q < c.size; q++ {
			if q != c.rank {
				paths[x.Path(q)] = append(paths[x.Path(q)], q)
			}
		}
		for path, ranks := range paths {
			c.log.Info("moex: exchange", "rank", c.rank, "to", ranks, "path", path)
		}
	}
	return x, err
}

// ExchangeBytes is the memory (Exchange.Bytes) that an exchange of cfg holds on each of
// ranks ranks, where every other rank writes its blocks into this rank's memory (windows:
// inproc, or shm with every rank on one host) or where they travel as messages. It runs
// nothing.
func ExchangeBytes(cfg ExchangeConfig, ranks int, windows bool) int {
	return exchange.Bytes(cfg, ranks, windows)
}

// exchangeHost gives an exchange what it needs of its communicator (exchange.Host).
type exchangeHost struct{ c *Comm }

var _ exchange.Host = exchangeHost{}

func (h exchangeHost) Size() int                      { return h.c.size }
func (h exchangeHost) Rank() int                      { return h.c.rank }
func (h exchangeHost) World(q int) int                { return h.c.ranks[q] }
func (h exchangeHost) Transport() transport.Transport { return h.c.tr }
func (h exchangeHost) ID() uint32                     { return h.c.id }
func (h exchangeHost) Pool() *obuf.Pool               { return h.c.pool }
func (h exchangeHost) Profiling() bool                { return h.c.cfg.Profile }
func (h exchangeHost) Tracing() bool                  { return h.c.cfg.TraceDir != "" }
func (h exchangeHost) End()                           { h.c.end() }
func (h exchangeHost) Aborted() context.Context       { return h.c.actx }
func (h exchangeHost) Waiting(q, delta int)           { h.c.pend[q].Add(int32(delta)) }
func (h exchangeHost) Progressed()                    { h.c.dog.Progressed() }
func (h exchangeHost) Now() int64                     { return nanotime() }

func (h exchangeHost) OpenWindow(ctx context.Context, sig uint32, size int, what string) (transport.Window, []byte, error) {
	return h.c.openWindow(ctx, sig, size, what)
}

func (h exchangeHost) Begin(ctx context.Context) (uint32, error) {
	if err := h.c.begin(ctx); err != nil {
		return 0, err
	}
	return h.c.nextSeq(), nil
}

func (h exchangeHost) Fail(err error) error {
	_ = h.c.fail(err)
	return h.c.opError()
}

func (h exchangeHost) Record(arrived []int64, order []int32) (time.Duration, int, []int32) {
	return h.c.recordExchange(arrived, order)
}

func (h exchangeHost) Trace(begun, t0 int64, wait time.Duration, last int, arrived []int64, order []int32) {
	h.c.traceExchange(begun, t0, wait, last, arrived, order)
}

func (h exchangeHost) Invalid(arg, format string, a ...any) error {
	return &ArgError{Arg: arg, Reason: fmt.Sprintf(format, a...)} // this rank's mistake: nothing aborts
}
