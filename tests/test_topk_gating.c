/* moecl_topk_gating against the float64 reference: shapes, dtypes, options,
 * groups, special rows, device-buffer path with offsets and events.
 * meson runs this suite once per launch class (--variant class=cpu|gpu), so the
 * CPU and GPU kernels are both checked on every device. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "internal.h"

static const char *dtype_name(moecl_dtype t) { return t == MOECL_F32 ? "f32" : t == MOECL_F16 ? "f16" : "bf16"; }

static void describe(const moecl_topk_gating_desc *d, bool bias, char *buf, size_t size)
{
    static const char *const scorings[] = {"softmax", "sigmoid", "sqrtsoftplus", "raw"};
    static const char *const weightings[] = {"", " w=softmax-chosen", " w=sigmoid-chosen"};
    snprintf(buf, size, "T=%u E=%u k=%u %s %s%s%s groups=%u/%u %s%s%s factor=%g floor=%g eps=%g", d->num_tokens,
             d->num_experts, d->top_k, dtype_name(d->gating_dtype), scorings[(unsigned)d->scoring % 4],
             weightings[(unsigned)d->weighting % 3], bias ? " bias" : "", d->num_expert_groups,
             d->topk_group, d->group_score == MOECL_GROUP_SCORE_MAX ? "max" : "top2sum",
             d->group_fill == MOECL_GROUP_FILL_ZERO ? " fill-zero" : "", d->renormalize ? " renormalize" : "",
             (double)d->routed_scaling_factor, (double)d->renormalize_floor, (double)d->renormalize_eps);
}

/* Run desc on the given inputs through the host path or the device path
 * (with non-zero offsets), outputs poisoned first; returns the outputs
 * (run_typed, below, for f32 weights and int32 ids). */
static void run_typed(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const void *bias,
                      bool device_path, void *w, void *ids, size_t tail);

static void run(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const float *bias,
                bool device_path, float *w, int32_t *ids)
{
    run_typed(ctx, d, gating, bias, device_path, w, ids, 4);
}

/* Check a result with the reference's rules (near-ties allowed). */
static void check(const moecl_topk_gating_desc *d, const void *gating, const float *bias, const float *w,
                  const int32_t *ids)
{
    char msg[512] = "", what[256];
    int bad = ref_check_topk_gating(d, gating, bias, w, ids, msg, sizeof(msg));
    describe(d, bias != NULL, what, sizeof(what));
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", what, bad, msg);
}

/* Fresh random logits, shift + scale * N(0, 1), and a bias of
 * bias_scale * N(0, 1) when bias_scale > 0, for d; run both paths when
 * both_paths, else alternate by the stream number. */
static void random_case_scaled(moecl_context *ctx, const moecl_topk_gating_desc *d, float shift, float scale,
                               float bias_scale, uint64_t stream, bool both_paths)
{
    harness_rng rng = harness_rng_for(stream);
    const size_t n = (size_t)d->num_tokens * d->num_experts, nk = (size_t)d->num_tokens * d->top_k;
    void *gating = malloc(n * ref_dtype_size(d->gating_dtype) + 4);
    ck_assert_ptr_nonnull(gating);
    for (size_t i = 0; i < n; i++)
        harness_store(d->gating_dtype, gating, i, shift + scale * harness_randn(&rng));
    float *bias = NULL;
    if (bias_scale > 0.0f) {
        bias = malloc(d->num_experts * sizeof(float));
        for (uint32_t e = 0; e < d->num_experts; e++)
            bias[e] = harness_randn(&rng) * bias_scale;
    }
    float *w = malloc(nk * sizeof(float) + 4);
    int32_t *ids = malloc(nk * sizeof(int32_t) + 4);
    ck_assert(w && ids);
    for (int path = 0; path < 2; path++) {
        bool device_path = both_paths ? path == 1 : (stream & 1);
        if (!both_paths && path == 1)
            break;
        run(ctx, d, gating, bias, device_path, w, ids);
        check(d, gating, bias, w, ids);
    }
    free(gating);
    free(bias);
    free(w);
    free(ids);
}

/* Standard-normal logits times 2, and a bias of 0.05 N(0, 1) if asked. */
static void random_case(moecl_context *ctx, const moecl_topk_gating_desc *d, bool with_bias, uint64_t stream,
                        bool both_paths)
{
    random_case_scaled(ctx, d, 0.0f, 2.0f, with_bias ? 0.05f : 0.0f, stream, both_paths);
}

static const uint32_t grid_experts[] = {1, 2, 3, 7, 16, 60, 64, 100, 128, 160, 192, 256, 257, 384, 512, 1000, 2048, 4096};
static const uint32_t grid_topk[] = {1, 2, 6, 8, 16, 64};
static const uint32_t grid_tokens[] = {0, 1, 2, 17, 129, 1019, 4083};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* Every expert count with every valid top_k; the token count and dtype
 * rotate so that each appears with small and large rows, while the number
 * of kernel variants stays what the grid needs. */
START_TEST(test_grid)
{
    moecl_context *ctx = harness_context();
    unsigned i = 0;
    for (size_t e = 0; e < COUNT(grid_experts); e++) {
        for (size_t k = 0; k < COUNT(grid_topk); k++) {
            if (grid_topk[k] > grid_experts[e])
                continue;
            uint32_t tokens = grid_tokens[i % COUNT(grid_tokens)];
            /* Keep the largest rows to fewer tokens: the float64 checker is
             * the slow part, not the kernel. */
            while ((uint64_t)tokens * grid_experts[e] > 2u << 20)
                tokens /= 4;
            moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens, grid_experts[e], grid_topk[k]);
            d.gating_dtype = (moecl_dtype)(i % 3);
            random_case(ctx, &d, false, 1000 + i, false);
            i++;
        }
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Each dtype at each token count, both paths. */
START_TEST(test_dtypes_and_tokens)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{128, 8}, {257, 6}};
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int dt = 0; dt < 3; dt++)
            for (size_t t = 0; t < COUNT(grid_tokens); t++) {
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(grid_tokens[t], shapes[s][0], shapes[s][1]);
                d.gating_dtype = (moecl_dtype)dt;
                random_case(ctx, &d, false, 2000 + s * 100 + dt * 10 + t, true);
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* The ten seed shapes at top_k 8: the seed reference's op. */
START_TEST(test_seed_shapes)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{1, 128},    {129, 128},  {256, 128},  {520, 128},  {1019, 128},
                                         {2044, 128}, {4083, 128}, {8192, 128}, {8037, 256}, {13526, 256}};
    for (size_t s = 0; s < COUNT(shapes); s++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(shapes[s][0], shapes[s][1], 8);
        random_case(ctx, &d, false, 3000 + s, false);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Rows that start off a vector boundary: expert counts that are not a
 * multiple of 8, in every dtype, with a second block that is partial. On
 * pocl, f16 rows of 17-31 experts (except 24) faulted in the CPU kernel's
 * block loads (the fuzzer's crash, tests/fuzz/corpus/
 * topk-f16-e17-k7-cpu-unaligned-rows). Both scorings: softmax takes the CPU
 * fast path, sigmoid the generic loop. */
START_TEST(test_unaligned_rows)
{
    moecl_context *ctx = harness_context();
    static const uint32_t experts[] = {17, 20, 23, 31, 47};
    unsigned i = 0;
    for (size_t e = 0; e < COUNT(experts); e++)
        for (int dt = 0; dt < 3; dt++)
            for (int scoring = 0; scoring < 2; scoring++) {
                if (dt != MOECL_F16 && experts[e] != 17)
                    continue; /* f16 is the dtype that faulted; f32 and bf16 once each */
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(2 + i % 5, experts[e], 7);
                d.gating_dtype = (moecl_dtype)dt;
                d.scoring = (moecl_scoring)scoring;
                random_case(ctx, &d, false, 4500 + i, true);
                i++;
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* Scoring, bias, renormalize and scaling factor without groups. */
START_TEST(test_options)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{128, 8}, {60, 6}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int scoring = 0; scoring < 2; scoring++)
            for (int bias = 0; bias < 2; bias++)
                for (int renorm = 0; renorm < 2; renorm++) {
                    if (harness_quick_skips((unsigned)(s + scoring + bias + renorm)))
                        continue;
                    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(129 + i, shapes[s][0], shapes[s][1]);
                    d.scoring = (moecl_scoring)scoring;
                    d.renormalize = renorm;
                    d.routed_scaling_factor = (i % 3 == 0) ? 1.0f : (i % 3 == 1) ? 2.5f : -0.75f;
                    d.gating_dtype = (moecl_dtype)(i % 3);
                    random_case(ctx, &d, bias, 4000 + i, true);
                    i++;
                }
    moecl_context_destroy(ctx);
}
END_TEST

/* Case i of a group configuration {experts, groups, topk_group, top_k}:
 * token count, renormalisation and factor rotate with i. */
static moecl_topk_gating_desc group_case(const uint32_t config[4], unsigned i, int group_score, int scoring)
{
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(grid_tokens[1 + i % 6], config[0], config[3]);
    d.num_expert_groups = config[1];
    d.topk_group = config[2];
    d.group_score = (moecl_group_score)group_score;
    d.scoring = (moecl_scoring)scoring;
    d.renormalize = i % 2;
    d.routed_scaling_factor = i % 4 == 1 ? 2.5f : 1.0f;
    return d;
}

/* Group-limited selection: the issue's group configurations with both group
 * scores, softmax and sigmoid, with and without bias. */
START_TEST(test_groups)
{
    moecl_context *ctx = harness_context();
    static const uint32_t configs[][4] = {
        /* experts, groups, topk_group, top_k */
        {256, 8, 4, 8}, {128, 4, 2, 6}, {256, 16, 16, 8}, {256, 32, 4, 8}, {64, 8, 1, 8}, {60, 4, 3, 16},
    };
    unsigned i = 0;
    for (size_t c = 0; c < COUNT(configs); c++)
        for (int gs = 0; gs < 2; gs++)
            for (int scoring = 0; scoring < 2; scoring++)
                for (int bias = 0; bias < 2; bias++) {
                    if (harness_quick_skips((unsigned)(c + gs + scoring + bias)))
                        continue;
                    moecl_topk_gating_desc d = group_case(configs[c], i, gs, scoring);
                    random_case(ctx, &d, bias, 5000 + i, false);
                    i++;
                }
    moecl_context_destroy(ctx);
}
END_TEST

/* vLLM's DeepSeek-V3 routing: sigmoid, bias, 8 groups, top 4 groups,
 * top_k 8, renormalize, factor 2.5, at 256 experts. */
START_TEST(test_deepseek_v3)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {1, 4083, 13526};
    for (size_t t = 0; t < COUNT(tokens); t++)
        for (int dt = 0; dt < 3; dt++) {
            moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens[t], 256, 8);
            d.scoring = MOECL_SCORING_SIGMOID;
            d.num_expert_groups = 8;
            d.topk_group = 4;
            d.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
            d.renormalize = true;
            d.routed_scaling_factor = 2.5f;
            d.gating_dtype = (moecl_dtype)dt;
            random_case(ctx, &d, true, 6000 + t * 10 + dt, t == 1);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Every scoring with every weighting, with and without bias and groups,
 * on fresh random rows. */
START_TEST(test_scorings_weightings)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][4] = {{128, 8, 0, 0}, {60, 6, 0, 0}, {256, 8, 8, 4}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int scoring = 0; scoring < 4; scoring++)
            for (int weighting = 0; weighting < 3; weighting++) {
                /* Quick: every scoring with every weighting still, at one
                 * shape or two (the parity alternates with the shape). */
                if (harness_quick_skips((unsigned)(s + scoring + weighting)))
                    continue;
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(17 + i * 7, shapes[s][0], shapes[s][1]);
                d.scoring = (moecl_scoring)scoring;
                d.weighting = (moecl_weighting)weighting;
                d.num_expert_groups = shapes[s][2];
                d.topk_group = shapes[s][3];
                d.group_score = (moecl_group_score)(i % 2);
                d.renormalize = i % 2;
                d.routed_scaling_factor = (i % 3 == 0) ? 1.0f : (i % 3 == 1) ? 2.5f : -0.75f;
                d.gating_dtype = (moecl_dtype)(i % 3);
                random_case(ctx, &d, i % 4 < 2, 9000 + i, i % 5 == 0);
                i++;
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- The peers' conventions (docs/routing.md, section 5) ---- */

/* One row through both paths; ids exactly, weights within tol of want
 * (NaN where want is NaN, and exactly 0 where want is 0). */
static void expect_row(moecl_context *ctx, const moecl_topk_gating_desc *d0, const float *logits, const float *bias,
                       const int32_t *want_ids, const double *want_w, const char *label)
{
    moecl_topk_gating_desc d = *d0;
    d.num_tokens = 1;
    float w[64 + 1];
    int32_t ids[64 + 1];
    for (int path = 0; path < 2; path++) {
        run(ctx, &d, logits, bias, path == 1, w, ids);
        check(&d, logits, bias, w, ids);
        for (uint32_t j = 0; j < d.top_k; j++) {
            ck_assert_msg(ids[j] == want_ids[j], "%s (%s path): position %u id %d, want %d", label,
                          path ? "device" : "host", j, ids[j], want_ids[j]);
            const double got = w[j], want = want_w[j];
            const bool ok = isnan(want) ? isnan(got) : want == 0.0 ? got == 0.0 : fabs(got - want) <= 1e-6;
            ck_assert_msg(ok, "%s (%s path): position %u weight %.9g, want %.9g", label, path ? "device" : "host", j,
                          got, want);
        }
    }
}

/* Zero fill, fixed rows. SGLang's grouped_topk (DeepSeek-V2) example,
 * logits [0, -200, 0, -200, -1, -1, -1, -1], 4 groups keeping 2, top 4:
 * experts 1 and 3 underflow to a score of exactly 0, experts 4-7 are
 * filled with 0, and the six zeros tie. SGLang returned [2, 0, 4, 6]
 * (torch.topk's order among ties); the tie rule (lower index) gives
 * [0, 2, 1, 3] with either fill. The mirrored row, where the zeros of the
 * dropped groups have the lower indices, tells the fills apart. With a
 * bias, kept experts selecting below 0 lose to the dropped ones (vLLM's
 * pull request 13474 moved from this 0 fill to -inf for it), which then
 * weigh their unbiased scores. */
/* TensorRT-LLM's Llama 4 routing: top-k on the logits, then the sigmoid
 * of the chosen. Logits [20, 30, 17, 0, 1, 2, 25, -1], top 2: ids [1, 6]
 * (sigmoid-then-select would saturate 20, 30 and 25 to 1.0f, tie and
 * give [0, 1]). */
START_TEST(test_llama4)
{
    moecl_context *ctx = harness_context();
    static const float logits[8] = {20, 30, 17, 0, 1, 2, 25, -1};
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 8, 2);
    d.scoring = MOECL_SCORING_RAW;
    d.weighting = MOECL_WEIGHTS_SIGMOID_CHOSEN;
    static const int32_t want_ids[2] = {1, 6};
    const double want_w[2] = {1.0 / (1.0 + exp(-30.0)), 1.0 / (1.0 + exp(-25.0))};
    expect_row(ctx, &d, logits, NULL, want_ids, want_w, "Llama 4");
    /* Mixtral/Qwen on the same row: top-k on the logits, softmax over the
     * chosen: 1 / (1 + e^-5) and e^-5 / (1 + e^-5). */
    d.weighting = MOECL_WEIGHTS_SOFTMAX_CHOSEN;
    const double want_s[2] = {1.0 / (1.0 + exp(-5.0)), exp(-5.0) / (1.0 + exp(-5.0))};
    expect_row(ctx, &d, logits, NULL, want_ids, want_s, "top-k then softmax");
    /* sqrtsoftplus selects as the logits do (monotone): 30 and 25 are past
     * the threshold, so the weights are sqrt(30) and sqrt(25). */
    d.scoring = MOECL_SCORING_SQRTSOFTPLUS;
    d.weighting = MOECL_WEIGHTS_SCORE;
    const double want_q[2] = {sqrt(30.0), 5.0};
    expect_row(ctx, &d, logits, NULL, want_ids, want_q, "sqrtsoftplus");
    moecl_context_destroy(ctx);
}
END_TEST

START_TEST(test_group_fill_examples)
{
    moecl_context *ctx = harness_context();
    const double a = 1.0 / (2.0 + 4.0 * exp(-1.0)); /* exp(0) over the row's sum */
    const float sglang[8] = {0, -200, 0, -200, -1, -1, -1, -1}, mirrored[8] = {-1, -1, -1, -1, 0, -200, 0, -200};
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 8, 4);
    d.num_expert_groups = 4;
    d.topk_group = 2;
    for (int fill = 0; fill < 2; fill++) {
        d.group_fill = (moecl_group_fill)fill;
        d.renormalize = false;
        expect_row(ctx, &d, sglang, NULL, (const int32_t[]){0, 2, 1, 3}, (const double[]){a, a, 0, 0},
                   fill ? "SGLang's row, zero fill" : "SGLang's row, -inf fill");
        expect_row(ctx, &d, mirrored, NULL, fill ? (const int32_t[]){4, 6, 0, 1} : (const int32_t[]){4, 6, 5, 7},
                   (const double[]){a, a, 0, 0}, fill ? "mirrored row, zero fill" : "mirrored row, -inf fill");
        d.renormalize = true;
        expect_row(ctx, &d, mirrored, NULL, fill ? (const int32_t[]){4, 6, 0, 1} : (const int32_t[]){4, 6, 5, 7},
                   (const double[]){0.5, 0.5, 0, 0}, fill ? "mirrored row, zero fill, renormalised"
                                                          : "mirrored row, -inf fill, renormalised");
    }
    /* Sigmoid of 0 is 0.5 everywhere; the bias puts the kept groups at
     * -0.5 and the dropped ones at -1.5, below the fill. */
    const float zeros[8] = {0}, bias[8] = {-1, -1, -1, -1, -2, -2, -2, -2};
    d.scoring = MOECL_SCORING_SIGMOID;
    d.renormalize = true;
    for (int fill = 0; fill < 2; fill++) {
        d.group_fill = (moecl_group_fill)fill;
        expect_row(ctx, &d, zeros, bias, fill ? (const int32_t[]){4, 5, 6, 7} : (const int32_t[]){0, 1, 2, 3},
                   (const double[]){0.25, 0.25, 0.25, 0.25}, fill ? "negative bias, zero fill" : "negative bias, -inf fill");
    }
    /* Groups of one expert are not dropped as a no-op under the zero fill:
     * top 2 of 4 groups kept out of 8 experts, the kept ones selecting
     * below 0 through the bias, so experts 4 and 5 (filled) win. */
    const float one_bias[8] = {-1, -1, -1, -1, -3, -3, -3, -3};
    d = moecl_topk_gating_desc_init(1, 8, 2);
    d.scoring = MOECL_SCORING_SIGMOID;
    d.num_expert_groups = 8;
    d.topk_group = 4;
    for (int fill = 0; fill < 2; fill++) {
        d.group_fill = (moecl_group_fill)fill;
        expect_row(ctx, &d, zeros, one_bias, fill ? (const int32_t[]){4, 5} : (const int32_t[]){0, 1},
                   (const double[]){0.5, 0.5}, fill ? "groups of one, zero fill" : "groups of one, -inf fill");
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* The seed reference's forward (002_*: softmax, group max, the top
 * topk_group groups, masked_fill(~mask, 0.0), top-k), ported literally in
 * fp32 as torch runs it, with the tie rule for torch.topk's unspecified
 * order of ties. One row; ids and weights out. */
static void seed_forward(const float *x, uint32_t E, uint32_t G, uint32_t kg, uint32_t k, int32_t *ids, float *w)
{
    float m = -INFINITY, sum = 0.0f, score[64], gmax[64];
    for (uint32_t e = 0; e < E; e++)
        m = fmaxf(m, x[e]);
    for (uint32_t e = 0; e < E; e++)
        sum += expf(x[e] - m);
    for (uint32_t e = 0; e < E; e++)
        score[e] = expf(x[e] - m) / sum;
    const uint32_t gs = E / G;
    bool kept[64] = {false}, taken[64] = {false};
    for (uint32_t g = 0; g < G; g++) {
        gmax[g] = -INFINITY;
        for (uint32_t i = 0; i < gs; i++)
            gmax[g] = fmaxf(gmax[g], score[g * gs + i]);
    }
    for (uint32_t r = 0; r < kg; r++) {
        int best = -1;
        for (uint32_t g = 0; g < G; g++)
            if (!kept[g] && (best < 0 || gmax[g] > gmax[best]))
                best = (int)g;
        kept[best] = true;
    }
    for (uint32_t e = 0; e < E; e++)
        if (!kept[e / gs])
            score[e] = 0.0f;
    for (uint32_t j = 0; j < k; j++) {
        int best = -1;
        for (uint32_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || score[e] > score[best]))
                best = (int)e;
        taken[best] = true;
        ids[j] = best;
        w[j] = score[best];
    }
}

/* moecl reproduces the seed reference at every input with the zero fill:
 * rows drawn from {0, -1, -2, -200, -300} with a 0 in each, so that
 * scores tie exactly
 * (equal logits) or underflow to 0 (the dropped groups' fill then meets
 * kept zeros) and never nearly tie; the ids must equal the seed's
 * exactly, the weights to 1e-6, through both paths. */
START_TEST(test_seed_zero_fill)
{
    moecl_context *ctx = harness_context();
    static const uint32_t configs[][4] = {{16, 4, 2, 8}, {16, 8, 3, 6}, {64, 8, 4, 8}, {32, 4, 1, 8}};
    static const float values[] = {0.0f, -1.0f, -2.0f, -200.0f, -300.0f};
    for (size_t c = 0; c < COUNT(configs); c++) {
        const uint32_t E = configs[c][0], T = 200, k = configs[c][3];
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(T, E, k);
        d.num_expert_groups = configs[c][1];
        d.topk_group = configs[c][2];
        d.group_fill = MOECL_GROUP_FILL_ZERO;
        harness_rng rng = harness_rng_for(14000 + c);
        float *x = malloc((size_t)T * E * sizeof(float));
        float *w = malloc((T * k + 1) * sizeof(float)), *want_w = malloc(T * k * sizeof(float));
        int32_t *ids = malloc((T * k + 1) * sizeof(int32_t)), *want_ids = malloc(T * k * sizeof(int32_t));
        ck_assert(x && w && want_w && ids && want_ids);
        for (size_t i = 0; i < (size_t)T * E; i++)
            /* Mostly the underflowing values, so the kept groups often
             * hold fewer than k nonzero scores. */
            x[i] = values[harness_rand_u32(&rng) % 8 < 3 ? harness_rand_u32(&rng) % 3 : 3 + harness_rand_u32(&rng) % 2];
        /* A 0 in every row: the maximum is 0, so -200 and -300 give
         * exactly 0 in fp32 (not a subnormal a device may flush). */
        for (uint32_t t = 0; t < T; t++)
            x[(size_t)t * E + harness_rand_u32(&rng) % E] = 0.0f;
        for (uint32_t t = 0; t < T; t++)
            seed_forward(x + (size_t)t * E, E, d.num_expert_groups, d.topk_group, k, want_ids + t * k, want_w + t * k);
        for (int path = 0; path < 2; path++) {
            run(ctx, &d, x, NULL, path == 1, w, ids);
            check(&d, x, NULL, w, ids);
            for (uint32_t i = 0; i < T * k; i++) {
                ck_assert_msg(ids[i] == want_ids[i], "E=%u groups %u/%u k=%u, %s path: row %u pos %u id %d, seed %d",
                              E, d.num_expert_groups, d.topk_group, k, path ? "device" : "host", i / k, i % k, ids[i],
                              want_ids[i]);
                ck_assert_msg(fabsf(w[i] - want_w[i]) <= 1e-6f, "E=%u, %s path: row %u pos %u weight %.9g, seed %.9g",
                              E, path ? "device" : "host", i / k, i % k, w[i], want_w[i]);
            }
        }
        free(x);
        free(w);
        free(want_w);
        free(ids);
        free(want_ids);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Renormalisation floor, fixed rows: llama.cpp's 2^-14 (6.103515625e-5)
 * with a sum below it (sigmoid of -12 and -13: each weight is its score
 * over the floor), a sum above it (the plain division), a sum of exactly 0
 * (weights 0 with or without a floor, where vLLM and SGLang give NaN), and
 * a NaN sum (the weights are left as they are). */
START_TEST(test_renormalize_floor_examples)
{
    moecl_context *ctx = harness_context();
    const double floor = 6.103515625e-5;
    const double s12 = 1.0 / (1.0 + exp(12.0)), s13 = 1.0 / (1.0 + exp(13.0));
    const float tiny[4] = {-12, -13, -14, -15}, plain[4] = {0, -1, -2, -3}, zero[4] = {-100, -100, -100, -100};
    const float nan_row[2] = {NAN, 0};
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 4, 2);
    d.scoring = MOECL_SCORING_SIGMOID;
    d.renormalize = true;
    for (int with_floor = 0; with_floor < 2; with_floor++) {
        d.renormalize_floor = with_floor ? (float)floor : 0.0f;
        const char *f = with_floor ? "floor 2^-14" : "floor 0";
        char label[96];
        snprintf(label, sizeof label, "sum below the floor, %s", f);
        expect_row(ctx, &d, tiny, NULL, (const int32_t[]){0, 1},
                   with_floor ? (const double[]){s12 / floor, s13 / floor}
                              : (const double[]){s12 / (s12 + s13), s13 / (s12 + s13)},
                   label);
        const double p0 = 0.5, p1 = 1.0 / (1.0 + exp(1.0));
        snprintf(label, sizeof label, "sum above the floor, %s", f);
        expect_row(ctx, &d, plain, NULL, (const int32_t[]){0, 1}, (const double[]){p0 / (p0 + p1), p1 / (p0 + p1)},
                   label);
        snprintf(label, sizeof label, "sum 0, %s", f);
        expect_row(ctx, &d, zero, NULL, (const int32_t[]){0, 1}, (const double[]){0, 0}, label);
        moecl_topk_gating_desc dn = d;
        dn.num_experts = 2;
        snprintf(label, sizeof label, "NaN sum, %s", f);
        expect_row(ctx, &dn, nan_row, NULL, (const int32_t[]){1, 0}, (const double[]){0.5, NAN}, label);
    }
    /* The floor is ignored without renormalize. */
    d.renormalize = false;
    d.renormalize_floor = (float)floor;
    expect_row(ctx, &d, tiny, NULL, (const int32_t[]){0, 1}, (const double[]){s12, s13}, "floor without renormalize");
    moecl_context_destroy(ctx);
}
END_TEST

/* Zero fill on random rows: the group configurations of test_groups with
 * a bias large enough (0.5 N(0, 1) beside sigmoid scores) that kept
 * experts often select below 0, softmax rows spread wide enough that kept
 * scores underflow, groups of one expert, and every launch shape. */
START_TEST(test_group_fill_random)
{
    moecl_context *ctx = harness_context();
    static const uint32_t configs[][4] = {
        /* experts, groups, topk_group, top_k */
        {256, 8, 4, 8}, {128, 4, 2, 6}, {64, 8, 1, 8}, {60, 4, 3, 16}, {64, 64, 8, 8}, {16, 16, 3, 2},
    };
    unsigned i = 0;
    for (size_t c = 0; c < COUNT(configs); c++)
        for (int gs = 0; gs < 2; gs++)
            for (int scoring = 0; scoring < 2; scoring++)
                for (int bias = 0; bias < 2; bias++) {
                    if (harness_quick_skips((unsigned)(c + gs + scoring + bias)))
                        continue;
                    moecl_topk_gating_desc d = group_case(configs[c], i, gs, scoring);
                    d.group_fill = MOECL_GROUP_FILL_ZERO;
                    d.gating_dtype = (moecl_dtype)(i % 3);
                    /* Softmax without a bias: logits spread by 40, so most
                     * scores of a row are 0 and the fill competes. */
                    const float scale = scoring == MOECL_SCORING_SOFTMAX && !bias ? 40.0f : 2.0f;
                    random_case_scaled(ctx, &d, 0.0f, scale, bias ? 0.5f : 0.0f, 12000 + i, i % 3 == 0);
                    i++;
                }
    moecl_context_destroy(ctx);
}
END_TEST

/* Renormalised random rows with each value of a floor (eps false) or an
 * epsilon (eps true): sigmoid logits around -14, so the chosen sums fall
 * near 2^-14 and 1e-6, both sides; softmax, a bias, DeepSeek-V3's groups
 * with both fills, every dtype. */
static void renormalize_random(const float *values, size_t n, bool eps, unsigned seed)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{128, 8}, {60, 2}, {256, 8}};
    unsigned i = 0;
    for (size_t f = 0; f < n; f++)
        for (size_t s = 0; s < COUNT(shapes); s++)
            for (int scoring = 0; scoring < 2; scoring++, i++) {
                if (harness_quick_skips((unsigned)(f + s + (size_t)scoring)))
                    continue;
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(129 + i, shapes[s][0], shapes[s][1]);
                d.scoring = (moecl_scoring)scoring;
                d.renormalize = true;
                *(eps ? &d.renormalize_eps : &d.renormalize_floor) = values[f];
                d.routed_scaling_factor = i % 3 == 1 ? 2.5f : 1.0f;
                d.gating_dtype = (moecl_dtype)(i % 3);
                if (shapes[s][0] == 256) {
                    d.num_expert_groups = 8;
                    d.topk_group = 4;
                    d.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
                    d.group_fill = (moecl_group_fill)(i % 2);
                }
                const bool sig = scoring == MOECL_SCORING_SIGMOID;
                random_case_scaled(ctx, &d, sig ? -14.0f : 0.0f, 2.0f, i % 2 ? 0.05f : 0.0f, seed + i, i % 2 == 0);
            }
    moecl_context_destroy(ctx);
}

/* llama.cpp's floor 2^-14 and others (FLT_MIN, 0.5, 1). */
START_TEST(test_renormalize_floor_random)
{
    static const float floors[] = {6.103515625e-5f, 0x1p-126f, 0.5f, 1.0f};
    renormalize_random(floors, COUNT(floors), false, 13000);
}
END_TEST

/* The models' epsilon, fixed rows: LFM2's 1e-6 beside a chosen sum of
 * about 8e-6 (sigmoid of -12 and -13), where S + eps and S give weights
 * 12 % apart; DeepSeek-V3's 1e-20 beside a plain sum; a sum of exactly 0
 * (sigmoid of -200 is 0 in fp32), whose weights are 0 / eps = 0; a NaN
 * sum, which makes every weight NaN as `w / (sum + eps)` does; and the
 * epsilon ignored without renormalize. */
START_TEST(test_renormalize_eps_examples)
{
    moecl_context *ctx = harness_context();
    const double s12 = 1.0 / (1.0 + exp(12.0)), s13 = 1.0 / (1.0 + exp(13.0));
    const double p0 = 0.5, p1 = 1.0 / (1.0 + exp(1.0));
    const float tiny[4] = {-12, -13, -14, -15}, plain[4] = {0, -1, -2, -3}, zero[4] = {-200, -200, -200, -200};
    const float nan_row[2] = {NAN, 0};
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 4, 2);
    d.scoring = MOECL_SCORING_SIGMOID;
    d.renormalize = true;
    d.renormalize_eps = 1e-6f;
    const double e6 = (double)1e-6f;
    const double se = s12 + s13 + e6;
    expect_row(ctx, &d, tiny, NULL, (const int32_t[]){0, 1}, (const double[]){s12 / se, s13 / se},
               "sum 8e-6, eps 1e-6");
    d.renormalize_eps = 1e-20f;
    expect_row(ctx, &d, plain, NULL, (const int32_t[]){0, 1}, (const double[]){p0 / (p0 + p1), p1 / (p0 + p1)},
               "plain sum, eps 1e-20");
    expect_row(ctx, &d, zero, NULL, (const int32_t[]){0, 1}, (const double[]){0, 0}, "sum 0, eps 1e-20");
    moecl_topk_gating_desc dn = d;
    dn.num_experts = 2;
    expect_row(ctx, &dn, nan_row, NULL, (const int32_t[]){1, 0}, (const double[]){NAN, NAN}, "NaN sum, eps 1e-20");
    d.renormalize = false;
    d.renormalize_eps = 1e-6f;
    expect_row(ctx, &d, tiny, NULL, (const int32_t[]){0, 1}, (const double[]){s12, s13}, "eps without renormalize");
    moecl_context_destroy(ctx);
}
END_TEST

/* LFM2's epsilon 1e-6 and DeepSeek-V3's 1e-20. */
START_TEST(test_renormalize_eps_random)
{
    static const float epss[] = {1e-6f, 1e-20f};
    renormalize_random(epss, COUNT(epss), true, 13500);
}
END_TEST

/* The shapes of the _ex tests: softmax (the CPU fast path), sigmoid with
 * DeepSeek-V3's groups, a bias, eps and factor, and a small one; the
 * gating dtype by the shape. */
#define EX_SHAPES 3
static moecl_topk_gating_desc ex_desc(size_t s, uint32_t tokens)
{
    static const uint32_t shapes[EX_SHAPES][2] = {{128, 8}, {256, 8}, {60, 2}};
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens, shapes[s][0], shapes[s][1]);
    d.gating_dtype = (moecl_dtype)(s % 3);
    if (shapes[s][0] == 256) {
        d.scoring = MOECL_SCORING_SIGMOID;
        d.num_expert_groups = 8;
        d.topk_group = 4;
        d.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
        d.renormalize = true;
        d.renormalize_eps = 1e-20f;
        d.routed_scaling_factor = 2.5f;
    }
    return d;
}

/* Random inputs of an _ex test (a bias with groups), and the plain call's
 * f32 weights and int32 ids on them, checked against the reference. */
typedef struct ex_inputs {
    void *gating;
    float *bias;
    float *plain_w;
    int32_t *plain_ids;
} ex_inputs;

static ex_inputs ex_inputs_of(moecl_context *ctx, const moecl_topk_gating_desc *d, harness_rng *rng)
{
    const size_t e = d->num_experts, nk = (size_t)d->num_tokens * d->top_k;
    ex_inputs in = {harness_random_tensor(rng, d->gating_dtype, (size_t)d->num_tokens * e, 2.0f),
                    d->num_expert_groups ? harness_random_tensor(rng, MOECL_F32, e, 0.1f) : NULL,
                    malloc(nk * 4 + 4), malloc(nk * 4 + 4)};
    ck_assert(in.gating && in.plain_w && in.plain_ids);
    run(ctx, d, in.gating, in.bias, true, in.plain_w, in.plain_ids);
    check(d, in.gating, in.bias, in.plain_w, in.plain_ids);
    return in;
}

static void ex_inputs_free(ex_inputs *in)
{
    free(in->gating);
    free(in->bias);
    free(in->plain_w);
    free(in->plain_ids);
}

/* The calling thread's error detail names what. */
static void assert_error_names(moecl_context *ctx, const char *what, const char *label)
{
    ck_assert_msg(strstr(moecl_context_error(ctx), what) != NULL, "%s: the error \"%s\" does not name %s", label,
                  moecl_context_error(ctx), what);
}

/* A device record for 4 tokens of 16 experts, k 2: the logits and f32
 * and int32 outputs, the other tensors absent. */
static moecl_topk_gating_tensors small_record(moecl_context *ctx, const float logits[4 * 16])
{
    moecl_topk_gating_tensors t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    t.gating = harness_buffer(ctx, 4 * 16 * 4, 0, logits);
    t.topk_weights = harness_buffer(ctx, 4 * 2 * 4, 0, NULL);
    t.topk_ids = harness_buffer(ctx, 4 * 2 * 4, 0, NULL);
    return t;
}

/* moecl_topk_gating_ex's own checks: the record, the new tensors' sizes;
 * nothing written on failure. */
START_TEST(test_ex_invalid)
{
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(4, 16, 2);
    float logits[4 * 16] = {0};
    moecl_topk_gating_tensors t = small_record(ctx, logits);
    const int32_t load0[16] = {7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7};
    t.expert_load = harness_buffer(ctx, sizeof(load0), 0, load0);
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, NULL, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "tensors", "NULL tensors");
    moecl_topk_gating_tensors bad = t;
    bad.struct_size = sizeof(t) - 1;
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "struct_size", "short record");
    bad.struct_size = sizeof(t) + 8;
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    bad = t;
    bad.num_valid_tokens = harness_buffer(ctx, 4, 2, NULL); /* misaligned */
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "num_valid_tokens", "misaligned num_valid_tokens");
    harness_release(bad.num_valid_tokens);
    bad = t;
    cl_int err;
    bad.expert_load = (moecl_buffer){clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 15 * 4, NULL, &err),
                                     0}; /* one int short */
    ck_assert_ptr_nonnull(bad.expert_load.mem);
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "expert_load", "short expert_load");
    harness_release(bad.expert_load);
    int32_t load[16];
    harness_read(ctx, t.expert_load, sizeof(load), load);
    ck_assert_int_eq(memcmp(load, load0, sizeof(load)), 0);
    const moecl_topk_gating_host_tensors h = {sizeof(h) - 4, logits, NULL, NULL, NULL, NULL,
                                              NULL,          NULL,   NULL, MOECL_I32, NULL};
    ck_assert_int_eq(moecl_topk_gating_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "struct_size", "short host record");
    moecl_buffer *all[] = {&t.gating, &t.topk_weights, &t.topk_ids, &t.expert_load};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(*all[i]);
    moecl_context_destroy(ctx);
}
END_TEST

/* Rows of exact ties, NaN, infinities and huge values. Where the inputs tie
 * exactly the ids must equal the reference's exactly (lower index first);
 * elsewhere the checker's rules apply. */
enum { ROW_KINDS = 14 };

static bool fill_special_row(harness_rng *rng, int kind, float *row, uint32_t e_count)
{
    bool exact = true;
    for (uint32_t e = 0; e < e_count; e++)
        row[e] = harness_randn(rng);
    switch (kind) {
    case 0: /* all equal */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = 0.5f;
        break;
    case 1: /* all zero */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = 0.0f;
        break;
    case 2: /* exact duplicates from a small set */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = (float)((int)(harness_rand_u32(rng) % 4) - 1);
        break;
    case 3: /* one NaN */
        row[harness_rand_u32(rng) % e_count] = NAN;
        exact = false;
        break;
    case 4: /* all NaN */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = NAN;
        break;
    case 5: /* one +inf */
        row[harness_rand_u32(rng) % e_count] = INFINITY;
        exact = false;
        break;
    case 6: /* some -inf */
        for (uint32_t e = 0; e < e_count; e += 3)
            row[e] = -INFINITY;
        exact = false;
        break;
    case 7: /* all -inf */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = -INFINITY;
        break;
    case 8: /* +-1e30 only */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = (harness_rand_u32(rng) & 1) ? 1e30f : -1e30f;
        break;
    case 9: /* two maxima at 1e30 among ordinary values */
        row[e_count / 3] = 1e30f;
        row[e_count - 1] = 1e30f;
        exact = false;
        break;
    case 10: /* NaN and +inf and -inf together */
        row[0] = NAN;
        row[e_count / 2] = INFINITY;
        row[e_count - 1] = -INFINITY;
        exact = false;
        break;
    case 11: /* scores that underflow to exactly 0 (ZERO32 in tests/reference.c),
              * logits rising with the index: they tie and go by index, not
              * by logit (the peers' underflow case: [0, -300, -200, -250]) */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = -130.0f - (float)(e_count - e);
        row[e_count / 2] = 0.0f;
        break;
    case 12: /* the peers' row, repeated: [0, -300, -200, -250, ...] */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = (const float[]){0.0f, -300.0f, -200.0f, -250.0f}[e % 4];
        break;
    default: /* -0 and +0 tie */
        for (uint32_t e = 0; e < e_count; e++)
            row[e] = (e & 1) ? -0.0f : 0.0f;
        break;
    }
    return exact;
}

/* grouped: 0 none, 1 groups with the -inf fill, 2 with the zero fill (and
 * renormalised with llama.cpp's floor), 3 with the -inf fill renormalised
 * by sum + 1e-20 (DeepSeek-V3's epsilon). */
START_TEST(test_special_rows)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{7, 6}, {64, 8}, {257, 16}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int scoring = 0; scoring < 4; scoring++)
            for (int grouped = 0; grouped < 4; grouped++) {
                const uint32_t e_count = shapes[s][0];
                if (grouped && e_count % 8 != 0)
                    continue;
                /* The eps cases count apart, so the others keep their inputs. */
                harness_rng rng = harness_rng_for((grouped == 3 ? 7500 : 7000) + i);
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(ROW_KINDS * 3, e_count, shapes[s][1]);
                d.scoring = (moecl_scoring)scoring;
                d.weighting = (moecl_weighting)(i % 3);
                if (grouped) {
                    d.num_expert_groups = 8;
                    d.topk_group = 4;
                    d.group_score = (moecl_group_score)(i % 2);
                }
                if (grouped == 2) {
                    d.group_fill = MOECL_GROUP_FILL_ZERO;
                    d.renormalize = true;
                    d.renormalize_floor = 6.103515625e-5f;
                }
                if (grouped == 3) {
                    d.renormalize = true;
                    d.renormalize_eps = 1e-20f;
                }
                d.gating_dtype = (moecl_dtype)(i % 3);
                float *row = malloc(e_count * sizeof(float));
                void *gating = malloc((size_t)d.num_tokens * e_count * 4);
                bool exact[ROW_KINDS * 3];
                for (uint32_t t = 0; t < d.num_tokens; t++) {
                    exact[t] = fill_special_row(&rng, (int)(t % ROW_KINDS), row, e_count);
                    for (uint32_t e = 0; e < e_count; e++)
                        harness_store(d.gating_dtype, gating, (size_t)t * e_count + e, row[e]);
                }
                const size_t nk = (size_t)d.num_tokens * d.top_k;
                float *w = malloc(nk * 4 + 4), *ref_w = malloc(nk * 4);
                int32_t *ids = malloc(nk * 4 + 4), *ref_ids = malloc(nk * 4);
                ref_topk_gating(&d, gating, NULL, ref_w, ref_ids);
                for (int path = 0; path < 2; path++) {
                    run(ctx, &d, gating, NULL, path == 1, w, ids);
                    check(&d, gating, NULL, w, ids);
                    for (uint32_t t = 0; t < d.num_tokens; t++) {
                        if (!exact[t])
                            continue;
                        for (uint32_t j = 0; j < d.top_k; j++)
                            ck_assert_msg(ids[t * d.top_k + j] == ref_ids[t * d.top_k + j],
                                          "exact-tie row kind %u (E=%u k=%u scoring %d grouped %d): position %u "
                                          "id %d, reference %d",
                                          t % ROW_KINDS, e_count, d.top_k, scoring, grouped, j, ids[t * d.top_k + j],
                                          ref_ids[t * d.top_k + j]);
                    }
                }
                free(row);
                free(gating);
                free(w);
                free(ref_w);
                free(ids);
                free(ref_ids);
                i += grouped != 3;
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* Crowded top values, where the CPU path's floor for the k-th largest
 * lets through the most candidates: kind 0 uniform on [0, 10) (the bench's
 * --logits uniform10), kind 1 the same on a grid of quarters (exact ties at
 * every place, the k-th included; distinct values a quarter apart, so the
 * ids must equal the reference's exactly), kind 2 a third of the experts
 * within 2^-16 of 9 above a uniform [0, 8) rest (near-ties: the checker's
 * rules), kind 3 every expert of lanes 0..2 (expert % 16 < 3) in [9, 10)
 * above a uniform [0, 8) rest (the floor, from two values a lane, sits
 * below them: at 128 experts and more that is over 16 candidates, the
 * path's fallback loop), kind 4 four exact levels (a quarter of the row
 * tied at the top: more than k ties at the floor, of which the first k
 * are kept; ids exact as kind 1's). Softmax, so every shape here takes the
 * CPU fast path on CPUs: 16-lane blocks whole and partial, k up to 16. */
static float crowded_logit(harness_rng *rng, int kind, uint32_t expert)
{
    const double u = harness_rand_uniform(rng);
    if (kind == 0)
        return (float)(10.0 * u);
    if (kind == 1)
        return (float)(floor(40.0 * u) / 4.0);
    if (kind == 3)
        return expert % 16 < 3 ? 9.0f + (float)u : (float)(8.0 * u);
    if (kind == 4)
        return (float)floor(4.0 * u);
    return harness_rand_u32(rng) % 3 == 0 ? 9.0f + (float)ldexp(u, -16) : (float)(8.0 * u);
}

START_TEST(test_crowded_rows)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{128, 8}, {256, 8}, {64, 6}, {20, 7}, {16, 8}, {384, 16}, {160, 1}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int kind = 0; kind < 5; kind++, i++) {
            harness_rng rng = harness_rng_for(9000 + i);
            moecl_topk_gating_desc d = moecl_topk_gating_desc_init(301, shapes[s][0], shapes[s][1]);
            d.gating_dtype = (moecl_dtype)(i % 3);
            d.renormalize = i % 2 == 1;
            const size_t n = (size_t)d.num_tokens * d.num_experts, nk = (size_t)d.num_tokens * d.top_k;
            void *gating = malloc(n * 4);
            float *w = malloc(nk * 4 + 4), *ref_w = malloc(nk * 4);
            int32_t *ids = malloc(nk * 4 + 4), *ref_ids = malloc(nk * 4);
            ck_assert(gating && w && ref_w && ids && ref_ids);
            for (size_t x = 0; x < n; x++)
                harness_store(d.gating_dtype, gating, x, crowded_logit(&rng, kind, (uint32_t)(x % d.num_experts)));
            ref_topk_gating(&d, gating, NULL, ref_w, ref_ids);
            for (int path = 0; path < 2; path++) {
                run(ctx, &d, gating, NULL, path == 1, w, ids);
                check(&d, gating, NULL, w, ids);
                for (size_t j = 0; j < nk && (kind == 1 || kind == 4); j++)
                    ck_assert_msg(ids[j] == ref_ids[j], "crowded grid row %zu (E=%u k=%u dtype %d): position %zu id %d, "
                                  "reference %d", j / d.top_k, d.num_experts, d.top_k, (int)d.gating_dtype, j % d.top_k,
                                  ids[j], ref_ids[j]);
            }
            free(gating);
            free(w);
            free(ref_w);
            free(ids);
            free(ref_ids);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* _prepare builds the variant ahead; the call then runs it. Also a chain of
 * two calls ordered by events on the device path. */
/* Rows whose gating loops come near or past a loop-limited driver's
 * budget (MOECL_DP_LOOP_LIMIT: rusticl's 65535 iterations a work-item,
 * every loop counted) on ascending logits, the most insertions: 2048
 * experts at top 64 (softmax and sigmoid), 4096 at top 32 and 4096 at top
 * 8 in 64 groups of which 4 are kept, checked against the reference; 4096
 * at top 64 passes the bound, so a loop-limited device refuses it
 * (UNSUPPORTED, the outputs untouched) and any other routes it. Few rows,
 * so that they run on rusticl. */
START_TEST(test_loop_budget)
{
    static const struct {
        uint32_t experts, k, groups, topk_group;
        moecl_scoring scoring;
    } shapes[] = {{2048, 64, 0, 0, MOECL_SCORING_SOFTMAX},
                  {2048, 64, 0, 0, MOECL_SCORING_SIGMOID},
                  {4096, 32, 0, 0, MOECL_SCORING_SOFTMAX},
                  {4096, 8, 64, 4, MOECL_SCORING_SOFTMAX},
                  {4096, 64, 0, 0, MOECL_SCORING_SOFTMAX}};
    moecl_context *ctx = harness_context();
    const bool limited = ctx->params.value[MOECL_DP_LOOP_LIMIT] != 0;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(3, shapes[s].experts, shapes[s].k);
        d.scoring = shapes[s].scoring;
        d.num_expert_groups = shapes[s].groups;
        d.topk_group = shapes[s].topk_group;
        const size_t n = (size_t)d.num_tokens * d.num_experts, nk = (size_t)d.num_tokens * d.top_k;
        float *logits = malloc(n * sizeof(float));
        float *w = malloc(nk * sizeof(float) + 4);
        int32_t *ids = malloc(nk * sizeof(int32_t) + 4);
        ck_assert(logits && w && ids);
        for (size_t i = 0; i < n; i++)
            logits[i] = (float)(i % d.num_experts) / 1024.0f;
        if (limited && d.num_experts == 4096 && d.top_k == 64) {
            memset(ids, HARNESS_POISON, nk * sizeof(int32_t));
            const moecl_status st = moecl_topk_gating_host(ctx, &d, logits, NULL, w, ids);
            ck_assert_msg(st == MOECL_ERROR_UNSUPPORTED, "4096 experts, top 64: %s", moecl_status_string(st));
            ck_assert_msg(strstr(moecl_context_error(ctx), "loop limit") != NULL, "%s", moecl_context_error(ctx));
            for (size_t i = 0; i < nk; i++)
                ck_assert_int_eq(ids[i], -1);
        } else {
            run(ctx, &d, logits, NULL, true, w, ids);
            check(&d, logits, NULL, w, ids);
        }
        free(logits);
        free(w);
        free(ids);
    }
    moecl_context_destroy(ctx);
}
END_TEST

START_TEST(test_prepare_and_chain)
{
    moecl_context *ctx = harness_context();
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(0, 100, 6);
    d.scoring = MOECL_SCORING_SIGMOID;
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
    d.num_tokens = 333;
    random_case(ctx, &d, true, 8000, true);

    /* Two calls chained by events: the second waits on the first's event
     * and reads the same input. */
    harness_rng rng = harness_rng_for(8001);
    const size_t nk = (size_t)d.num_tokens * d.top_k;
    void *gating = harness_random_tensor(&rng, MOECL_F32, (size_t)d.num_tokens * d.num_experts, 1.0f);
    moecl_buffer in = harness_buffer(ctx, (size_t)d.num_tokens * d.num_experts * 4, 0, gating);
    moecl_buffer w1 = harness_buffer(ctx, nk * 4, 0, NULL), i1 = harness_buffer(ctx, nk * 4, 0, NULL);
    moecl_buffer w2 = harness_buffer(ctx, nk * 4, 64, NULL), i2 = harness_buffer(ctx, nk * 4, 64, NULL);
    cl_event first = NULL, second = NULL;
    moecl_buffer none = {NULL, 0};
    ck_assert_int_eq(moecl_topk_gating(ctx, &d, in, none, w1, i1, 0, NULL, &first), MOECL_SUCCESS);
    ck_assert_int_eq(moecl_topk_gating(ctx, &d, in, none, w2, i2, 1, &first, &second), MOECL_SUCCESS);
    ck_assert_int_eq(clWaitForEvents(1, &second), CL_SUCCESS);
    float *w = malloc(nk * 4);
    int32_t *ids = malloc(nk * 4);
    harness_read(ctx, w2, nk * 4, w);
    harness_read(ctx, i2, nk * 4, ids);
    check(&d, gating, NULL, w, ids);
    clReleaseEvent(first);
    clReleaseEvent(second);
    harness_release(in);
    harness_release(w1);
    harness_release(i1);
    harness_release(w2);
    harness_release(i2);
    free(gating);
    free(w);
    free(ids);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- moecl_topk_gating_with_counts ---- */

/* The histogram of the returned ids, compared exactly with the counts. */
static void check_counts(const moecl_topk_gating_desc *d, const int32_t *ids, const int32_t *counts, const char *what)
{
    int32_t *want = calloc(d->num_experts, sizeof(int32_t));
    ck_assert_ptr_nonnull(want);
    for (size_t i = 0; i < (size_t)d->num_tokens * d->top_k; i++) {
        ck_assert_msg(ids[i] >= 0 && (uint32_t)ids[i] < d->num_experts, "%s: id %d out of range", what, ids[i]);
        want[ids[i]]++;
    }
    for (uint32_t e = 0; e < d->num_experts; e++)
        ck_assert_msg(counts[e] == want[e], "%s: expert_counts[%u] is %d, the ids hold %d", what, e, counts[e],
                      want[e]);
    free(want);
}

/* As run(), through moecl_topk_gating_with_counts(_host); counts gets
 * num_experts entries (plus one, which must stay poison on the device
 * path). */
static void run_counts(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const float *bias,
                       bool device_path, float *w, int32_t *ids, int32_t *counts)
{
    const size_t nk = (size_t)d->num_tokens * d->top_k, ne = d->num_experts;
    const size_t in_bytes = (size_t)d->num_tokens * d->num_experts * ref_dtype_size(d->gating_dtype);
    memset(w, HARNESS_POISON, nk * sizeof(float) + 4);
    memset(ids, HARNESS_POISON, nk * sizeof(int32_t) + 4);
    memset(counts, HARNESS_POISON, ne * sizeof(int32_t) + 4);
    char what[256];
    describe(d, bias != NULL, what, sizeof(what));
    moecl_status st;
    if (!device_path) {
        st = moecl_topk_gating_with_counts_host(ctx, d, gating, bias, w, ids, counts);
        ck_assert_msg(st == MOECL_SUCCESS, "with_counts host path %s: %s: %s", what, moecl_status_string(st),
                      moecl_context_error(ctx));
        return;
    }
    moecl_buffer in = harness_buffer(ctx, in_bytes, 256, gating);
    moecl_buffer b = bias ? harness_buffer(ctx, ne * sizeof(float), 12, bias) : (moecl_buffer){NULL, 0};
    moecl_buffer wb = harness_buffer(ctx, nk * sizeof(float), 4096 + 8, NULL);
    moecl_buffer ib = harness_buffer(ctx, nk * sizeof(int32_t), 4, NULL);
    moecl_buffer cb = harness_buffer(ctx, ne * sizeof(int32_t), 20, NULL);
    cl_event done = NULL;
    st = moecl_topk_gating_with_counts(ctx, d, in, b, wb, ib, cb, 0, NULL, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "with_counts device path %s: %s: %s", what, moecl_status_string(st),
                  moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    harness_read(ctx, wb, nk * sizeof(float) + 4, w);
    harness_read(ctx, ib, nk * sizeof(int32_t) + 4, ids);
    harness_read(ctx, cb, ne * sizeof(int32_t) + 4, counts);
    uint32_t tail_w, tail_i, tail_c;
    memcpy(&tail_w, w + nk, 4);
    memcpy(&tail_i, ids + nk, 4);
    memcpy(&tail_c, counts + ne, 4);
    ck_assert_msg(tail_w == 0xFFFFFFFFu && tail_i == 0xFFFFFFFFu && tail_c == 0xFFFFFFFFu,
                  "with_counts %s: wrote past the end of an output", what);
    harness_release(in);
    harness_release(b);
    harness_release(wb);
    harness_release(ib);
    harness_release(cb);
}

/* Routing and counts from one launch: the softmax fast path (softmax, no
 * bias, no groups), sigmoid with bias, DeepSeek-V3-like groups; k 1 and 8;
 * 0, 1 and 1000 tokens; f32 and bf16; both paths. The ids and weights pass
 * the reference checker and the counts equal the ids' histogram exactly. */
START_TEST(test_with_counts)
{
    moecl_context *ctx = harness_context();
    typedef struct {
        uint32_t tokens, experts, k;
        moecl_scoring scoring;
        bool bias, grouped;
        moecl_dtype dtype;
    } counts_case;
    static const counts_case cases[] = {
        {1000, 128, 8, MOECL_SCORING_SOFTMAX, false, false, MOECL_F32},
        {1, 128, 8, MOECL_SCORING_SOFTMAX, false, false, MOECL_F32},
        {1000, 60, 1, MOECL_SCORING_SOFTMAX, false, false, MOECL_BF16},
        {1000, 64, 8, MOECL_SCORING_SIGMOID, true, false, MOECL_BF16},
        {1, 64, 1, MOECL_SCORING_SIGMOID, true, false, MOECL_F32},
        {1000, 256, 8, MOECL_SCORING_SIGMOID, true, true, MOECL_F32},
        {1, 256, 8, MOECL_SCORING_SIGMOID, true, true, MOECL_BF16},
        {0, 256, 8, MOECL_SCORING_SIGMOID, true, true, MOECL_F32},
        {0, 128, 1, MOECL_SCORING_SOFTMAX, false, false, MOECL_BF16},
    };
    for (size_t c = 0; c < COUNT(cases); c++) {
        const counts_case *cc = &cases[c];
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(cc->tokens, cc->experts, cc->k);
        d.scoring = cc->scoring;
        d.gating_dtype = cc->dtype;
        if (cc->grouped) {
            d.num_expert_groups = 8;
            d.topk_group = 4;
            d.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
            d.renormalize = true;
            d.routed_scaling_factor = 2.5f;
        }
        harness_rng rng = harness_rng_for(10000 + c);
        const size_t n = (size_t)d.num_tokens * d.num_experts, nk = (size_t)d.num_tokens * d.top_k;
        void *gating = harness_random_tensor(&rng, d.gating_dtype, n ? n : 1, 2.0f);
        float *bias = NULL;
        if (cc->bias) {
            bias = malloc(d.num_experts * sizeof(float));
            for (uint32_t e = 0; e < d.num_experts; e++)
                bias[e] = harness_randn(&rng) * 0.05f;
        }
        float *w = malloc(nk * sizeof(float) + 4);
        int32_t *ids = malloc(nk * sizeof(int32_t) + 4);
        int32_t *counts = malloc(d.num_experts * sizeof(int32_t) + 4);
        ck_assert(w && ids && counts);
        char what[256];
        describe(&d, bias != NULL, what, sizeof(what));
        for (int path = 0; path < 2; path++) {
            run_counts(ctx, &d, gating, bias, path == 1, w, ids, counts);
            check(&d, gating, bias, w, ids);
            check_counts(&d, ids, counts, what);
        }
        free(gating);
        free(bias);
        free(w);
        free(ids);
        free(counts);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* A bad expert_counts is an invalid argument naming it, with nothing
 * enqueued and no output byte changed: too small, absent, misaligned, of
 * another context; NULL on the host path. */
START_TEST(test_with_counts_invalid)
{
    moecl_context *ctx = harness_context();
    moecl_context *other = harness_context();
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(33, 64, 4);
    harness_rng rng = harness_rng_for(11000);
    const size_t n = (size_t)d.num_tokens * d.num_experts, nk = (size_t)d.num_tokens * d.top_k;
    float *gating = harness_random_tensor(&rng, MOECL_F32, n, 1.0f);
    moecl_buffer in = harness_buffer(ctx, n * 4, 0, gating);
    moecl_buffer wb = harness_buffer(ctx, nk * 4, 8, NULL), ib = harness_buffer(ctx, nk * 4, 8, NULL);
    /* Exactly one int short (harness_buffer adds slack). */
    cl_int err;
    uint8_t *poison = malloc(d.num_experts * 4);
    memset(poison, HARNESS_POISON, d.num_experts * 4);
    moecl_buffer small = {clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                                         d.num_experts * 4 - 4, poison, &err),
                          0};
    ck_assert_ptr_nonnull(small.mem);
    free(poison);
    moecl_buffer cb = harness_buffer(ctx, d.num_experts * 4 + 4, 4, NULL);
    moecl_buffer foreign = harness_buffer(other, d.num_experts * 4, 0, NULL);
    const moecl_buffer none = {NULL, 0}, misaligned = {cb.mem, cb.offset - 2};
    const moecl_buffer bad[] = {small, none, misaligned, foreign};
    for (size_t i = 0; i < COUNT(bad); i++) {
        for (uint32_t tokens = 0; tokens <= d.num_tokens; tokens += d.num_tokens) {
            moecl_topk_gating_desc dt = d;
            dt.num_tokens = tokens;
            cl_event done = NULL;
            moecl_status st = moecl_topk_gating_with_counts(ctx, &dt, in, none, wb, ib, bad[i], 0, NULL, &done);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "bad expert_counts %zu (T=%u): %s", i, tokens,
                          moecl_status_string(st));
            ck_assert_ptr_null(done);
            ck_assert_msg(strstr(moecl_context_error(ctx), "expert_counts") != NULL,
                          "bad expert_counts %zu: the message does not name it: %s", i, moecl_context_error(ctx));
        }
    }
    /* Nothing was written: every output and the counts are still poison. */
    ck_assert_int_eq(clFinish(moecl_context_queue(ctx)), CL_SUCCESS);
    uint8_t *bytes = malloc(nk * 4 + d.num_experts * 4);
    harness_read(ctx, wb, nk * 4, bytes);
    for (size_t i = 0; i < nk * 4; i++)
        ck_assert_msg(bytes[i] == HARNESS_POISON, "topk_weights byte %zu changed", i);
    harness_read(ctx, ib, nk * 4, bytes);
    for (size_t i = 0; i < nk * 4; i++)
        ck_assert_msg(bytes[i] == HARNESS_POISON, "topk_ids byte %zu changed", i);
    harness_read(ctx, small, d.num_experts * 4 - 4, bytes);
    for (size_t i = 0; i < d.num_experts * 4 - 4; i++)
        ck_assert_msg(bytes[i] == HARNESS_POISON, "the too-small counts' byte %zu changed", i);
    harness_read(ctx, cb, d.num_experts * 4, bytes);
    for (size_t i = 0; i < d.num_experts * 4; i++)
        ck_assert_msg(bytes[i] == HARNESS_POISON, "the counts' byte %zu changed", i);

    /* Host path: expert_counts NULL. */
    float *w = malloc(nk * 4);
    int32_t *ids = malloc(nk * 4);
    memset(w, HARNESS_POISON, nk * 4);
    memset(ids, HARNESS_POISON, nk * 4);
    moecl_status st = moecl_topk_gating_with_counts_host(ctx, &d, gating, NULL, w, ids, NULL);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(ctx), "expert_counts") != NULL, "%s", moecl_context_error(ctx));
    for (size_t i = 0; i < nk * 4; i++)
        ck_assert_msg(((uint8_t *)w)[i] == HARNESS_POISON && ((uint8_t *)ids)[i] == HARNESS_POISON,
                      "host path: output byte %zu changed", i);

    free(w);
    free(ids);
    free(bytes);
    free(gating);
    harness_release(in);
    harness_release(wb);
    harness_release(ib);
    harness_release(small);
    harness_release(cb);
    harness_release(foreign);
    moecl_context_destroy(other);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- Output and bias dtypes (weights_dtype, ids_dtype, bias_dtype) ---- */

static size_t weight_size(const moecl_topk_gating_desc *d) { return ref_dtype_size(d->weights_dtype); }
static size_t id_size(const moecl_topk_gating_desc *d) { return d->ids_dtype == MOECL_I64 ? 8 : 4; }

static void describe_typed(const moecl_topk_gating_desc *d, bool bias, char *buf, size_t size)
{
    char base[256];
    describe(d, bias, base, sizeof(base));
    snprintf(buf, size, "%s weights=%s ids=%s bias_dtype=%s", base, dtype_name(d->weights_dtype),
             d->ids_dtype == MOECL_I64 ? "i64" : "i32", dtype_name(d->bias_dtype));
}

/* tail bytes past the end of p, which must still be poison. */
static void assert_tail(const void *p, size_t bytes, size_t tail, const char *out, const char *what)
{
    ck_assert_msg(harness_first_unpoisoned((const char *)p + bytes, tail) == tail,
                  "%s: %s: wrote past its last element", what, out);
}

/* run() for desc's output and bias types: w and ids hold nk elements of
 * theirs plus tail bytes, which stay poison (both paths); on the device
 * path the outputs sit at offsets that are a multiple of their element
 * size and not of 8 (2- and 4-byte types) or 16. */
static void run_typed(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const void *bias,
                      bool device_path, void *w, void *ids, size_t tail)
{
    const size_t nk = (size_t)d->num_tokens * d->top_k, wb_n = nk * weight_size(d), ib_n = nk * id_size(d);
    const size_t in_bytes = (size_t)d->num_tokens * d->num_experts * ref_dtype_size(d->gating_dtype);
    memset(w, HARNESS_POISON, wb_n + tail);
    memset(ids, HARNESS_POISON, ib_n + tail);
    char what[384];
    describe_typed(d, bias != NULL, what, sizeof(what));
    moecl_status st;
    if (!device_path) {
        st = moecl_topk_gating_host(ctx, d, gating, bias, w, ids);
        ck_assert_msg(st == MOECL_SUCCESS, "host path %s: %s: %s", what, moecl_status_string(st),
                      moecl_context_error(ctx));
    } else {
        moecl_buffer in = harness_buffer(ctx, in_bytes, 256, gating);
        const size_t bias_bytes = d->num_experts * ref_dtype_size(d->bias_dtype);
        moecl_buffer b = bias ? harness_buffer(ctx, bias_bytes, 3 * ref_dtype_size(d->bias_dtype), bias)
                              : (moecl_buffer){NULL, 0};
        moecl_buffer wb = harness_buffer(ctx, wb_n, 4096 + 2 * weight_size(d), NULL);
        moecl_buffer ib = harness_buffer(ctx, ib_n, id_size(d), NULL);
        cl_event done = NULL;
        st = moecl_topk_gating(ctx, d, in, b, wb, ib, 0, NULL, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "device path %s: %s: %s", what, moecl_status_string(st),
                      moecl_context_error(ctx));
        ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
        clReleaseEvent(done);
        harness_read(ctx, wb, wb_n + tail, w);
        harness_read(ctx, ib, ib_n + tail, ids);
        harness_release(in);
        harness_release(b);
        harness_release(wb);
        harness_release(ib);
    }
    assert_tail(w, wb_n, tail, "topk_weights", what);
    assert_tail(ids, ib_n, tail, "topk_ids", what);
}

/* desc's typed outputs against the reference, and against the host's
 * rounding of the f32 outputs of the same call with f32 weights and int32
 * ids: the same ids, each weight the nearest-even rounding of the f32 one
 * bit for bit (NaN a NaN). Both paths. */
static void typed_case(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const void *bias)
{
    const size_t nk = (size_t)d->num_tokens * d->top_k;
    moecl_topk_gating_desc plain = *d;
    plain.weights_dtype = MOECL_F32;
    plain.ids_dtype = MOECL_I32;
    float *w32 = malloc(nk * 4 + 8);
    int32_t *ids32 = malloc(nk * 4 + 8);
    void *w = malloc(nk * 8 + 8), *ids = malloc(nk * 8 + 8);
    ck_assert(w32 && ids32 && w && ids);
    char what[384], msg[600] = "";
    describe_typed(d, bias != NULL, what, sizeof(what));
    for (int path = 0; path < 2; path++) {
        run_typed(ctx, &plain, gating, bias, path == 1, w32, ids32, 8);
        run_typed(ctx, d, gating, bias, path == 1, w, ids, 8);
        const int bad = ref_check_topk_gating_typed(d, gating, bias, w, ids, msg, sizeof(msg));
        ck_assert_msg(bad == 0, "%s (%s path): %d bad rows; first: %s", what, path ? "device" : "host", bad, msg);
        for (size_t i = 0; i < nk; i++) {
            int64_t id = 0;
            if (d->ids_dtype == MOECL_I64)
                memcpy(&id, (const char *)ids + i * 8, 8);
            else
                id = ((const int32_t *)ids)[i];
            ck_assert_msg(id == ids32[i], "%s (%s path): slot %zu id %lld, with int32 f32 outputs %d", what,
                          path ? "device" : "host", i, (long long)id, ids32[i]);
            ck_assert_msg(ref_same_rounding(d->weights_dtype, w32[i], w, i),
                          "%s (%s path): slot %zu weight %.9g is not the host's rounding of the f32 weight %.9g",
                          what, path ? "device" : "host", i, (double)ref_load(d->weights_dtype, w, i),
                          (double)w32[i]);
        }
    }
    free(w32);
    free(ids32);
    free(w);
    free(ids);
}

/* Every combination of weights_dtype, ids_dtype and bias (none, f32, f16,
 * bf16) on fresh random rows: sigmoid with groups and renormalised
 * (DeepSeek-V3's gating, the bias of its size) and softmax (the CPU fast
 * path where there is no bias), with a routed_scaling_factor whose
 * products are not representable in 16 bits. */
START_TEST(test_out_dtypes_random)
{
    moecl_context *ctx = harness_context();
    unsigned i = 0;
    for (int wt = 0; wt < 3; wt++)
        for (int it = 0; it < 2; it++)
            for (int bt = -1; bt < 3; bt++, i++) {
                if (harness_quick_skips((unsigned)(wt + it + bt + 1)))
                    continue;
                harness_rng rng = harness_rng_for(9100 + i);
                const bool sig = i % 2 == 0;
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(37 + i % 5, sig ? 64 : 100, sig ? 8 : 6);
                d.weights_dtype = (moecl_dtype)wt;
                d.ids_dtype = (moecl_index_dtype)it;
                d.bias_dtype = bt < 0 ? MOECL_F32 : (moecl_dtype)bt;
                d.gating_dtype = (moecl_dtype)(i % 3);
                d.routed_scaling_factor = 2.5f;
                if (sig) {
                    d.scoring = MOECL_SCORING_SIGMOID;
                    d.num_expert_groups = 8;
                    d.topk_group = 4;
                    d.group_score = MOECL_GROUP_SCORE_TOP2_SUM;
                    d.renormalize = true;
                }
                const size_t n = (size_t)d.num_tokens * d.num_experts;
                void *gating = malloc(n * 4);
                for (size_t j = 0; j < n; j++)
                    harness_store(d.gating_dtype, gating, j, 2.0f * harness_randn(&rng));
                void *bias = NULL;
                if (bt >= 0) {
                    bias = malloc(d.num_experts * 4);
                    for (uint32_t e = 0; e < d.num_experts; e++)
                        harness_store(d.bias_dtype, bias, e, (sig ? 0.3f : 0.05f) * harness_randn(&rng));
                }
                typed_case(ctx, &d, gating, bias);
                free(gating);
                free(bias);
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* The special rows (NaN, inf, ties, underflow) with 16-bit weights and
 * int64 ids: a NaN weight stays a NaN, exact ties keep the reference's
 * ids. */
START_TEST(test_out_dtypes_special_rows)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{7, 6}, {64, 8}, {257, 16}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int wt = 1; wt < 3; wt++)
            for (int scoring = 0; scoring < 2; scoring++, i++) {
                if (harness_quick_skips((unsigned)(s + (size_t)wt + (size_t)scoring)))
                    continue;
                harness_rng rng = harness_rng_for(9300 + i);
                const uint32_t e_count = shapes[s][0];
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(ROW_KINDS * 2, e_count, shapes[s][1]);
                d.scoring = (moecl_scoring)scoring;
                d.weights_dtype = (moecl_dtype)wt;
                d.ids_dtype = (moecl_index_dtype)(i % 2);
                d.renormalize = i % 3 == 0;
                float *row = malloc(e_count * sizeof(float));
                float *gating = malloc((size_t)d.num_tokens * e_count * 4);
                for (uint32_t t = 0; t < d.num_tokens; t++) {
                    fill_special_row(&rng, (int)(t % ROW_KINDS), row, e_count);
                    memcpy(gating + (size_t)t * e_count, row, e_count * 4);
                }
                typed_case(ctx, &d, gating, NULL);
                free(row);
                free(gating);
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* Explicit values: f16 weights past 65504 (routed_scaling_factor 1e6)
 * are +-inf, 65504 itself stays; ties round to even; a NaN weight is a
 * quiet NaN in bf16 and a NaN in f16; 1/3 rounds to nearest. */
START_TEST(test_out_dtypes_examples)
{
    moecl_context *ctx = harness_context();
    /* k = 1 softmax renormalised: the weight is factor, or NaN for the NaN row. */
    static const float rows[3][4] = {{1.0f, 2.0f, 3.0f, 4.0f}, {NAN, 0.0f, 1.0f, 2.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    /* ... and exact ties of each rounding (to even: down, then up): 1 +
     * 2^-8 and 1 + 3 * 2^-8 for bf16, 1 + 2^-11 and 1 + 3 * 2^-11 for f16. */
    static const float factors[] = {1e6f,         -1e6f,        65504.0f,          65519.0f,         65520.0f,
                                    1.00390625f, 1.01171875f, 1.00048828125f, -1.00146484375f};
    for (size_t f = 0; f < COUNT(factors); f++)
        for (int wt = 1; wt < 3; wt++)
            for (int path = 0; path < 2; path++) {
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(3, 4, 1);
                d.weights_dtype = (moecl_dtype)wt;
                d.ids_dtype = MOECL_I64;
                d.routed_scaling_factor = factors[f];
                d.renormalize = true;
                uint16_t w[3 + 4];
                int64_t ids[3 + 1];
                run_typed(ctx, &d, rows, NULL, path == 1, w, ids, 8);
                const double want = (double)factors[f];
                const float got = ref_load(d.weights_dtype, w, 0);
                if (wt == MOECL_F16 && fabs(want) >= 65520.0)
                    ck_assert_msg(isinf(got) && (got > 0) == (want > 0), "f16 weight %g * 1 is %g, not inf",
                                  want, (double)got);
                else
                    ck_assert_msg(got == ref_load(d.weights_dtype, (uint16_t[]){wt == MOECL_F16
                                                                                    ? ref_float_to_half(factors[f])
                                                                                    : ref_float_to_bf16(factors[f])},
                                                  0),
                                  "%s weight of factor %g: %g", dtype_name(d.weights_dtype), want, (double)got);
                ck_assert_msg(ids[0] == 3 && ids[2] == 0, "ids %lld %lld", (long long)ids[0], (long long)ids[2]);
                ck_assert_msg(isnan(ref_load(d.weights_dtype, w, 1)), "%s: the NaN row's weight is %g",
                              dtype_name(d.weights_dtype), (double)ref_load(d.weights_dtype, w, 1));
                if (wt == MOECL_BF16)
                    ck_assert_msg((w[1] & 0x7fc0u) == 0x7fc0u, "bf16 NaN %#x is not quiet", w[1]);
            }
    /* 1/3 (softmax of three equal logits, k = 3): bf16 0x3eab, f16 0x3555. */
    static const float thirds[3] = {0.0f, 0.0f, 0.0f};
    for (int wt = 1; wt < 3; wt++)
        for (int path = 0; path < 2; path++) {
            moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 3, 3);
            d.weights_dtype = (moecl_dtype)wt;
            uint16_t w[3 + 4];
            int32_t ids[3 + 2];
            run_typed(ctx, &d, thirds, NULL, path == 1, w, ids, 8);
            for (int j = 0; j < 3; j++)
                ck_assert_msg(w[j] == (wt == MOECL_BF16 ? 0x3eab : 0x3555) && ids[j] == j, "%s 1/3: %#x id %d",
                              dtype_name(d.weights_dtype), w[j], ids[j]);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* The counting entry points and _prepare with bf16 weights, int64 ids and
 * a bf16 bias: the counts equal the ids' histogram, the outputs pass the
 * reference, nothing past the outputs changes. */
START_TEST(test_out_dtypes_counts)
{
    moecl_context *ctx = harness_context();
    harness_rng rng = harness_rng_for(9500);
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(0, 64, 8);
    d.scoring = MOECL_SCORING_SIGMOID;
    d.weights_dtype = MOECL_BF16;
    d.ids_dtype = MOECL_I64;
    d.bias_dtype = MOECL_BF16;
    ck_assert_int_eq(moecl_topk_gating_prepare(ctx, &d), MOECL_SUCCESS);
    d.num_tokens = 129;
    const size_t nk = (size_t)d.num_tokens * d.top_k, n = (size_t)d.num_tokens * d.num_experts;
    void *gating = harness_random_tensor(&rng, MOECL_F32, n, 2.0f);
    void *bias = harness_random_tensor(&rng, MOECL_BF16, d.num_experts, 0.1f);
    uint16_t *w = harness_poisoned(nk * 2 + 8);
    int64_t *ids = harness_poisoned(nk * 8 + 8);
    int32_t *counts = harness_poisoned(d.num_experts * 4 + 8), *ids32 = malloc(nk * 4);
    for (int path = 0; path < 2; path++) {
        memset(w, HARNESS_POISON, nk * 2 + 8);
        memset(ids, HARNESS_POISON, nk * 8 + 8);
        if (path == 0) {
            ck_assert_int_eq(moecl_topk_gating_with_counts_host(ctx, &d, gating, bias, w, ids, counts),
                             MOECL_SUCCESS);
        } else {
            moecl_buffer in = harness_buffer(ctx, n * 4, 0, gating), b = harness_buffer(ctx, d.num_experts * 2, 2, bias);
            moecl_buffer wb = harness_buffer(ctx, nk * 2, 6, NULL), ib = harness_buffer(ctx, nk * 8, 8, NULL);
            moecl_buffer cb = harness_buffer(ctx, d.num_experts * 4, 4, NULL);
            ck_assert_int_eq(moecl_topk_gating_with_counts(ctx, &d, in, b, wb, ib, cb, 0, NULL, NULL), MOECL_SUCCESS);
            harness_read(ctx, wb, nk * 2 + 8, w);
            harness_read(ctx, ib, nk * 8 + 8, ids);
            harness_read(ctx, cb, d.num_experts * 4, counts);
            harness_release(in);
            harness_release(b);
            harness_release(wb);
            harness_release(ib);
            harness_release(cb);
        }
        assert_tail(w, nk * 2, 8, "topk_weights", "with_counts bf16/i64");
        assert_tail(ids, nk * 8, 8, "topk_ids", "with_counts bf16/i64");
        char msg[600] = "";
        ck_assert_msg(ref_check_topk_gating_typed(&d, gating, bias, w, ids, msg, sizeof(msg)) == 0, "%s", msg);
        for (size_t i = 0; i < nk; i++)
            ids32[i] = (int32_t)ids[i];
        check_counts(&d, ids32, counts, "with_counts bf16/i64");
    }
    free(gating);
    free(bias);
    free(w);
    free(ids);
    free(counts);
    free(ids32);
    moecl_context_destroy(ctx);
}
END_TEST

/* The checker itself must reject a wrong answer: poisoned outputs, a wrong
 * id, a wrong weight. Guards against a test that cannot fail. */
START_TEST(test_checker_rejects)
{
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(4, 16, 4);
    harness_rng rng = harness_rng_for(9000);
    float *gating = harness_random_tensor(&rng, MOECL_F32, 64, 1.0f);
    float w[16], good_w[16];
    int32_t ids[16], good_ids[16];
    ref_topk_gating(&d, gating, NULL, good_w, good_ids);
    char msg[256];
    ck_assert_int_eq(ref_check_topk_gating(&d, gating, NULL, good_w, good_ids, msg, sizeof(msg)), 0);
    memset(w, HARNESS_POISON, sizeof(w));
    memset(ids, HARNESS_POISON, sizeof(ids));
    ck_assert_int_ne(ref_check_topk_gating(&d, gating, NULL, w, ids, msg, sizeof(msg)), 0);
    memcpy(w, good_w, sizeof(w));
    memcpy(ids, good_ids, sizeof(ids));
    ids[5] = ids[4]; /* duplicate id in row 1 */
    ck_assert_int_ne(ref_check_topk_gating(&d, gating, NULL, w, ids, msg, sizeof(msg)), 0);
    memcpy(ids, good_ids, sizeof(ids));
    w[2] += 1e-3f;
    ck_assert_int_ne(ref_check_topk_gating(&d, gating, NULL, w, ids, msg, sizeof(msg)), 0);
    free(gating);

    /* Each fill's answer is wrong for the other, and so are the weights of
     * a division by the sum where the floor applies. */
    const float mirrored[8] = {-1, -1, -1, -1, 0, -200, 0, -200};
    const float a = (float)(1.0 / (2.0 + 4.0 * exp(-1.0)));
    const float fw[4] = {a, a, 0, 0};
    const int32_t neg_inf_ids[4] = {4, 6, 5, 7}, zero_ids[4] = {4, 6, 0, 1};
    moecl_topk_gating_desc g = moecl_topk_gating_desc_init(1, 8, 4);
    g.num_expert_groups = 4;
    g.topk_group = 2;
    ck_assert_int_eq(ref_check_topk_gating(&g, mirrored, NULL, fw, neg_inf_ids, msg, sizeof(msg)), 0);
    ck_assert_int_ne(ref_check_topk_gating(&g, mirrored, NULL, fw, zero_ids, msg, sizeof(msg)), 0);
    g.group_fill = MOECL_GROUP_FILL_ZERO;
    ck_assert_int_eq(ref_check_topk_gating(&g, mirrored, NULL, fw, zero_ids, msg, sizeof(msg)), 0);
    ck_assert_int_ne(ref_check_topk_gating(&g, mirrored, NULL, fw, neg_inf_ids, msg, sizeof(msg)), 0);
    /* Zero fill with a bias: the dropped experts weigh their scores, not 0. */
    const float zeros[8] = {0}, bias[8] = {-1, -1, -1, -1, -2, -2, -2, -2};
    const int32_t dropped_ids[4] = {4, 5, 6, 7};
    const float half[4] = {0.5f, 0.5f, 0.5f, 0.5f}, nothing[4] = {0, 0, 0, 0};
    g.scoring = MOECL_SCORING_SIGMOID;
    ck_assert_int_eq(ref_check_topk_gating(&g, zeros, bias, half, dropped_ids, msg, sizeof(msg)), 0);
    ck_assert_int_ne(ref_check_topk_gating(&g, zeros, bias, nothing, dropped_ids, msg, sizeof(msg)), 0);
    /* Sigmoid of -12 and -13, renormalised: their sum is below 2^-14. */
    const float tiny[2] = {-12, -13};
    const int32_t tiny_ids[2] = {0, 1};
    const double s12 = 1.0 / (1.0 + exp(12.0)), s13 = 1.0 / (1.0 + exp(13.0));
    const float by_sum[2] = {(float)(s12 / (s12 + s13)), (float)(s13 / (s12 + s13))};
    const float by_floor[2] = {(float)(s12 * 16384.0), (float)(s13 * 16384.0)};
    moecl_topk_gating_desc f = moecl_topk_gating_desc_init(1, 2, 2);
    f.scoring = MOECL_SCORING_SIGMOID;
    f.renormalize = true;
    ck_assert_int_eq(ref_check_topk_gating(&f, tiny, NULL, by_sum, tiny_ids, msg, sizeof(msg)), 0);
    ck_assert_int_ne(ref_check_topk_gating(&f, tiny, NULL, by_floor, tiny_ids, msg, sizeof(msg)), 0);
    f.renormalize_floor = 6.103515625e-5f;
    ck_assert_int_eq(ref_check_topk_gating(&f, tiny, NULL, by_floor, tiny_ids, msg, sizeof(msg)), 0);
    ck_assert_int_ne(ref_check_topk_gating(&f, tiny, NULL, by_sum, tiny_ids, msg, sizeof(msg)), 0);
}
END_TEST

/* An element of a captured_ids array of dtype, widened. */
static int64_t captured_at(moecl_index_dtype dtype, const void *p, size_t i)
{
    if (dtype == MOECL_I16) {
        int16_t v;
        memcpy(&v, (const char *)p + i * 2, 2);
        return v;
    }
    if (dtype == MOECL_I64) {
        int64_t v;
        memcpy(&v, (const char *)p + i * 8, 8);
        return v;
    }
    int32_t v;
    memcpy(&v, (const char *)p + i * 4, 4);
    return v;
}

static const char *index_name(moecl_index_dtype t) { return t == MOECL_I16 ? "i16" : t == MOECL_I64 ? "i64" : "i32"; }

/* A host record of the current size with the four tensors of the plain
 * call, the others absent. */
static moecl_topk_gating_host_tensors host_record(const void *gating, const void *bias, void *w, void *ids)
{
    moecl_topk_gating_host_tensors h;
    memset(&h, 0, sizeof(h));
    h.struct_size = sizeof(h);
    h.gating = gating;
    h.bias = bias;
    h.topk_weights = w;
    h.topk_ids = ids;
    return h;
}

/* What one ex_case call passes beside the plain call's tensors. */
typedef struct capture_opts {
    const float *scale;         /* expert_scale, or NULL */
    bool capture;               /* captured_ids given */
    moecl_index_dtype cap_dtype;
    const int *valid;           /* num_valid_tokens, or NULL */
    bool counts_and_load;       /* expert_counts and expert_load given too */
    const int32_t *load0;       /* expert_load's values before the call (NULL: 0) */
} capture_opts;

/* moecl_topk_gating_ex (device path, with offsets) or _ex_host with the
 * optional tensors o names on d's inputs, all outputs poisoned:
 * against the plain call's f32 weights and int32 ids on the same inputs
 * (plain_w, plain_ids), each valid row's ids equal and captured, each
 * weight the rounding to weights_dtype of the plain weight times its
 * expert's scale; the valid rows against the float64 reference with the
 * scale; padding rows id -1, weight 0, captured -1; nothing written past
 * an output. */
static void ex_case(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const float *bias,
                         const capture_opts *o, bool device_path, const float *plain_w, const int32_t *plain_ids)
{
    const size_t nk = (size_t)d->num_tokens * d->top_k, e = d->num_experts, tail = 8;
    const size_t wsz = ref_dtype_size(d->weights_dtype), isz = d->ids_dtype == MOECL_I64 ? 8 : 4;
    const size_t csz = o->cap_dtype == MOECL_I16 ? 2 : o->cap_dtype == MOECL_I64 ? 8 : 4;
    const size_t in_bytes = (size_t)d->num_tokens * e * ref_dtype_size(d->gating_dtype);
    void *w = harness_poisoned(nk * wsz + tail), *ids = harness_poisoned(nk * isz + tail);
    void *cap = harness_poisoned(nk * csz + tail);
    int32_t *counts = harness_poisoned(e * 4), *load = calloc(e, 4);
    ck_assert(w && ids && cap && counts && load);
    if (o->load0)
        memcpy(load, o->load0, e * 4);
    char what[480];
    describe_typed(d, bias != NULL, what, sizeof(what));
    snprintf(what + strlen(what), sizeof(what) - strlen(what), "%s%s%s valid=%d%s %s path",
             o->scale ? " expert_scale" : "", o->capture ? " captured=" : "",
             o->capture ? index_name(o->cap_dtype) : "", o->valid ? *o->valid : -99,
             o->counts_and_load ? " counts+load" : "", device_path ? "device" : "host");
    moecl_status st;
    if (!device_path) {
        moecl_topk_gating_host_tensors h = host_record(gating, bias, w, ids);
        h.expert_counts = o->counts_and_load ? counts : NULL;
        h.expert_load = o->counts_and_load ? load : NULL;
        h.num_valid_tokens = o->valid;
        h.captured_ids = o->capture ? cap : NULL;
        h.captured_ids_dtype = o->cap_dtype;
        h.expert_scale = o->scale;
        st = moecl_topk_gating_ex_host(ctx, d, &h);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    } else {
        moecl_topk_gating_tensors t;
        memset(&t, 0, sizeof(t));
        t.struct_size = sizeof(t);
        t.gating = harness_buffer(ctx, in_bytes, 256, gating);
        t.bias = bias ? harness_buffer(ctx, e * 4, 12, bias) : (moecl_buffer){NULL, 0};
        t.topk_weights = harness_buffer(ctx, nk * wsz, 2 * wsz, NULL);
        t.topk_ids = harness_buffer(ctx, nk * isz, isz, NULL);
        if (o->counts_and_load) {
            t.expert_counts = harness_buffer(ctx, e * 4, 20, NULL);
            t.expert_load = harness_buffer(ctx, e * 4, 36, load);
        }
        if (o->valid)
            t.num_valid_tokens = harness_buffer(ctx, 4, 44, o->valid);
        if (o->capture)
            t.captured_ids = harness_buffer(ctx, nk * csz, 3 * csz, NULL);
        t.captured_ids_dtype = o->cap_dtype;
        if (o->scale)
            t.expert_scale = harness_buffer(ctx, e * 4, 28, o->scale);
        cl_event done = NULL;
        st = moecl_topk_gating_ex(ctx, d, &t, 0, NULL, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
        clReleaseEvent(done);
        harness_read(ctx, t.topk_weights, nk * wsz + tail, w);
        harness_read(ctx, t.topk_ids, nk * isz + tail, ids);
        if (o->capture)
            harness_read(ctx, t.captured_ids, nk * csz + tail, cap);
        if (o->counts_and_load) {
            harness_read(ctx, t.expert_counts, e * 4, counts);
            harness_read(ctx, t.expert_load, e * 4, load);
        }
        moecl_buffer *all[] = {&t.gating,       &t.bias,          &t.topk_weights, &t.topk_ids,   &t.expert_counts,
                               &t.expert_load, &t.num_valid_tokens, &t.captured_ids, &t.expert_scale};
        for (size_t i = 0; i < COUNT(all); i++)
            harness_release(*all[i]);
    }
    assert_tail(w, nk * wsz, tail, "topk_weights", what);
    assert_tail(ids, nk * isz, tail, "topk_ids", what);
    assert_tail(cap, nk * csz, tail, "captured_ids", what);
    if (!o->capture)
        ck_assert_msg(harness_first_unpoisoned(cap, nk * csz) == nk * csz, "%s: captured_ids written", what);
    const int n = o->valid ? *o->valid : (int)d->num_tokens;
    const uint32_t valid = n <= 0 ? 0 : (uint32_t)n < d->num_tokens ? (uint32_t)n : d->num_tokens;
    int32_t *hist = calloc(e, 4);
    for (size_t i = 0; i < nk; i++) {
        const bool token = i / d->top_k < valid;
        int64_t id = 0;
        memcpy(&id, (const char *)ids + i * isz, isz);
        if (isz == 4)
            id = (int32_t)id;
        const int64_t want_id = token ? plain_ids[i] : -1;
        ck_assert_msg(id == want_id, "%s: slot %zu (row %zu): id %lld, want %lld", what, i, i / d->top_k,
                      (long long)id, (long long)want_id);
        if (o->capture)
            ck_assert_msg(captured_at(o->cap_dtype, cap, i) == want_id, "%s: slot %zu: captured %lld, want %lld", what,
                          i, (long long)captured_at(o->cap_dtype, cap, i), (long long)want_id);
        /* f32 arithmetic, as the kernel's: the plain weight times the scale. */
        const float want_w = !token ? 0.0f : o->scale ? plain_w[i] * o->scale[want_id] : plain_w[i];
        ck_assert_msg(ref_same_rounding(d->weights_dtype, want_w, w, i),
                      "%s: slot %zu (row %zu, id %lld): weight %.9g, want the rounding of %.9g", what, i,
                      i / d->top_k, (long long)id, (double)ref_load(d->weights_dtype, w, i), (double)want_w);
        if (token)
            hist[want_id]++;
    }
    for (size_t x = 0; o->counts_and_load && x < e; x++)
        ck_assert_msg(counts[x] == hist[x] && load[x] == (o->load0 ? o->load0[x] : 0) + hist[x],
                      "%s: expert %zu: counts %d load %d, want %d and %d more", what, x, counts[x], load[x], hist[x],
                      hist[x]);
    /* The valid rows against the float64 reference, with the scale. */
    moecl_topk_gating_desc rows = *d;
    rows.num_tokens = valid;
    char msg[600] = "";
    const int bad = ref_check_topk_gating_typed_scaled(&rows, gating, bias, o->scale, w, ids, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", what, bad, msg);
    free(hist);
    free(w);
    free(ids);
    free(cap);
    free(counts);
    free(load);
}

/* The tensors of moecl_topk_gating_ex on random rows: every valid count
 * from none to past the rows, on both paths, the rows and team kernels
 * (the launch classes), softmax, sigmoid with DeepSeek-V3's groups and a
 * bias, every dtype; the padding rows' ids -1, weights 0, counted
 * nowhere; the valid rows bit for bit the plain call's; the load counter
 * added to, the counts overwritten. */
START_TEST(test_ex_tensors)
{
    moecl_context *ctx = harness_context();
    for (size_t s = 0; s < EX_SHAPES; s++) {
        const moecl_topk_gating_desc d = ex_desc(s, 37);
        harness_rng rng = harness_rng_for(14000 + s);
        ex_inputs in = ex_inputs_of(ctx, &d, &rng);
        int32_t *load0 = malloc(d.num_experts * 4);
        for (size_t x = 0; x < d.num_experts; x++)
            load0[x] = (int32_t)(harness_rand_u32(&rng) % 1000);
        static const int valid[] = {-3, 0, 1, 19, 36, 37, 1000};
        for (size_t v = 0; v < COUNT(valid); v++)
            for (int path = 0; path < 2; path++)
                /* quick: two counts a shape, one per path */
                if (!harness_quick() || (v % 3 == s && (size_t)path == v % 2) || v == 3 + (size_t)path) {
                    const capture_opts o = {NULL, false, MOECL_I32, &valid[v], true, load0};
                    ex_case(ctx, &d, in.gating, in.bias, &o, path == 1, in.plain_w, in.plain_ids);
                }
        free(load0);
        ex_inputs_free(&in);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* captured_ids and expert_scale on random rows: the rows and team kernels
 * (the launch classes), softmax (the CPU fast path), sigmoid with
 * DeepSeek-V3's groups and a bias, every captured dtype and weights
 * dtype, with and without num_valid_tokens and the counters, both paths;
 * scales of either sign, 0 and 1 among them. */
START_TEST(test_ex_capture_scale)
{
    moecl_context *ctx = harness_context();
    static const moecl_index_dtype caps[] = {MOECL_I16, MOECL_I32, MOECL_I64};
    unsigned i = 0;
    for (size_t s = 0; s < EX_SHAPES; s++) {
        moecl_topk_gating_desc d = ex_desc(s, 29);
        d.renormalize = s != 2;
        harness_rng rng = harness_rng_for(15000 + s);
        ex_inputs in = ex_inputs_of(ctx, &d, &rng);
        const size_t e = d.num_experts;
        float *scale = malloc(e * 4);
        for (size_t x = 0; x < e; x++)
            scale[x] = x % 7 == 3 ? 0.0f : x % 5 == 1 ? 1.0f : (float)(harness_rand_u32(&rng) % 4001) / 1000.0f - 1.0f;
        static const int valid[] = {0, 17, 29};
        for (unsigned c = 0; c < (harness_quick() ? 4u : 8u); c++, i++) {
            moecl_topk_gating_desc dt = d;
            dt.weights_dtype = (moecl_dtype)(i % 3);
            dt.ids_dtype = (moecl_index_dtype)(i / 3 % 2);
            /* c's bits: scale, capture, valid count and counters (0: both
             * scale and capture, so that every case has one) */
            const unsigned v = c % 4;
            const capture_opts o = {v != 1 ? scale : NULL, v != 2, caps[(s + c) % 3],
                                    v >= 2 ? &valid[(s + c) % 3] : NULL, v == 3 || c >= 4, NULL};
            ex_case(ctx, &dt, in.gating, in.bias, &o, (s + c) % 2 == 1, in.plain_w, in.plain_ids);
        }
        free(scale);
        ex_inputs_free(&in);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- shared experts (num_shared_experts) ---- */

/* How a shared-experts call goes: the plain entry point, with_counts, or
 * _ex with a valid-token count, the counts and a load counter. */
enum { SHARED_PLAIN, SHARED_COUNTS, SHARED_EX, SHARED_MODES };

/* Outputs of one call: typed weights and ids of rows of top_k + S slots
 * (ids widened to int32 in ids32), and counts and load of E + S entries
 * (one entry past them, which must stay poison). */
typedef struct shared_out {
    void *w, *ids;
    int32_t *ids32, *counts, *load;
} shared_out;

/* The device tensors of a shared-experts call, at offsets: the counts
 * where counts, the load counter (from load) and the valid count *n where
 * load is not NULL. */
static moecl_topk_gating_tensors shared_tensors(moecl_context *ctx, const moecl_topk_gating_desc *d,
                                                const void *gating, const void *bias, bool counts, const int32_t *load,
                                                const int *n)
{
    const size_t slots = (size_t)d->num_tokens * (d->top_k + d->num_shared_experts);
    const size_t ce = d->num_experts + d->num_shared_experts;
    moecl_topk_gating_tensors t = {.struct_size = sizeof(t)};
    t.gating = harness_buffer(ctx, (size_t)d->num_tokens * d->num_experts * ref_dtype_size(d->gating_dtype), 256,
                              gating);
    if (bias)
        t.bias = harness_buffer(ctx, d->num_experts * ref_dtype_size(d->bias_dtype), 12, bias);
    t.topk_weights = harness_buffer(ctx, slots * weight_size(d), 8, NULL);
    t.topk_ids = harness_buffer(ctx, slots * id_size(d), 8, NULL);
    if (counts)
        t.expert_counts = harness_buffer(ctx, ce * 4, 20, NULL);
    if (load) {
        t.expert_load = harness_buffer(ctx, ce * 4, 36, load);
        t.num_valid_tokens = harness_buffer(ctx, 4, 44, n);
    }
    return t;
}

static void shared_call(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating, const void *bias,
                        int mode, bool device, int n, const int32_t *load0, shared_out *o, const char *what)
{
    const size_t slots = (size_t)d->num_tokens * (d->top_k + d->num_shared_experts);
    const size_t ce = d->num_experts + d->num_shared_experts, ws = weight_size(d), is = id_size(d);
    memset(o->w, HARNESS_POISON, slots * ws + 8);
    memset(o->ids, HARNESS_POISON, slots * is + 8);
    memset(o->counts, HARNESS_POISON, ce * 4 + 4);
    memcpy(o->load, load0, ce * 4);
    memset(o->load + ce, HARNESS_POISON, 4);
    const bool counts = mode != SHARED_PLAIN, ex = mode == SHARED_EX;
    moecl_status st;
    if (!device) {
        const moecl_topk_gating_host_tensors h = {.struct_size = sizeof(h),
                                                  .gating = gating,
                                                  .bias = bias,
                                                  .topk_weights = o->w,
                                                  .topk_ids = o->ids,
                                                  .expert_counts = counts ? o->counts : NULL,
                                                  .expert_load = ex ? o->load : NULL,
                                                  .num_valid_tokens = ex ? &n : NULL};
        st = mode == SHARED_PLAIN    ? moecl_topk_gating_host(ctx, d, gating, bias, o->w, o->ids)
             : mode == SHARED_COUNTS ? moecl_topk_gating_with_counts_host(ctx, d, gating, bias, o->w, o->ids, o->counts)
                                     : moecl_topk_gating_ex_host(ctx, d, &h);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    } else {
        const moecl_topk_gating_tensors t = shared_tensors(ctx, d, gating, bias, counts, ex ? o->load : NULL, &n);
        cl_event done = NULL;
        st = mode == SHARED_PLAIN ? moecl_topk_gating(ctx, d, t.gating, t.bias, t.topk_weights, t.topk_ids, 0, NULL,
                                                      &done)
             : mode == SHARED_COUNTS
                 ? moecl_topk_gating_with_counts(ctx, d, t.gating, t.bias, t.topk_weights, t.topk_ids,
                                                 t.expert_counts, 0, NULL, &done)
                 : moecl_topk_gating_ex(ctx, d, &t, 0, NULL, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
        clReleaseEvent(done);
        harness_read(ctx, t.topk_weights, slots * ws + 8, o->w);
        harness_read(ctx, t.topk_ids, slots * is + 8, o->ids);
        if (counts)
            harness_read(ctx, t.expert_counts, ce * 4 + 4, o->counts);
        if (ex)
            harness_read(ctx, t.expert_load, ce * 4 + 4, o->load);
        const moecl_buffer all[] = {t.gating,        t.bias,        t.topk_weights,    t.topk_ids,
                                    t.expert_counts, t.expert_load, t.num_valid_tokens};
        for (size_t i = 0; i < COUNT(all); i++)
            harness_release(all[i]);
    }
    assert_tail(o->w, slots * ws, 8, "topk_weights", what);
    assert_tail(o->ids, slots * is, 8, "topk_ids", what);
    if (counts && device)
        assert_tail(o->counts, ce * 4, 4, "expert_counts", what);
    if (ex && device)
        assert_tail(o->load, ce * 4, 4, "expert_load", what);
    for (size_t i = 0; i < slots; i++) {
        int64_t id = 0;
        if (d->ids_dtype == MOECL_I64)
            memcpy(&id, (const char *)o->ids + i * 8, 8);
        else
            id = ((const int32_t *)o->ids)[i];
        o->ids32[i] = id >= INT32_MIN && id <= INT32_MAX ? (int32_t)id : INT32_MIN;
    }
}

/* d (with shared experts) on random rows through every entry point and
 * path: the valid rows pass the reference (routed slots as it chooses,
 * shared slots exact) and their routed slots are bit for bit those of the
 * call without shared experts; padding rows are -1 / 0 in every slot; the
 * counts and the load's additions are the histogram of the valid rows'
 * ids over num_experts + S experts. */
static void shared_case(moecl_context *ctx, const moecl_topk_gating_desc *d, bool with_bias, uint64_t stream)
{
    harness_rng rng = harness_rng_for(stream);
    const size_t k = d->top_k, row = k + d->num_shared_experts, ce = d->num_experts + d->num_shared_experts;
    const size_t slots = d->num_tokens * row, ws = weight_size(d), is = id_size(d);
    void *gating = harness_random_tensor(&rng, d->gating_dtype, (size_t)d->num_tokens * d->num_experts, 2.0f);
    void *bias = with_bias ? harness_random_tensor(&rng, d->bias_dtype, d->num_experts, 0.1f) : NULL;
    int32_t *load0 = malloc(ce * 4);
    for (size_t x = 0; x < ce; x++)
        load0[x] = (int32_t)(harness_rand_u32(&rng) % 1000);
    shared_out o = {malloc(slots * 8 + 8), malloc(slots * 8 + 8), malloc(slots * 4 + 4), malloc(ce * 4 + 4),
                    malloc(ce * 4 + 4)};
    /* The routed slots without shared experts (device path). */
    moecl_topk_gating_desc plain = *d;
    plain.num_shared_experts = 0;
    const size_t nk = d->num_tokens * k;
    shared_out p = {malloc(nk * 8 + 8), malloc(nk * 8 + 8), malloc(nk * 4 + 4), malloc(ce * 4 + 4),
                    malloc(ce * 4 + 4)};
    ck_assert(o.w && o.ids && o.ids32 && o.counts && o.load && p.w && p.ids && p.ids32 && p.counts && p.load);
    char base[400], what[480], msg[600] = "";
    describe_typed(d, with_bias, base, sizeof(base));
    snprintf(what, sizeof(what), "%s shared=%u weight=%g plain", base, d->num_shared_experts,
             (double)d->shared_expert_weight);
    shared_call(ctx, &plain, gating, bias, SHARED_PLAIN, true, 0, load0, &p, what);
    for (int mode = 0; mode < SHARED_MODES; mode++)
        for (int device = 0; device < 2; device++) {
            /* valid rows: all but for _ex, which takes a count below the rows */
            const int n = mode == SHARED_EX ? (int)(d->num_tokens * 2 / 3) : (int)d->num_tokens;
            snprintf(what, sizeof(what), "%s shared=%u weight=%g mode %d %s path valid=%d", base,
                     d->num_shared_experts, (double)d->shared_expert_weight, mode, device ? "device" : "host", n);
            shared_call(ctx, d, gating, bias, mode, device == 1, n, load0, &o, what);
            moecl_topk_gating_desc valid = *d;
            valid.num_tokens = (uint32_t)n;
            const int bad = ref_check_topk_gating_typed(&valid, gating, bias, o.w, o.ids, msg, sizeof(msg));
            ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", what, bad, msg);
            int32_t *hist = calloc(ce, 4);
            for (size_t t = 0; t < d->num_tokens; t++)
                for (size_t j = 0; j < row; j++) {
                    const size_t i = t * row + j;
                    if ((int)t >= n) {
                        const float w = ref_load(d->weights_dtype, o.w, i);
                        ck_assert_msg(o.ids32[i] == -1 && w == 0.0f && !signbit(w),
                                      "%s: padding row %zu slot %zu: id %d weight %g", what, t, j, o.ids32[i],
                                      (double)w);
                        continue;
                    }
                    ck_assert_msg(o.ids32[i] >= 0 && (size_t)o.ids32[i] < ce, "%s: row %zu slot %zu: id %d", what, t,
                                  j, o.ids32[i]);
                    hist[o.ids32[i]]++;
                    if (j < k)
                        ck_assert_msg(o.ids32[i] == p.ids32[t * k + j] &&
                                          memcmp((const char *)o.w + i * ws, (const char *)p.w + (t * k + j) * ws,
                                                 ws) == 0,
                                      "%s: row %zu slot %zu: id %d, without shared experts %d (or the weight differs)",
                                      what, t, j, o.ids32[i], p.ids32[t * k + j]);
                }
            for (size_t x = 0; mode != SHARED_PLAIN && x < ce; x++) {
                ck_assert_msg(o.counts[x] == hist[x], "%s: expert_counts[%zu] is %d, the ids hold %d", what, x,
                              o.counts[x], hist[x]);
                if (mode == SHARED_EX)
                    ck_assert_msg(o.load[x] == load0[x] + hist[x], "%s: expert_load[%zu] is %d, want %d + %d", what,
                                  x, o.load[x], load0[x], hist[x]);
            }
            free(hist);
        }
    (void)is;
    free(gating);
    free(bias);
    free(load0);
    void *all[] = {o.w, o.ids, o.ids32, o.counts, o.load, p.w, p.ids, p.ids32, p.counts, p.load};
    for (size_t i = 0; i < COUNT(all); i++)
        free(all[i]);
}

/* Shared experts after the routed slots (SGLang's fused shared experts):
 * S = 1 and 2; softmax (the CPU fast path), the DeepSeek-V3 preset (groups,
 * zero fill, bias, renormalisation, factor 2.5; the shared weight 1 /
 * 2.5), sigmoid renormalised with S = 2 at top_k 62 (the 64-slot bound);
 * every weights, ids and gating dtype across the cases. */
START_TEST(test_shared_experts)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][4] = {{128, 8, 1, 0}, {256, 8, 1, 1}, {60, 2, 2, 2}, {64, 62, 2, 2}, {7, 1, 1, 0}};
    for (size_t s = 0; s < COUNT(shapes); s++) {
        if (harness_quick_skips((unsigned)s) && s >= 3)
            continue;
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(19, shapes[s][0], shapes[s][1]);
        if (shapes[s][3] == 1) {
            ck_assert_int_eq(moecl_topk_gating_desc_preset("deepseek-v3", 19, &d), MOECL_SUCCESS);
            d.shared_expert_weight = 1.0f / d.routed_scaling_factor; /* SGLang's */
            d.bias_dtype = MOECL_BF16;
        } else {
            d.shared_expert_weight = 0.75f;
        }
        d.num_shared_experts = shapes[s][2];
        d.gating_dtype = (moecl_dtype)(s % 3);
        d.weights_dtype = (moecl_dtype)((s + 1) % 3);
        d.ids_dtype = s % 2 ? MOECL_I64 : MOECL_I32;
        if (shapes[s][3] == 2) {
            d.scoring = MOECL_SCORING_SIGMOID;
            d.renormalize = true;
            d.routed_scaling_factor = 1.5f;
        }
        shared_case(ctx, &d, shapes[s][3] == 1, 31000 + s);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* captured_ids' and expert_scale's checks: the dtype (only where
 * captured_ids is given), the sizes and alignment, nothing written on
 * failure; a record of the first size (up to num_valid_tokens) is
 * accepted and its later bytes never read, one of another size refused;
 * the host record likewise. */
START_TEST(test_ex_capture_invalid)
{
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc d = moecl_topk_gating_desc_init(4, 16, 2);
    float logits[4 * 16];
    for (int i = 0; i < 4 * 16; i++)
        logits[i] = (float)((i * 7) % 16) * 0.25f;
    moecl_topk_gating_tensors t = small_record(ctx, logits);
    t.captured_ids = harness_buffer(ctx, 4 * 2 * 2, 0, NULL);
    t.captured_ids_dtype = MOECL_I16;
    const float scale[16] = {2.0f};
    t.expert_scale = harness_buffer(ctx, sizeof(scale), 0, scale);
    moecl_topk_gating_tensors bad = t;
    bad.captured_ids_dtype = (moecl_index_dtype)5;
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "captured_ids_dtype", "bad captured_ids_dtype");
    /* Buffers of exactly the bytes given (harness_buffer adds room). */
    cl_int err;
    bad = t;
    bad.captured_ids = (moecl_buffer){clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 4 * 2 * 2, NULL,
                                                     &err),
                                      0};
    ck_assert_ptr_nonnull(bad.captured_ids.mem);
    bad.captured_ids_dtype = MOECL_I32; /* 4 * 2 int32 do not fit 16 bytes */
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "captured_ids", "short captured_ids");
    harness_release(bad.captured_ids);
    bad = t;
    bad.captured_ids = harness_buffer(ctx, 4 * 2 * 2, 1, NULL); /* misaligned */
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "captured_ids", "misaligned captured_ids");
    harness_release(bad.captured_ids);
    bad = t;
    bad.expert_scale =
        (moecl_buffer){clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_ONLY, 15 * 4, NULL, &err), 0};
    ck_assert_ptr_nonnull(bad.expert_scale.mem);
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "expert_scale", "short expert_scale");
    harness_release(bad.expert_scale);
    bad = t;
    bad.struct_size = offsetof(moecl_topk_gating_tensors, captured_ids) + 8; /* inside captured_ids */
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "struct_size", "record ending inside captured_ids");
    /* Nothing written by the failures above. */
    unsigned char got[4 * 2 * 4];
    harness_read(ctx, t.captured_ids, 4 * 2 * 2, got);
    ck_assert_int_eq(harness_first_unpoisoned(got, 4 * 2 * 2), 4 * 2 * 2);
    harness_read(ctx, t.topk_ids, sizeof(got), got);
    ck_assert_int_eq(harness_first_unpoisoned(got, sizeof(got)), sizeof(got));
    /* The first record's size: the later fields (garbage here) are absent. */
    bad = t;
    bad.struct_size = offsetof(moecl_topk_gating_tensors, captured_ids);
    bad.captured_ids_dtype = (moecl_index_dtype)5;
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_SUCCESS);
    ck_assert_int_eq(clFinish(moecl_context_queue(ctx)), CL_SUCCESS);
    harness_read(ctx, t.captured_ids, 4 * 2 * 2, got);
    ck_assert_int_eq(harness_first_unpoisoned(got, 4 * 2 * 2), 4 * 2 * 2);
    float w_v1[8], w_plain[8];
    int32_t ids_v1[8], ids_plain[8];
    harness_read(ctx, t.topk_weights, sizeof(w_v1), w_v1);
    harness_read(ctx, t.topk_ids, sizeof(ids_v1), ids_v1);
    ck_assert_int_eq(moecl_topk_gating_host(ctx, &d, logits, NULL, w_plain, ids_plain), MOECL_SUCCESS);
    ck_assert_int_eq(memcmp(w_v1, w_plain, sizeof(w_v1)), 0); /* unscaled */
    ck_assert_int_eq(memcmp(ids_v1, ids_plain, sizeof(ids_v1)), 0);
    /* A dtype nobody reads: captured_ids absent. */
    bad = t;
    bad.captured_ids = (moecl_buffer){NULL, 0};
    bad.captured_ids_dtype = (moecl_index_dtype)5;
    ck_assert_int_eq(moecl_topk_gating_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_SUCCESS);
    ck_assert_int_eq(clFinish(moecl_context_queue(ctx)), CL_SUCCESS);
    /* The host record. */
    float w[8];
    int32_t ids[8];
    int16_t cap[8];
    memset(cap, HARNESS_POISON, sizeof(cap));
    moecl_topk_gating_host_tensors h = host_record(logits, NULL, w, ids);
    h.captured_ids = cap;
    h.captured_ids_dtype = (moecl_index_dtype)-1;
    ck_assert_int_eq(moecl_topk_gating_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "captured_ids_dtype", "bad host captured_ids_dtype");
    ck_assert_int_eq(harness_first_unpoisoned(cap, sizeof(cap)), sizeof(cap));
    h.struct_size = offsetof(moecl_topk_gating_host_tensors, captured_ids) + 4;
    ck_assert_int_eq(moecl_topk_gating_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    assert_error_names(ctx, "struct_size", "host record ending inside captured_ids");
    h.struct_size = offsetof(moecl_topk_gating_host_tensors, captured_ids);
    ck_assert_int_eq(moecl_topk_gating_ex_host(ctx, &d, &h), MOECL_SUCCESS);
    ck_assert_int_eq(harness_first_unpoisoned(cap, sizeof(cap)), sizeof(cap));
    ck_assert_int_eq(memcmp(ids, ids_plain, sizeof(ids)), 0);
    moecl_buffer *all[] = {&t.gating, &t.topk_weights, &t.topk_ids, &t.captured_ids, &t.expert_scale};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(*all[i]);
    moecl_context_destroy(ctx);
}
END_TEST

/* Bad shared-expert fields: an invalid argument naming the field, from
 * every entry point that takes them or refuses them. */
START_TEST(test_shared_invalid)
{
    moecl_context *ctx = harness_context();
    float gating[64] = {0}, w[64];
    int32_t ids[64], counts[120];
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(1, 64, 8);
    d.num_shared_experts = 57; /* 8 + 57 > 64 */
    moecl_status st = moecl_topk_gating_host(ctx, &d, gating, NULL, w, ids);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(ctx), "num_shared_experts") != NULL, "%s", moecl_context_error(ctx));
    d.num_shared_experts = 56;
    ck_assert_int_eq(moecl_topk_gating_with_counts_host(ctx, &d, gating, NULL, w, ids, counts), MOECL_SUCCESS);
    d.num_shared_experts = 1;
    d.shared_expert_weight = NAN;
    st = moecl_topk_gating_host(ctx, &d, gating, NULL, w, ids);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(ctx), "shared_expert_weight") != NULL, "%s", moecl_context_error(ctx));
    d.shared_expert_weight = 1.0f;
    st = moecl_topk_weights_host(ctx, &d, gating, ids, w);
    ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_msg(strstr(moecl_context_error(ctx), "num_shared_experts") != NULL, "%s", moecl_context_error(ctx));
    /* A NaN weight without shared experts is not read. */
    d.num_shared_experts = 0;
    d.shared_expert_weight = NAN;
    ck_assert_int_eq(moecl_topk_gating_host(ctx, &d, gating, NULL, w, ids), MOECL_SUCCESS);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("topk_gating");
    /* Test cases, so that a run can take one (--case NAME): the quick
     * suite runs the first five each as a process of its own, in parallel. */
    TCase *tc = tcase_create("reference");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_checker_rejects);
    tcase_add_test(tc, test_special_rows);
    tcase_add_test(tc, test_unaligned_rows);
    tcase_add_test(tc, test_prepare_and_chain);
    tcase_add_test(tc, test_with_counts);
    tcase_add_test(tc, test_with_counts_invalid);
    tcase_add_test(tc, test_group_fill_examples);
    tcase_add_test(tc, test_llama4);
    tcase_add_test(tc, test_seed_zero_fill);
    tcase_add_test(tc, test_renormalize_floor_examples);
    tcase_add_test(tc, test_renormalize_eps_examples);
    tcase_add_test(tc, test_ex_invalid);
    tcase_add_test(tc, test_ex_capture_invalid);
    TCase *options = tcase_create("options");
    tcase_set_timeout(options, 1200);
    tcase_add_test(options, test_options);
    tcase_add_test(options, test_groups);
    tcase_add_test(options, test_scorings_weightings);
    TCase *random = tcase_create("random");
    tcase_set_timeout(random, 1200);
    tcase_add_test(random, test_group_fill_random);
    tcase_add_test(random, test_renormalize_floor_random);
    tcase_add_test(random, test_renormalize_eps_random);
    tcase_add_test(random, test_ex_tensors);
    tcase_add_test(random, test_ex_capture_scale);
    tcase_add_test(random, test_crowded_rows);
    /* --quick (and the valgrind setup): without the large shapes and
     * the grid of ~90 kernel variants, and with half the combinations of
     * the options, groups, scorings and zero-fill tests
     * (harness_quick_skips). */
    if (!harness_quick()) {
        tcase_add_test(random, test_deepseek_v3);
        tcase_add_test(random, test_seed_shapes);
        tcase_add_test(random, test_dtypes_and_tokens);
        tcase_add_test(random, test_grid);
    }
    TCase *dtypes = tcase_create("dtypes");
    tcase_set_timeout(dtypes, 1200);
    tcase_add_test(dtypes, test_out_dtypes_examples);
    tcase_add_test(dtypes, test_out_dtypes_special_rows);
    tcase_add_test(dtypes, test_out_dtypes_counts);
    tcase_add_test(dtypes, test_out_dtypes_random);
    TCase *shared = tcase_create("shared");
    tcase_set_timeout(shared, 1200);
    tcase_add_test(shared, test_shared_invalid);
    tcase_add_test(shared, test_shared_experts);
    suite_add_tcase(s, tc);
    suite_add_tcase(s, options);
    suite_add_tcase(s, dtypes);
    suite_add_tcase(s, random);
    suite_add_tcase(s, shared);
    /* Rows near a loop-limited driver's budget (--case loop_budget). */
    TCase *budget = tcase_create("loop_budget");
    tcase_set_timeout(budget, 1200);
    tcase_add_test(budget, test_loop_budget);
    suite_add_tcase(s, budget);
    return harness_run(s);
}
