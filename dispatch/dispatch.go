// Package dispatch is the first stage of MoE expert parallelism.
package dispatch

import (
	"context"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/internal/ep"
	"github.com/moex-ai/moex/router"
)

type (
	Act               = ep.Act
	Mode              = ep.Mode
	Config            = ep.Config
	PeerInputError    = ep.PeerInputError
	Stats             = ep.Stats
	Dispatcher[T Act] = ep.Dispatcher[T]
	Pending[T Act]    = ep.Pending[T]
	Output[T Act]     = ep.Output[T]
	Handle            = ep.Handle
	Format            = ep.Format
	Plan              = ep.Plan
	HostTraffic       = ep.HostTraffic
	StageTraffic      = ep.StageTraffic
	TwoLevel[T Act]   = ep.TwoLevel[T]
	TwoLevelHandle    = ep.TwoLevelHandle
)

const (
	Normal              = ep.Normal
	LowLatency          = ep.LowLatency
	Gathered            = ep.Gathered
	MaxLowLatencyTokens = ep.MaxLowLatencyTokens
	BlockHeader         = ep.BlockHeader
	CodeOK              = ep.CodeOK
	CodeShape           = ep.CodeShape
	CodeRouting         = ep.CodeRouting
	CodeTooMany         = ep.CodeTooMany
	CodeStale           = ep.CodeStale
	CodeOutput          = ep.CodeOutput
	CodeWeights         = ep.CodeWeights
)

var (
	ErrConfig   = ep.ErrConfig
	ErrInput    = ep.ErrInput
	ErrMismatch = ep.ErrMismatch
	ErrStale    = ep.ErrStale
	ErrBusy     = ep.ErrBusy
)

func ParseMode(s string) (Mode, error) { return ep.ParseMode(s) }

func New[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*Dispatcher[T], error) {
	return ep.New[T](ctx, c, cfg)
}

func Defaults[T Act](cfg Config) (Config, error) { return ep.Defaults[T](cfg) }

func LowLatencyBytes[T Act](cfg Config, shared bool) (int, error) {
	return ep.LowLatencyBytes[T](cfg, shared)
}

func NewFormat(cfg Config) Format                            { return ep.NewFormat(cfg) }
func Fingerprint(cfg Config) uint64                          { return ep.Fingerprint(cfg) }
func PlacementFingerprint(pl *router.Placement) uint64       { return ep.PlacementFingerprint(pl) }
func PutHeader(b []byte, status, rows int, fp, gen uint64)   { ep.PutHeader(b, status, rows, fp, gen) }
func ReadHeader(b []byte) (status, rows int, fp, gen uint64) { return ep.ReadHeader(b) }
func NewPlan(cfg Config, routings []*router.Routing) (*Plan, error) {
	return ep.NewPlan(cfg, routings)
}
func ChooseTwoLevel(c *coll.Comm, cfg Config) (bool, string) { return ep.ChooseTwoLevel(c, cfg) }
func NewTwoLevel[T Act](ctx context.Context, c *coll.Comm, cfg Config) (*TwoLevel[T], error) {
	return ep.NewTwoLevel[T](ctx, c, cfg)
}
