package bench

import (
	"github.com/moex-ai/moex/coll/dtype"
	"github.com/moex-ai/moex/combine"
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
)

// PlanMoE plans one MoE step of o's model on p ranks without running them: every rank's
// tokens routed by the model's router (as `moex bench moe` routes them), the placement,
// and the dispatch and combine that follow (combine.NewPlan; shared: the ranks map each
// other's memory, one host). Nothing touches a transport.
func PlanMoE(o MoEOpts, p int, shared bool) (*combine.Plan, models.Config, error) {
	cfg, err := models.Get(o.Model)
	if err != nil {
		return nil, cfg, err
	}
	if o.Wire == 0 {
		o.Wire = dtype32
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Act == 0 {
		o.Act = dtype32
	}
	switch {
	case o.Combine == 0 && o.SumAtOrigin:
		o.Combine = o.Act // the outputs travel as they are
	case o.Combine == 0:
		o.Combine = defaultCombine(o.Wire)
	}
	pl, err := placementOf(o.Placement, cfg.Experts, p)
	if err != nil {
		return nil, cfg, err
	}
	layer, err := models.NewRoutedLayer(cfg, o.Seed, []int{}, 0) // the router only
	if err != nil {
		return nil, cfg, err
	}
	routings := make([]*router.Routing, p)
	for r := range routings {
		x := models.Floats(cfg.Tokens(o.Seed, r, o.Tokens))
		if routings[r], err = layer.Route(x, o.Tokens); err != nil {
			return nil, cfg, err
		}
	}
	dcfg := dispatch.Config{Hidden: cfg.Hidden, TopK: cfg.TopK, WireDType: o.Wire, Placement: pl,
		Mode: o.Mode, MaxTokens: maxTokensOf(o), PushRows: o.PushRows, MaxBufferBytes: o.MaxBufferBytes, Quantized: o.Quantized}
	ccfg := combine.Config{PartialDType: o.Combine, SumAtOrigin: o.SumAtOrigin, SendPartials: o.SendPartials}
	if o.Act == dtype.BF16 {
		plan, err := combine.NewPlan[dtype.BFloat16](dcfg, ccfg, routings, shared)
		return plan, cfg, err
	}
	plan, err := combine.NewPlan[float32](dcfg, ccfg, routings, shared)
	return plan, cfg, err
}
