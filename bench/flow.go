package bench

import (
	"github.com/moex-ai/moex/dispatch"
	"github.com/moex-ai/moex/models"
	"github.com/moex-ai/moex/router"
)

// PlanMoE plans one MoE step of o's model on p ranks without running them: every rank's
// tokens routed by the model's router (as `moex bench moe` routes them), the placement,
// and the dispatch and combine that follow (dispatch.NewPlan). Nothing touches a
// transport.
func PlanMoE(o MoEOpts, p int) (*dispatch.Plan, models.Config, error) {
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
	dcfg := dispatch.Config{Hidden: cfg.Hidden, TopK: cfg.TopK, WireDType: o.Wire, CombineDType: o.Combine, Placement: pl,
		Mode: o.Mode, MaxTokens: max(o.Tokens, 1), SumAtOrigin: o.SumAtOrigin}
	plan, err := dispatch.NewPlan(dcfg, routings)
	return plan, cfg, err
}
