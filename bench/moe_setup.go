package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/moex-ai/moex/coll"
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
	"github.com/moex-ai/moex/transport/bootstrap"
)

// The MoE bench's set-up: the model's layer, its expert-parallel form and the tokens.

// maxTokensOf is the Config.MaxTokens of o's dispatcher: o.Tokens, except in the Auto
// mode, whose default is what a user who sets nothing gets.
func maxTokensOf(o MoEOpts) int {
	if o.Mode == dispatch.Auto {
		return 0
	}
	return max(o.Tokens, 1)
}

// profiled is the operation whose waits the profile of a mode's stages reports.
func profiled(m dispatch.Mode) coll.OpKind {
	if m == dispatch.LowLatency {
		return coll.OpExchange
	}
	return coll.OpAlltoAllv
}

const dtype32 = dtype.F32

// defaultCombine is the bench's combine type for a wire type: f32 after an f32 wire,
// else bf16 (DeepEP's fp8 dispatch, bf16 combine).
func defaultCombine(wire dtype.Type) dtype.Type {
	if wire == dtype.F32 {
		return dtype.F32
	}
	return dtype.BF16
}

func memTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 8 << 30
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) >= 2 && fs[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(fs[1], 10, 64)
			return kb << 10
		}
	}
	return 8 << 30
}

// moeSetup is one rank's expert-parallel layer and tokens, routed.
type moeSetup[T combine.Act] struct {
	cfg models.Config
	pl  *router.Placement
	ep  *models.EP[T]
	x32 []float32 // the tokens
	x   []T       // the same, as the activations
	r   *router.Routing
}

// setup builds, on this rank, the model's layer (with this rank's experts when o.Compute
// is ffn), its expert-parallel form and routed tokens. It fills o's defaults. The caller
// closes s.ep.
func setup[T combine.Act](ctx context.Context, c *coll.Comm, o *MoEOpts) (*moeSetup[T], error) {
	cfg, err := models.Get(o.Model)
	if err != nil {
		return nil, err
	}
	if o.Wire == 0 {
		o.Wire = dtype.F32
	}
	o.Act = dtype.Of[T]()
	switch {
	case o.Combine == 0 && o.SumAtOrigin:
		o.Combine = o.Act // the outputs travel as they are
	case o.Combine == 0:
		o.Combine = defaultCombine(o.Wire)
	}
	if o.Warmup == 0 {
		o.Warmup = 2
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Chunks == 0 {
		o.Chunks = 2
	}
	if o.Pairs == 0 {
		o.Pairs = 32
	}
	pl, err := placementOf(o.Placement, cfg.Experts, c.Size())
	if err != nil {
		return nil, err
	}
	experts := []int{} // none: identity experts
	switch o.Compute {
	case "none", "":
		o.Compute = "none"
	case "ffn":
		experts = pl.Local[c.Rank()]
	default:
		return nil, fmt.Errorf("bench: --compute %q (want none or ffn)", o.Compute)
	}
	budget := memTotal() * 6 / 10 / int64(max(o.LocalRanks, 1))
	layer, err := models.NewRoutedLayer(cfg, o.Seed, experts, budget)
	if err != nil {
		return nil, fmt.Errorf("%w (use --compute none, a smaller model or fewer ranks per process)", err)
	}
	dcfg := dispatch.Config{WireDType: o.Wire, Placement: pl, Mode: o.Mode, MaxTokens: maxTokensOf(*o), Quantized: o.Quantized, PushRows: o.PushRows, MaxBufferBytes: o.MaxBufferBytes}
	ccfg := combine.Config{PartialDType: o.Combine, SendPartials: o.SendPartials, SumAtOrigin: o.SumAtOrigin}
	ep, err := models.NewEP[T](ctx, c, layer, dcfg, ccfg)
	if err != nil {
		return nil, err
	}
	x32 := models.Floats(cfg.Tokens(o.Seed, c.Rank(), o.Tokens))
	r, err := layer.Route(x32, o.Tokens)
	if err != nil {
		ep.Close()
		return nil, err
	}
	x := make([]T, len(x32))
	dtype.Convert(x, x32)
	return &moeSetup[T]{cfg: cfg, pl: pl, ep: ep, x32: x32, x: x, r: r}, nil
}

// placementOf places experts on p ranks as the --placement flag names it.
func placementOf(name string, experts, p int) (*router.Placement, error) {
	kind := router.Contiguous
	switch name {
	case "", "contiguous":
	case "roundrobin", "round-robin":
		kind = router.RoundRobin
	default:
		return nil, fmt.Errorf("bench: placement %q (want contiguous or roundrobin)", name)
	}
	return router.NewPlacement(kind, experts, p)
}

// HostRanks counts the ranks of c on this rank's host.
func HostRanks(c *coll.Comm) int {
	ls := c.Links()
	n := 0
	for _, l := range ls {
		if l.Host == ls[c.Rank()].Host {
			n++
		}
	}
	return n
}

// SharedCPUsAdvice is a word of advice where hostRanks ranks that talk over transport
// (a transport's name) share cpus CPUs with procs Ps each, more than their share
// (bootstrap.ProcsShare), else "".
func SharedCPUsAdvice(transport string, procs, cpus, hostRanks int) string {
	share := bootstrap.ProcsShare(transport, procs, cpus, hostRanks)
	if share == 0 {
		return ""
	}
	return fmt.Sprintf("%d ranks share %d CPUs over %s with GOMAXPROCS %d, so every message wakes threads of the Go runtime on CPUs the ranks need: set GOMAXPROCS=%d, each rank's share, or MOEX_GOMAXPROCS=auto, which moex run and moex bench set (README: Transports and buffers)",
		hostRanks, cpus, transport, procs, share)
}

// SharedCPUsNote is SharedCPUsAdvice for the ranks of r.
func SharedCPUsNote(r *MoEResult) string {
	return SharedCPUsAdvice(r.Transport, r.GOMAXPROCS, r.HostCPUs, r.HostRanks)
}
