/* Named presets: the routing convention and shape of a model family's
 * flagship checkpoint, as a top-k gating or router descriptor. One table,
 * a row per family; docs/routing.md ("Presets") cites each row's source. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

typedef struct preset {
    const char *name;
    uint32_t num_experts, top_k, hidden_dim;
    moecl_scoring scoring;
    moecl_weighting weighting;
    uint32_t groups, topk_group;
    moecl_group_score group_score;
    moecl_group_fill group_fill;
    bool renormalize;
    float scale;
    float eps; /* renormalize_eps: the models that divide by sum + 1e-20 */
} preset;

#define SOFTMAX MOECL_SCORING_SOFTMAX
#define SIGMOID MOECL_SCORING_SIGMOID
#define SQRTSOFTPLUS MOECL_SCORING_SQRTSOFTPLUS
#define RAW MOECL_SCORING_RAW
#define SCORE MOECL_WEIGHTS_SCORE
#define SOFTMAX_CHOSEN MOECL_WEIGHTS_SOFTMAX_CHOSEN
#define SIGMOID_CHOSEN MOECL_WEIGHTS_SIGMOID_CHOSEN
#define GMAX MOECL_GROUP_SCORE_MAX
#define GTOP2 MOECL_GROUP_SCORE_TOP2_SUM
#define NEG_INF MOECL_GROUP_FILL_NEG_INF
#define ZERO MOECL_GROUP_FILL_ZERO

/* Each row: the checkpoint's config.json (the shape) and the routing of
 * Hugging Face transformers' modeling file for that model type. Ungrouped
 * rows keep the neutral group fields (score max, fill -inf), which the
 * library ignores without groups. */
static const preset presets[] = {
    /* mistralai/Mixtral-8x7B-v0.1: num_local_experts 8, num_experts_per_tok
     * 2, hidden_size 4096; modeling_mixtral.py: fp32 softmax over all
     * experts, top-k, divided by the chosen sum. */
    {"mixtral", 8, 2, 4096, SOFTMAX, SCORE, 0, 0, GMAX, NEG_INF, true, 1.0f, 0.0f},
    /* Qwen/Qwen3-235B-A22B: num_experts 128, num_experts_per_tok 8,
     * norm_topk_prob true, hidden_size 4096; modeling_qwen3_moe.py: as
     * Mixtral. */
    {"qwen3-moe", 128, 8, 4096, SOFTMAX, SCORE, 0, 0, GMAX, NEG_INF, true, 1.0f, 0.0f},
    /* Qwen/Qwen3-Next-80B-A3B-Instruct: num_experts 512,
     * num_experts_per_tok 10, norm_topk_prob true, hidden_size 2048;
     * modeling_qwen3_next.py: as Mixtral (its shared expert's sigmoid gate
     * is not part of the routing). */
    {"qwen3-next", 512, 10, 2048, SOFTMAX, SCORE, 0, 0, GMAX, NEG_INF, true, 1.0f, 0.0f},
    /* deepseek-ai/DeepSeek-V2: n_routed_experts 160, num_experts_per_tok 6,
     * n_group 8, topk_group 3, topk_method group_limited_greedy,
     * scoring_func softmax, norm_topk_prob false, routed_scaling_factor
     * 16.0, hidden_size 5120; modeling_deepseek_v2.py: group score the max,
     * dropped groups' scores filled with 0.0, weights the scores times
     * the factor. */
    {"deepseek-v2", 160, 6, 5120, SOFTMAX, SCORE, 8, 3, GMAX, ZERO, false, 16.0f, 0.0f},
    /* deepseek-ai/DeepSeek-V3: n_routed_experts 256, num_experts_per_tok 8,
     * n_group 8, topk_group 4, topk_method noaux_tc, scoring_func sigmoid,
     * norm_topk_prob true, routed_scaling_factor 2.5, hidden_size 7168;
     * modeling_deepseek_v3.py: sigmoid, e_score_correction_bias for the
     * choice, group score the top-2 sum, dropped groups filled with 0.0,
     * unbiased weights divided by sum + 1e-20, times the factor. */
    {"deepseek-v3", 256, 8, 7168, SIGMOID, SCORE, 8, 4, GTOP2, ZERO, true, 2.5f, 1e-20f},
    /* deepseek-ai/DeepSeek-V4-Pro: n_routed_experts 384, num_experts_per_tok
     * 6, scoring_func sqrtsoftplus, topk_method noaux_tc, norm_topk_prob
     * true, routed_scaling_factor 2.5, hidden_size 7168;
     * modeling_deepseek_v4.py (DeepseekV4TopKRouter): no groups, the bias
     * for the choice, weights divided by sum + 1e-20, times the factor. */
    {"deepseek-v4", 384, 6, 7168, SQRTSOFTPLUS, SCORE, 0, 0, GMAX, NEG_INF, true, 2.5f, 1e-20f},
    /* meta-llama/Llama-4-Maverick-17B-128E-Instruct: num_local_experts 128,
     * num_experts_per_tok 1, hidden_size 5120; modeling_llama4.py
     * (Llama4Router): top-k of the logits, the sigmoid of each chosen. */
    {"llama4", 128, 1, 5120, RAW, SIGMOID_CHOSEN, 0, 0, GMAX, NEG_INF, false, 1.0f, 0.0f},
    /* openai/gpt-oss-120b: num_local_experts 128, num_experts_per_tok 4,
     * hidden_size 2880; modeling_gpt_oss.py (GptOssTopKRouter): top-k of the
     * logits (gate bias included), a softmax over the chosen. */
    {"gpt-oss", 128, 4, 2880, RAW, SOFTMAX_CHOSEN, 0, 0, GMAX, NEG_INF, false, 1.0f, 0.0f},
    /* zai-org/GLM-4.5: n_routed_experts 160, num_experts_per_tok 8, n_group
     * 1, topk_group 1, norm_topk_prob true, routed_scaling_factor 2.5,
     * hidden_size 5120; modeling_glm4_moe.py: DeepSeek-V3's routing, one
     * group (no group limit). */
    {"glm-4.5", 160, 8, 5120, SIGMOID, SCORE, 0, 0, GMAX, NEG_INF, true, 2.5f, 1e-20f},
    /* moonshotai/Kimi-K2-Instruct: n_routed_experts 384, num_experts_per_tok
     * 8, n_group 1, topk_group 1, scoring_func sigmoid, topk_method
     * noaux_tc, norm_topk_prob true, routed_scaling_factor 2.827,
     * hidden_size 7168; DeepSeek-V3's modeling file (its architecture). */
    {"kimi-k2", 384, 8, 7168, SIGMOID, SCORE, 0, 0, GMAX, NEG_INF, true, 2.827f, 1e-20f},
    /* MiniMaxAI/MiniMax-M2: num_local_experts 256, num_experts_per_tok 8,
     * scoring_func sigmoid, use_routing_bias true, hidden_size 3072;
     * modeling_minimax_m2.py: sigmoid, e_score_correction_bias for the
     * choice, unbiased weights divided by their sum. */
    {"minimax-m2", 256, 8, 3072, SIGMOID, SCORE, 0, 0, GMAX, NEG_INF, true, 1.0f, 0.0f},
    /* google/gemma-4-26B-A4B: text_config num_experts 128, top_k_experts 8,
     * hidden_size 2816; modeling_gemma4.py (Gemma4TextRouter): softmax,
     * top-k, divided by the chosen sum (then per_expert_scale, which a
     * preset does not hold). */
    {"gemma4", 128, 8, 2816, SOFTMAX, SCORE, 0, 0, GMAX, NEG_INF, true, 1.0f, 0.0f},
    /* allenai/OLMoE-1B-7B-0924: num_experts 64, num_experts_per_tok 8,
     * norm_topk_prob false, hidden_size 2048; modeling_olmoe.py: softmax,
     * top-k, the scores as they are. */
    {"olmoe", 64, 8, 2048, SOFTMAX, SCORE, 0, 0, GMAX, NEG_INF, false, 1.0f, 0.0f},
};

#define NUM_PRESETS (sizeof(presets) / sizeof(presets[0]))

const char *moecl_preset_name(size_t i)
{
    return i < NUM_PRESETS ? presets[i].name : NULL;
}

/* The row of family, or NULL with the thread's context-less error set. */
static const preset *find(const char *family, const void *desc, moecl_status *st)
{
    *st = MOECL_ERROR_INVALID_ARGUMENT;
    if (!family) {
        moecl_fail(NULL, *st, "family is NULL");
        return NULL;
    }
    if (!desc) {
        moecl_fail(NULL, *st, "desc is NULL");
        return NULL;
    }
    for (size_t i = 0; i < NUM_PRESETS; i++)
        if (!strcmp(presets[i].name, family)) {
            *st = MOECL_SUCCESS;
            return &presets[i];
        }
    /* The known names, for the message: no guess at what was meant. */
    char names[512];
    size_t n = 0;
    names[0] = '\0';
    for (size_t i = 0; i < NUM_PRESETS && n < sizeof(names); i++)
        n += (size_t)snprintf(names + n, sizeof(names) - n, "%s%s", i ? ", " : "", presets[i].name);
    moecl_fail(NULL, *st, "family '%.64s' is not a preset; the presets are %s", family, names);
    return NULL;
}

/* The router's descriptor of row p: the one place the table's fields are
 * read. The top-k descriptor is derived from it, so the two agree. */
static moecl_grounded_router_desc router_desc(const preset *p, uint32_t num_tokens)
{
    /* alpha 1: g is the gate's product itself. */
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(num_tokens, p->hidden_dim, p->num_experts, 1.0f);
    d.top_k = p->top_k;
    d.gating.scoring = p->scoring;
    d.gating.weighting = p->weighting;
    d.gating.num_expert_groups = p->groups;
    d.gating.topk_group = p->topk_group;
    d.gating.group_score = p->group_score;
    d.gating.group_fill = p->group_fill;
    d.gating.renormalize = p->renormalize;
    d.gating.routed_scaling_factor = p->scale;
    d.gating.renormalize_eps = p->eps;
    return d;
}

moecl_status moecl_grounded_router_desc_preset(const char *family, uint32_t num_tokens,
                                               moecl_grounded_router_desc *desc)
{
    moecl_status st;
    const preset *p = find(family, desc, &st);
    if (p)
        *desc = router_desc(p, num_tokens);
    return st;
}

moecl_status moecl_topk_gating_desc_preset(const char *family, uint32_t num_tokens, moecl_topk_gating_desc *desc)
{
    moecl_status st;
    const preset *p = find(family, desc, &st);
    if (p) {
        const moecl_grounded_router_desc g = router_desc(p, num_tokens);
        *desc = moecl_grounded_gating_desc(&g);
    }
    return st;
}
