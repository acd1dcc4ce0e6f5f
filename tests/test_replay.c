/* moecl_topk_weights and moecl_hash_routing (docs/routing.md section 11):
 * the weights of ids chosen by top-k gating, bit for bit, on every
 * convention; given ids against the float64 reference (repeats, ids that
 * are no expert); hash routing's gather, bad token ids; the validation.
 * meson runs this suite once per launch class (--variant class=cpu|gpu). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "internal.h"

static const moecl_dtype dtypes[] = {MOECL_F32, MOECL_F16, MOECL_BF16};

/* Logits of fresh random rows, some of them special: exact ties, NaN,
 * +-inf, large magnitudes (underflowed softmax scores, saturated
 * sigmoids). */
static void *make_logits(harness_rng *rng, const moecl_topk_gating_desc *d)
{
    const size_t n = (size_t)d->num_tokens * d->num_experts;
    void *x = harness_random_tensor(rng, d->gating_dtype, n, 2.0f);
    for (uint32_t t = 0; t < d->num_tokens; t++) {
        const size_t row = (size_t)t * d->num_experts;
        const uint32_t kind = harness_rand_u32(rng) % 8;
        for (uint32_t e = 0; e < d->num_experts; e++) {
            const uint32_t pick = harness_rand_u32(rng) % 4;
            float v = NAN;
            if (kind == 1 && pick == 0)
                v = 0.5f; /* ties */
            else if (kind == 2 && pick == 0)
                v = (harness_rand_u32(rng) & 1) ? INFINITY : -INFINITY;
            else if (kind == 3 && e == 0)
                v = NAN;
            else if (kind == 4)
                v = 60.0f * harness_randn(rng);
            else
                continue;
            harness_store(d->gating_dtype, x, row + e, v);
        }
    }
    return x;
}

static bool same_bits(float a, float b)
{
    return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

/* Replay on the host path or the device path (offsets, poisoned outputs,
 * the element after the output still poison). */
static void replay(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *x, const int32_t *ids, float *w,
                   bool device_path)
{
    const size_t nk = (size_t)d->num_tokens * d->top_k;
    const size_t in_bytes = (size_t)d->num_tokens * d->num_experts * ref_dtype_size(d->gating_dtype);
    memset(w, HARNESS_POISON, nk * sizeof(float) + 4);
    moecl_status st;
    if (!device_path) {
        st = moecl_topk_weights_host(ctx, d, x, ids, w);
        ck_assert_msg(st == MOECL_SUCCESS, "host replay: %s", moecl_context_error(ctx));
        return;
    }
    moecl_buffer in = harness_buffer(ctx, in_bytes, 256, x);
    moecl_buffer ib = harness_buffer(ctx, nk * 4, 12, ids);
    moecl_buffer wb = harness_buffer(ctx, nk * 4, 4096 + 8, NULL);
    cl_event done = NULL;
    st = moecl_topk_weights(ctx, d, in, ib, wb, 0, NULL, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "device replay: %s", moecl_context_error(ctx));
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    harness_read(ctx, wb, nk * 4 + 4, w);
    ck_assert_msg(harness_first_unpoisoned(w + nk, 4) == 4, "replay wrote past topk_weights");
    harness_release(in);
    harness_release(ib);
    harness_release(wb);
}

static void check_reference(const moecl_topk_gating_desc *d, const void *x, const int32_t *ids, const float *w,
                            const char *what)
{
    char msg[700] = "";
    const int bad = ref_check_topk_weights(d, x, ids, w, msg, sizeof msg);
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", what, bad, msg);
}

/* One convention: top-k gating routes fresh logits, replay weighs its ids.
 * The weights must be top-k gating's bits, except where section 11 says
 * replay differs (then the reference judges them). */
static void bit_exact_case(moecl_context *ctx, moecl_topk_gating_desc d, bool bias, uint64_t stream)
{
    harness_rng rng = harness_rng_for(stream);
    void *x = make_logits(&rng, &d);
    float *b = NULL;
    if (bias) {
        b = malloc(d.num_experts * sizeof(float));
        for (uint32_t e = 0; e < d.num_experts; e++)
            b[e] = 0.1f * harness_randn(&rng);
    }
    const size_t nk = (size_t)d.num_tokens * d.top_k;
    float *w = malloc(nk * 4 + 4), *rw = malloc(nk * 4 + 4);
    int32_t *ids = malloc(nk * 4 + 4);
    ck_assert_int_eq(moecl_topk_gating_host(ctx, &d, x, b, w, ids), MOECL_SUCCESS);
    replay(ctx, &d, x, ids, rw, stream % 2 == 1);
    char what[200];
    snprintf(what, sizeof what, "E=%u k=%u dtype=%d scoring=%d weighting=%d groups=%u/%u fill=%d bias=%d renorm=%d "
             "floor=%g eps=%g factor=%g", d.num_experts, d.top_k, (int)d.gating_dtype, (int)d.scoring,
             (int)d.weighting, d.num_expert_groups, d.topk_group, (int)d.group_fill, bias, d.renormalize,
             (double)d.renormalize_floor, (double)d.renormalize_eps, (double)d.routed_scaling_factor);
    check_reference(&d, x, ids, rw, what);
    const bool zero_fill = d.num_expert_groups && d.group_fill == MOECL_GROUP_FILL_ZERO && !bias &&
                           d.weighting == MOECL_WEIGHTS_SCORE;
    const bool other_sum = bias && d.scoring == MOECL_SCORING_SOFTMAX && d.weighting == MOECL_WEIGHTS_SCORE &&
                           !d.num_expert_groups;
    if (!zero_fill && !other_sum)
        for (size_t i = 0; i < nk; i++)
            ck_assert_msg(same_bits(w[i], rw[i]), "%s: row %zu slot %zu id %d: top-k weight %a, replayed %a", what,
                          i / d.top_k, i % d.top_k, (int)ids[i], (double)w[i], (double)rw[i]);
    free(x);
    free(b);
    free(w);
    free(rw);
    free(ids);
}

START_TEST(test_bit_exact)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][2] = {{16, 4}, {60, 6}, {128, 8}, {257, 3}, {384, 6}, {8, 8}};
    /* Every scoring, weighting and renormalisation; the shape, the bias
     * and the groups cycle with them (each case builds two variants). */
    uint64_t stream = 100;
    for (unsigned scoring = 0; scoring < 4; scoring++)
        for (unsigned weighting = 0; weighting < 3; weighting++)
            for (unsigned renorm = 0; renorm < 4; renorm++) {
                stream++;
                const unsigned s = (unsigned)(stream % (sizeof shapes / sizeof shapes[0]));
                const unsigned opt = (unsigned)((stream / 3) % 4);
                if (harness_quick() && (scoring + weighting + renorm) % 3 != 0)
                    continue; /* quick: a third, every level of each factor */
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(37, shapes[s][0], shapes[s][1]);
                d.gating_dtype = dtypes[stream % 3];
                d.scoring = (moecl_scoring)scoring;
                d.weighting = (moecl_weighting)weighting;
                d.renormalize = renorm > 0;
                d.renormalize_floor = renorm == 2 ? 0x1p-14f : 0.0f;
                d.renormalize_eps = renorm == 3 ? 1e-6f : 0.0f;
                d.routed_scaling_factor = renorm == 1 ? 2.5f : 1.0f;
                const bool bias = opt & 1;
                if (opt & 2 && d.num_experts % 4 == 0 && d.top_k <= d.num_experts / 2) {
                    d.num_expert_groups = 4;
                    d.topk_group = 2;
                    d.group_score = (moecl_group_score)(stream % 2);
                    d.group_fill = (moecl_group_fill)((stream / 2) % 2);
                }
                bit_exact_case(ctx, d, bias, stream);
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* The presets, each with its bias where it has one (DeepSeek-V3's groups
 * and zero fill with a bias are bit-exact). */
START_TEST(test_presets_bit_exact)
{
    moecl_context *ctx = harness_context();
    for (size_t i = 0; moecl_preset_name(i); i++) {
        moecl_topk_gating_desc d;
        ck_assert_int_eq(moecl_topk_gating_desc_preset(moecl_preset_name(i), 29, &d), MOECL_SUCCESS);
        const bool bias = d.scoring != MOECL_SCORING_SOFTMAX && d.scoring != MOECL_SCORING_RAW;
        for (unsigned t = 0; t < 3; t++) {
            if (harness_quick() && (t != i % 3 || i % 2))
                continue; /* quick: half the presets, one dtype each, every dtype among them */
            d.gating_dtype = dtypes[t];
            bit_exact_case(ctx, d, bias, 500 + 3 * i + t);
        }
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Given ids that top-k did not choose: repeats, -1, ids past the experts,
 * whole rows of them; every dtype, both paths, against the reference. */
START_TEST(test_given_ids)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][3] = {{1, 1, 1}, {33, 7, 3}, {129, 64, 16}, {40, 160, 8}, {9, 4096, 64}};
    uint64_t stream = 900;
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (unsigned scoring = 0; scoring < 4; scoring++)
            for (unsigned weighting = 0; weighting < 3; weighting++) {
                stream++;
                if (harness_quick_skips(s + scoring + weighting) || (harness_quick() && shapes[s][1] > 1024))
                    continue;
                harness_rng rng = harness_rng_for(stream);
                moecl_topk_gating_desc d = moecl_topk_gating_desc_init(shapes[s][0], shapes[s][1], shapes[s][2]);
                d.gating_dtype = dtypes[stream % 3];
                d.scoring = (moecl_scoring)scoring;
                d.weighting = (moecl_weighting)weighting;
                d.renormalize = stream % 3 != 0;
                d.renormalize_eps = stream % 3 == 2 ? 1e-20f : 0.0f;
                d.routed_scaling_factor = stream % 2 ? 1.5f : -1.0f;
                void *x = make_logits(&rng, &d);
                const size_t nk = (size_t)d.num_tokens * d.top_k;
                int32_t *ids = malloc(nk * 4);
                float *w = malloc(nk * 4 + 4);
                for (size_t i = 0; i < nk; i++) {
                    const uint32_t u = harness_rand_u32(&rng);
                    const int32_t bad[] = {-1, (int32_t)d.num_experts, INT32_MIN, INT32_MAX};
                    ids[i] = u % 8 == 0 ? bad[(u >> 3) % 4] : (int32_t)((u >> 3) % d.num_experts);
                }
                for (size_t j = 0; j < d.top_k && d.num_tokens > 2; j++)
                    ids[d.top_k + j] = -1; /* a padding row */
                replay(ctx, &d, x, ids, w, stream % 2 == 0);
                check_reference(&d, x, ids, w, "given ids");
                free(x);
                free(ids);
                free(w);
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* Worked examples of the rules of section 11. */
START_TEST(test_examples)
{
    moecl_context *ctx = harness_context();
    /* Sigmoid, renormalised: an id of -1 weighs 0 and is left out of the
     * sum; a repeated id weighs twice. */
    const float x[2][4] = {{0.0f, 1.0f, 2.0f, -1.0f}, {3.0f, 3.0f, 0.0f, 0.0f}};
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(2, 4, 3);
    d.scoring = MOECL_SCORING_SIGMOID;
    d.renormalize = true;
    const int32_t ids[6] = {2, -1, 0, 3, 3, 7};
    float w[7];
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &d, x, ids, w), MOECL_SUCCESS);
    const double s2 = 1.0 / (1.0 + exp(-2.0)), s0 = 0.5;
    ck_assert_msg(fabs(w[0] - s2 / (s2 + s0)) < 1e-6 && w[1] == 0.0f && fabs(w[2] - s0 / (s2 + s0)) < 1e-6,
                  "row 0: %g %g %g", (double)w[0], (double)w[1], (double)w[2]);
    ck_assert_msg(fabs(w[3] - 0.5) < 1e-6 && fabs(w[4] - 0.5) < 1e-6 && w[5] == 0.0f, "row 1: %g %g %g",
                  (double)w[3], (double)w[4], (double)w[5]);
    /* A row of no experts weighs 0 everywhere, whatever the rule. */
    d.renormalize_eps = 1e-20f;
    const int32_t none[6] = {-1, -1, 4, -5, 100, -1};
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &d, x, none, w), MOECL_SUCCESS);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(w[i] == 0.0f && !signbit(w[i]), "no expert: weight %d is %g", i, (double)w[i]);
    d.weighting = MOECL_WEIGHTS_SOFTMAX_CHOSEN;
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &d, x, none, w), MOECL_SUCCESS);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(w[i] == 0.0f, "no expert, softmax over the chosen: weight %d is %g", i, (double)w[i]);
    /* The zero fill without a bias: top-k gating weighs the expert of a
     * dropped group it chose 0; replay weighs it as chosen, by its score.
     * Softmax over 4 experts in 2 groups, keep 1, top 2: group {2, 3} is
     * kept, expert 3's score underflows to 0, and the dropped experts'
     * filled 0.0 tie it: expert 0 wins by index, with weight 0. */
    moecl_topk_gating_desc z = moecl_topk_gating_desc_init(1, 4, 2);
    z.num_expert_groups = 2;
    z.topk_group = 1;
    z.group_fill = MOECL_GROUP_FILL_ZERO;
    const float zx[4] = {-1.0f, 0.0f, 5.0f, -300.0f};
    int32_t zid[2];
    float zw[2], rw[2];
    ck_assert_int_eq(moecl_topk_gating_host(ctx, &z, zx, NULL, zw, zid), MOECL_SUCCESS);
    ck_assert_msg(zid[0] == 2 && zid[1] == 0 && zw[1] == 0.0f, "zero fill: ids %d %d weights %g %g", zid[0], zid[1],
                  (double)zw[0], (double)zw[1]);
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &z, zx, zid, rw), MOECL_SUCCESS);
    const double sum = exp(-6.0) + exp(-5.0) + 1.0 + exp(-305.0);
    ck_assert_msg(same_bits(rw[0], zw[0]) && fabs(rw[1] - exp(-6.0) / sum) < 1e-7,
                  "replayed zero fill: %a %a (top-k %a %a)", (double)rw[0], (double)rw[1], (double)zw[0],
                  (double)zw[1]);
    moecl_context_destroy(ctx);
}
END_TEST

/* Hash routing: the table's rows as ids, bad token ids give -1 and 0, and
 * the weights are replay's of those ids bit for bit. */
START_TEST(test_hash_routing)
{
    moecl_context *ctx = harness_context();
    const uint32_t vocab = 97;
    for (unsigned c = 0; c < 6; c++) {
        harness_rng rng = harness_rng_for(2000 + c);
        moecl_topk_gating_desc d;
        ck_assert_int_eq(moecl_topk_gating_desc_preset("deepseek-v4", 0, &d), MOECL_SUCCESS);
        d.num_tokens = c == 5 ? 0 : 1 + harness_rand_u32(&rng) % 300;
        d.gating_dtype = dtypes[c % 3];
        if (c == 3) { /* another convention, another shape */
            d = moecl_topk_gating_desc_init(d.num_tokens, 64, 8);
            d.scoring = MOECL_SCORING_SOFTMAX;
        }
        const size_t nk = (size_t)d.num_tokens * d.top_k;
        void *x = make_logits(&rng, &d);
        int32_t *table = malloc((size_t)vocab * d.top_k * 4);
        for (size_t i = 0; i < (size_t)vocab * d.top_k; i++)
            table[i] = i % 13 == 5 ? -1 : (int32_t)(harness_rand_u32(&rng) % d.num_experts);
        int32_t *tokens = malloc(d.num_tokens * 4 + 4), *want = malloc(nk * 4 + 4);
        for (uint32_t t = 0; t < d.num_tokens; t++) {
            const uint32_t u = harness_rand_u32(&rng);
            const int32_t bad[] = {-1, (int32_t)vocab, INT32_MIN, INT32_MAX};
            tokens[t] = u % 10 == 0 ? bad[(u >> 4) % 4] : (int32_t)((u >> 4) % vocab);
            for (uint32_t j = 0; j < d.top_k; j++)
                want[(size_t)t * d.top_k + j] =
                    (uint32_t)tokens[t] < vocab ? table[(size_t)tokens[t] * d.top_k + j] : -1;
        }
        float *w = malloc(nk * 4 + 4), *rw = malloc(nk * 4 + 4);
        int32_t *ids = malloc(nk * 4 + 4);
        memset(ids, HARNESS_POISON, nk * 4 + 4);
        if (c % 2 == 0) {
            ck_assert_msg(moecl_hash_routing_host(ctx, &d, x, tokens, table, vocab, w, ids) == MOECL_SUCCESS, "%s",
                          moecl_context_error(ctx));
        } else {
            const size_t in_bytes = nk ? (size_t)d.num_tokens * d.num_experts * ref_dtype_size(d.gating_dtype) : 4;
            moecl_buffer in = harness_buffer(ctx, in_bytes, 64, x);
            moecl_buffer tb = harness_buffer(ctx, d.num_tokens * 4 + 4, 8, tokens);
            moecl_buffer hb = harness_buffer(ctx, (size_t)vocab * d.top_k * 4, 4, table);
            moecl_buffer wb = harness_buffer(ctx, nk * 4 + 4, 16, NULL);
            moecl_buffer ib = harness_buffer(ctx, nk * 4 + 4, 20, NULL);
            cl_event done = NULL;
            ck_assert_msg(moecl_hash_routing(ctx, &d, in, tb, hb, vocab, wb, ib, 0, NULL, &done) == MOECL_SUCCESS,
                          "%s", moecl_context_error(ctx));
            ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
            clReleaseEvent(done);
            harness_read_topk(ctx, wb, ib, nk, w, ids, "hash routing");
            harness_release(in);
            harness_release(tb);
            harness_release(hb);
            harness_release(wb);
            harness_release(ib);
        }
        for (size_t i = 0; i < nk; i++)
            ck_assert_msg(ids[i] == want[i], "case %u slot %zu: id %d, want %d", c, i, ids[i], want[i]);
        check_reference(&d, x, want, w, "hash routing");
        if (nk) {
            ck_assert_int_eq(moecl_topk_weights_host(ctx, &d, x, want, rw), MOECL_SUCCESS);
            for (size_t i = 0; i < nk; i++)
                ck_assert_msg(same_bits(w[i], rw[i]), "case %u slot %zu: hash %a, replay %a", c, i, (double)w[i],
                              (double)rw[i]);
        }
        free(x);
        free(table);
        free(tokens);
        free(want);
        free(w);
        free(rw);
        free(ids);
    }
    moecl_context_destroy(ctx);
}
END_TEST

START_TEST(test_validation)
{
    moecl_context *ctx = harness_context();
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(4, 8, 2);
    const float x[32] = {0};
    const int32_t ids[8] = {0}, table[6] = {0};
    float w[8];
    int32_t out[8];
    ck_assert_int_eq(moecl_topk_weights_host(NULL, &d, x, ids, w), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_topk_weights_host(ctx, NULL, x, ids, w), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &d, x, NULL, w), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "topk_ids"));
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &d, x, ids, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    moecl_topk_gating_desc bad = d;
    bad.top_k = 9;
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &bad, x, ids, w), MOECL_ERROR_INVALID_ARGUMENT);
    bad = d;
    bad.renormalize_eps = 1e-40f;
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &bad, x, ids, w), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "renormalize_eps"));
    ck_assert_int_eq(moecl_hash_routing_host(ctx, &d, x, ids, table, 0, w, out), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "vocab_size"));
    ck_assert_int_eq(moecl_hash_routing_host(ctx, &d, x, ids, NULL, 3, w, out), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_hash_routing_host(ctx, &d, x, ids, table, 3, w, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    /* Device buffers: missing, too small (nothing written), a wait list. */
    moecl_buffer in = harness_buffer(ctx, sizeof x, 0, x);
    moecl_buffer ib = harness_buffer(ctx, sizeof ids, 0, ids);
    cl_int err;
    moecl_buffer small = {clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 8 * 4 - 4, NULL, &err), 0};
    ck_assert_ptr_nonnull(small.mem);
    moecl_buffer wb = harness_buffer(ctx, 8 * 4, 0, NULL);
    moecl_buffer none = {NULL, 0};
    ck_assert_int_eq(moecl_topk_weights(ctx, &d, in, none, wb, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_topk_weights(ctx, &d, in, ib, small, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "topk_weights"));
    ck_assert_int_eq(moecl_topk_weights(ctx, &d, in, small, wb, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_topk_weights(ctx, &d, in, ib, wb, 1, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_hash_routing(ctx, &d, in, ib, small, 4, wb, ib, 0, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "tid2eid"));
    float got[8];
    harness_read(ctx, wb, sizeof got, got);
    ck_assert_int_eq(harness_first_unpoisoned(got, sizeof got), sizeof got);
    /* No tokens: a marker event, nothing written. */
    d.num_tokens = 0;
    cl_event done = NULL;
    ck_assert_int_eq(moecl_topk_weights(ctx, &d, in, ib, wb, 0, NULL, &done), MOECL_SUCCESS);
    ck_assert_ptr_nonnull(done);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    ck_assert_int_eq(moecl_topk_weights_host(ctx, &d, NULL, NULL, NULL), MOECL_SUCCESS);
    ck_assert_int_eq(moecl_hash_routing_host(ctx, &d, NULL, NULL, table, 3, NULL, NULL), MOECL_SUCCESS);
    harness_release(in);
    harness_release(ib);
    harness_release(small);
    harness_release(wb);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("replay");
    TCase *tc = tcase_create("replay");
    tcase_set_timeout(tc, 1800);
    tcase_add_test(tc, test_validation);
    tcase_add_test(tc, test_examples);
    tcase_add_test(tc, test_hash_routing);
    tcase_add_test(tc, test_given_ids);
    tcase_add_test(tc, test_presets_bit_exact);
    tcase_add_test(tc, test_bit_exact);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
