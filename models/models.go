// Package models holds the MoE configurations of real models (their public
// hyper-parameters, with the config each comes from) and a reference MoE layer: router +
// SwiGLU experts (+ shared experts), float32, weights drawn from a seed, with
// gorgonia.org/tensor at its API boundary. The expert-parallel forward (router, dispatch,
// expert compute, combine over P ranks) is checked against the single-rank reference.
//
// models owns the numerics of one MoE layer; it imports dispatch and combine to run the
// expert-parallel form, and must not be imported by them.
package models

import (
	"fmt"
	"sort"
	"strings"

	"github.com/moex-ai/moex/router"
)

// Config is one MoE layer of a model.
type Config struct {
	Name        string // as ByName takes it
	Hidden      int    // hidden_size
	ExpertFFN   int    // intermediate size of one routed expert
	Experts     int    // routed experts
	TopK        int    // experts per token
	Shared      int    // shared experts (always applied)
	SharedFFN   int    // intermediate size of one shared expert (0: ExpertFFN)
	Gating      router.Gating
	Renormalize bool    // softmax-topk: renormalise the chosen probabilities
	Groups      int     // DeepSeek-V3 n_group
	TopKGroups  int     // DeepSeek-V3 topk_group
	Scaling     float32 // routed_scaling_factor
	Layers      int     // MoE layers in the model (for totals only)
	Source      string  // where the numbers come from
	Note        string  // what the reference layer simplifies
}

// The configurations. Numbers are from each model's published config.json (Hugging Face
// hub path given in Source).
var configs = []Config{
	{
		Name: "mixtral-8x7b", Hidden: 4096, ExpertFFN: 14336, Experts: 8, TopK: 2,
		Gating: router.TopKSoftmax, Layers: 32,
		Source: "mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336, num_local_experts 8, num_experts_per_tok 2, num_hidden_layers 32",
	},
	{
		Name: "mixtral-8x22b", Hidden: 6144, ExpertFFN: 16384, Experts: 8, TopK: 2,
		Gating: router.TopKSoftmax, Layers: 56,
		Source: "mistralai/Mixtral-8x22B-v0.1 config.json: hidden_size 6144, intermediate_size 16384, num_local_experts 8, num_experts_per_tok 2, num_hidden_layers 56",
	},
	{
		Name: "deepseek-v3", Hidden: 7168, ExpertFFN: 2048, Experts: 256, TopK: 8, Shared: 1,
		Gating: router.DeepSeekV3, Groups: 8, TopKGroups: 4, Scaling: 2.5, Renormalize: true, Layers: 58,
		Source: "deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, moe_intermediate_size 2048, n_routed_experts 256, n_shared_experts 1, num_experts_per_tok 8, n_group 8, topk_group 4, routed_scaling_factor 2.5, norm_topk_prob true, scoring_func sigmoid, topk_method noaux_tc; 61 layers of which first_k_dense_replace 3 are dense",
	},
	{
		Name: "qwen3-30b-a3b", Hidden: 2048, ExpertFFN: 768, Experts: 128, TopK: 8,
		Gating: router.SoftmaxTopK, Renormalize: true, Layers: 48,
		Source: "Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, moe_intermediate_size 768, num_experts 128, num_experts_per_tok 8, norm_topk_prob true, num_hidden_layers 48",
	},
	{
		Name: "qwen3-235b-a22b", Hidden: 4096, ExpertFFN: 1536, Experts: 128, TopK: 8,
		Gating: router.SoftmaxTopK, Renormalize: true, Layers: 94,
		Source: "Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, moe_intermediate_size 1536, num_experts 128, num_experts_per_tok 8, norm_topk_prob true, num_hidden_layers 94",
	},
	{
		Name: "dbrx", Hidden: 6144, ExpertFFN: 10752, Experts: 16, TopK: 4,
		Gating: router.SoftmaxTopK, Renormalize: true, Layers: 40,
		Source: "databricks/dbrx-base config.json: d_model 6144, ffn_config.ffn_hidden_size 10752, moe_num_experts 16, moe_top_k 4, moe_normalize_expert_weights 1, n_layers 40",
	},
	{
		Name: "olmoe-1b-7b", Hidden: 2048, ExpertFFN: 1024, Experts: 64, TopK: 8,
		Gating: router.SoftmaxTopK, Renormalize: false, Layers: 16,
		Source: "allenai/OLMoE-1B-7B-0924 config.json: hidden_size 2048, intermediate_size 1024, num_experts 64, num_experts_per_tok 8, norm_topk_prob false, num_hidden_layers 16",
	},
	{
		Name: "gpt-oss-120b", Hidden: 2880, ExpertFFN: 2880, Experts: 128, TopK: 4,
		Gating: router.TopKSoftmax, Layers: 36,
		Source: "openai/gpt-oss-120b config.json: hidden_size 2880, intermediate_size 2880, num_local_experts 128, num_experts_per_tok 4, num_hidden_layers 36",
		Note:   "the reference uses plain SwiGLU; gpt-oss clamps and scales its gated activation and has expert biases",
	},
	// Tiny configurations for tests: the same gating styles at small sizes.
	{Name: "tiny-mixtral", Hidden: 32, ExpertFFN: 48, Experts: 8, TopK: 2, Gating: router.TopKSoftmax, Layers: 1, Source: "test"},
	{Name: "tiny-deepseek", Hidden: 32, ExpertFFN: 16, Experts: 16, TopK: 4, Shared: 1, Gating: router.DeepSeekV3,
		Groups: 4, TopKGroups: 2, Scaling: 2.5, Renormalize: true, Layers: 1, Source: "test"},
	{Name: "tiny-qwen", Hidden: 24, ExpertFFN: 16, Experts: 12, TopK: 3, Gating: router.SoftmaxTopK, Renormalize: true, Layers: 1, Source: "test"},
	{Name: "tiny-olmoe", Hidden: 16, ExpertFFN: 8, Experts: 6, TopK: 2, Gating: router.SoftmaxTopK, Layers: 1, Source: "test"},
}

// Get returns the configuration named name.
func Get(name string) (Config, error) {
	for _, c := range configs {
		if strings.EqualFold(c.Name, name) {
			return c, nil
		}
	}
	return Config{}, fmt.Errorf("models: unknown model %q (have %s)", name, strings.Join(Names(), ", "))
}

// Names lists the configurations.
func Names() []string {
	var n []string
	for _, c := range configs {
		n = append(n, c.Name)
	}
	sort.Strings(n)
	return n
}

// RouterConfig returns the router configuration of the model (bias set separately).
func (c Config) RouterConfig() router.Config {
	return router.Config{
		Experts: c.Experts, TopK: c.TopK, Gating: c.Gating, Renormalize: c.Renormalize,
		Groups: c.Groups, TopKGroups: c.TopKGroups, ScalingFactor: c.Scaling, NormTopK: c.Renormalize,
	}
}

// SharedSize is the intermediate size of one shared expert.
func (c Config) SharedSize() int {
	if c.SharedFFN > 0 {
		return c.SharedFFN
	}
	return c.ExpertFFN
}

// ExpertParams is the number of parameters of one routed expert (three matrices).
func (c Config) ExpertParams() int64 { return 3 * int64(c.Hidden) * int64(c.ExpertFFN) }

// LayerBytes is the float32 size of every expert of one layer (routed and shared) plus the
// router.
func (c Config) LayerBytes() int64 {
	routed := int64(c.Experts) * c.ExpertParams()
	shared := int64(c.Shared) * 3 * int64(c.Hidden) * int64(c.SharedSize())
	return 4 * (routed + shared + int64(c.Experts)*int64(c.Hidden))
}
