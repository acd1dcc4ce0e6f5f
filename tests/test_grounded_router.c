/* moecl_grounded_router against the float64 reference: the seed shape,
 * hidden sizes, expert counts, top_k, alpha, dtypes, output combinations,
 * token counts, exact ties, NaN and inf. Run once per launch class. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "internal.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

enum { OUT_PAIRS = 1, OUT_WEIGHTS = 2, OUT_IDS = 4 };

typedef struct grounded_inputs {
    void *hidden, *ground;
    float *logits;
} grounded_inputs;

typedef struct grounded_outputs {
    float *pairs, *weights;
    int32_t *ids;
} grounded_outputs;

/* The slots of an output row: the routed ones, then the shared ones. */
static size_t row_slots(const moecl_grounded_router_desc *d)
{
    return (size_t)d->top_k + d->num_shared_experts;
}

static void describe(const moecl_grounded_router_desc *d, int outputs, char *buf, size_t size)
{
    snprintf(buf, size, "T=%u H=%u E=%u k=%u S=%u/%g alpha=%g dtype=%d precision=%d outputs=%s%s%s", d->num_tokens,
             d->hidden_dim, d->num_experts, d->top_k, d->num_shared_experts, (double)d->shared_expert_weight,
             (double)d->alpha, (int)d->hidden_dtype, (int)d->precision,
             outputs & OUT_PAIRS ? "pairs " : "",
             outputs & OUT_WEIGHTS ? "weights " : "", outputs & OUT_IDS ? "ids" : "");
}

/* Inputs scaled like a model's: hidden states of unit RMS over sqrt(H), so
 * that the dot products are of order one. */
static grounded_inputs random_inputs(harness_rng *rng, const moecl_grounded_router_desc *d)
{
    grounded_inputs in;
    const float h_scale = 1.0f / sqrtf((float)d->hidden_dim);
    in.hidden = harness_random_tensor(rng, d->hidden_dtype, (size_t)d->num_tokens * d->hidden_dim, h_scale);
    in.ground = harness_random_tensor(rng, d->hidden_dtype, (size_t)d->num_experts * d->hidden_dim, 1.0f);
    in.logits = harness_random_tensor(rng, MOECL_F32, (size_t)d->num_tokens * d->num_experts, 1.0f);
    return in;
}

static void free_inputs(grounded_inputs *in)
{
    free(in->hidden);
    free(in->ground);
    free(in->logits);
}

static grounded_outputs alloc_outputs(const moecl_grounded_router_desc *d, int outputs)
{
    const size_t nk = (size_t)d->num_tokens * row_slots(d);
    grounded_outputs out = {NULL, NULL, NULL};
    if (outputs & OUT_PAIRS)
        out.pairs = malloc(nk * 8 + 4);
    if (outputs & OUT_WEIGHTS)
        out.weights = malloc(nk * 4 + 4);
    if (outputs & OUT_IDS)
        out.ids = malloc(nk * 4 + 4);
    return out;
}

static void free_outputs(grounded_outputs *out)
{
    free(out->pairs);
    free(out->weights);
    free(out->ids);
}

/* Run through the host path or the device path (non-zero offsets, poison
 * before, one element past each output checked after). */
static void run(moecl_context *ctx, const moecl_grounded_router_desc *d, const grounded_inputs *in, int outputs,
                bool device_path, grounded_outputs *out)
{
    const size_t nk = (size_t)d->num_tokens * row_slots(d), in_size = ref_dtype_size(d->hidden_dtype);
    const size_t out_sizes[3] = {nk * 8, nk * 4, nk * 4};
    void *out_ptrs[3] = {out->pairs, out->weights, out->ids};
    for (int i = 0; i < 3; i++)
        if (out_ptrs[i])
            memset(out_ptrs[i], HARNESS_POISON, out_sizes[i] + 4);
    char what[256];
    describe(d, outputs, what, sizeof(what));
    moecl_status st;
    if (!device_path) {
        st = moecl_grounded_router_host(ctx, d, in->hidden, in->logits, in->ground, out->pairs, out->weights,
                                        out->ids);
        ck_assert_msg(st == MOECL_SUCCESS, "host path %s: %s: %s", what, moecl_status_string(st),
                      moecl_context_error(ctx));
        return;
    }
    moecl_buffer hb = harness_buffer(ctx, (size_t)d->num_tokens * d->hidden_dim * in_size, 2 * in_size, in->hidden);
    moecl_buffer lb = harness_buffer(ctx, (size_t)d->num_tokens * d->num_experts * 4, 128, in->logits);
    moecl_buffer gb = harness_buffer(ctx, (size_t)d->num_experts * d->hidden_dim * in_size, 64, in->ground);
    moecl_buffer ob[3];
    for (int i = 0; i < 3; i++)
        ob[i] = out_ptrs[i] ? harness_buffer(ctx, out_sizes[i], 4 * (i + 1), NULL) : (moecl_buffer){NULL, 0};
    cl_event done = NULL;
    st = moecl_grounded_router(ctx, d, hb, lb, gb, ob[0], ob[1], ob[2], 0, NULL, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "device path %s: %s: %s", what, moecl_status_string(st),
                  moecl_context_error(ctx));
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    for (int i = 0; i < 3; i++) {
        if (!out_ptrs[i])
            continue;
        harness_read(ctx, ob[i], out_sizes[i] + 4, out_ptrs[i]);
        uint32_t tail;
        memcpy(&tail, (char *)out_ptrs[i] + out_sizes[i], 4);
        ck_assert_msg(tail == 0xFFFFFFFFu, "%s: wrote past the end of output %d", what, i);
        harness_release(ob[i]);
    }
    harness_release(hb);
    harness_release(lb);
    harness_release(gb);
}

static void check(const moecl_grounded_router_desc *d, const grounded_inputs *in, int outputs,
                  const grounded_outputs *out)
{
    char msg[512] = "", what[256];
    int bad = ref_check_grounded_router(d, in->hidden, in->logits, in->ground, out->pairs, out->weights, out->ids, msg,
                                        sizeof(msg));
    describe(d, outputs, what, sizeof(what));
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", what, bad, msg);
}

static void random_case(moecl_context *ctx, const moecl_grounded_router_desc *d, int outputs, uint64_t stream,
                        bool both_paths)
{
    harness_rng rng = harness_rng_for(stream);
    grounded_inputs in = random_inputs(&rng, d);
    grounded_outputs out = alloc_outputs(d, outputs);
    for (int path = 0; path < (both_paths ? 2 : 1); path++) {
        run(ctx, d, &in, outputs, both_paths ? path == 1 : (stream & 1), &out);
        check(d, &in, outputs, &out);
    }
    free_outputs(&out);
    free_inputs(&in);
}

/* The seed: 4096 tokens, hidden 128, 16 experts, top 2, stacked pairs. */
START_TEST(test_seed_shape)
{
    moecl_context *ctx = harness_context();
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(4096, 128, 16, 0.5f);
    ck_assert_uint_eq(d.top_k, 2);
    random_case(ctx, &d, OUT_PAIRS, 100, true);
    random_case(ctx, &d, OUT_PAIRS | OUT_WEIGHTS | OUT_IDS, 101, true);
    moecl_context_destroy(ctx);
}
END_TEST

/* Every hidden size with every expert count; top_k, alpha, dtype, outputs
 * and token count rotate. Tokens shrink where H * E is large, to keep the
 * float64 reference quick. */
START_TEST(test_grid)
{
    static const uint32_t hidden[] = {1, 7, 128, 1000, 4096};
    static const uint32_t experts[] = {1, 2, 3, 16, 60, 128, 257, 4096};
    static const uint32_t topk[] = {1, 2, 4, 8, 64};
    static const float alphas[] = {0.0f, 0.5f, -3.0f};
    static const uint32_t tokens[] = {0, 1, 33, 4096};
    static const int outputs[] = {OUT_PAIRS, OUT_WEIGHTS | OUT_IDS, OUT_PAIRS | OUT_WEIGHTS | OUT_IDS, OUT_IDS,
                                  OUT_WEIGHTS};
    moecl_context *ctx = harness_context();
    unsigned i = 0;
    for (size_t h = 0; h < COUNT(hidden); h++)
        for (size_t e = 0; e < COUNT(experts); e++) {
            uint32_t k = topk[i % COUNT(topk)];
            while (k > experts[e])
                k = k == 64 ? 8 : k / 2;
            uint32_t t = tokens[i % COUNT(tokens)];
            while (t > 1 && (uint64_t)t * hidden[h] * experts[e] > (8u << 20))
                t /= 2;
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(t, hidden[h], experts[e], alphas[i % 3]);
            d.top_k = k;
            d.hidden_dtype = (moecl_dtype)((i / 3) % 3);
            random_case(ctx, &d, outputs[i % COUNT(outputs)], 200 + i, false);
            i++;
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Each top_k with each alpha and dtype at a mid shape, both paths. */
START_TEST(test_topk_alpha_dtypes)
{
    static const uint32_t topk[] = {1, 2, 4, 8, 64};
    static const float alphas[] = {0.0f, 0.5f, -3.0f};
    moecl_context *ctx = harness_context();
    unsigned i = 0;
    for (size_t k = 0; k < COUNT(topk); k++)
        for (int dt = 0; dt < 3; dt++) {
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(33 + 40 * dt, 128, 128, alphas[i % 3]);
            d.top_k = topk[k];
            d.hidden_dtype = (moecl_dtype)dt;
            random_case(ctx, &d, OUT_PAIRS | OUT_WEIGHTS | OUT_IDS, 300 + i, true);
            i++;
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* A context whose grounded router takes the tensor-core kernel (the
 * variant override's grounded=mma; emulated where the device has no
 * mma.sync), for f16, bf16 and the f32 TF32 precisions; f32 at FP32 keeps
 * the portable kernels. */
static moecl_context *mma_context(void)
{
    harness_override_with("grounded=mma");
    moecl_context *ctx = harness_context();
    harness_override_with(NULL);
    return ctx;
}

/* The precision of loop iteration i (0 the default kernels at FP32; 1 the
 * mma kernel with TF32 for f32, 2 with 3xTF32) and its context. */
static const moecl_precision loop_precision[] = {MOECL_PRECISION_FP32, MOECL_PRECISION_TF32,
                                                 MOECL_PRECISION_3XTF32};
static moecl_context *loop_context(int i) { return i == 0 ? harness_context() : mma_context(); }

/* Exact ties: identical ground rows and a constant logit row make every g
 * of a token equal, so the ids must be 0..k-1 in order. Then NaN and inf in
 * logits and hidden states. Once per loop_precision. */
START_TEST(test_special_rows)
{
    moecl_context *ctx = loop_context(_i);
    static const uint32_t shapes[][3] = {{7, 16, 4}, {128, 60, 8}, {33, 257, 64}};
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int dt = 0; dt < 3; dt++) {
            if (harness_quick_skips((unsigned)(s + (size_t)dt + (size_t)_i)))
                continue; /* quick: every shape and dtype, not every pair, a precision */
            harness_rng rng = harness_rng_for(400 + s * 3 + dt);
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(12, shapes[s][0], shapes[s][1], 0.5f);
            d.top_k = shapes[s][2];
            d.hidden_dtype = (moecl_dtype)dt;
            d.precision = loop_precision[_i];
            grounded_inputs in = random_inputs(&rng, &d);
            const uint32_t H = d.hidden_dim, E = d.num_experts;
            /* Every expert's ground row equals expert 0's. */
            const size_t in_size = ref_dtype_size(d.hidden_dtype);
            for (uint32_t e = 1; e < E; e++)
                memcpy((char *)in.ground + (size_t)e * H * in_size, in.ground, H * in_size);
            for (uint32_t t = 0; t < d.num_tokens; t++) {
                float *row = in.logits + (size_t)t * E;
                switch (t % 6) {
                case 0: /* all g equal */
                case 1:
                    for (uint32_t e = 0; e < E; e++)
                        row[e] = 0.25f * (float)t;
                    break;
                case 2: /* NaN logit */
                    for (uint32_t e = 0; e < E; e++)
                        row[e] = 1.0f;
                    row[E / 2] = NAN;
                    break;
                case 3: /* +inf and -inf logits */
                    for (uint32_t e = 0; e < E; e++)
                        row[e] = (e % 3 == 0) ? -INFINITY : 1.0f;
                    row[E - 1] = INFINITY;
                    break;
                case 4: /* a NaN hidden state: every g of the row is NaN */
                    harness_store(d.hidden_dtype, in.hidden, (size_t)t * H + H / 2, NAN);
                    break;
                default: /* an inf hidden state */
                    harness_store(d.hidden_dtype, in.hidden, (size_t)t * H, INFINITY);
                    break;
                }
            }
            grounded_outputs out = alloc_outputs(&d, OUT_PAIRS | OUT_WEIGHTS | OUT_IDS);
            for (int path = 0; path < 2; path++) {
                run(ctx, &d, &in, OUT_PAIRS | OUT_WEIGHTS | OUT_IDS, path == 1, &out);
                check(&d, &in, OUT_PAIRS | OUT_WEIGHTS | OUT_IDS, &out);
                for (uint32_t t = 0; t < d.num_tokens; t += 6)
                    for (uint32_t j = 0; j < d.top_k; j++) {
                        ck_assert_int_eq(out.ids[t * d.top_k + j], (int32_t)j);
                        ck_assert_int_eq(out.ids[(t + 1) * d.top_k + j], (int32_t)j);
                        ck_assert_msg(fabsf(out.weights[t * d.top_k + j] - 1.0f / d.top_k) < 1e-6f,
                                      "tie row weight %g", (double)out.weights[t * d.top_k + j]);
                    }
            }
            free_outputs(&out);
            free_inputs(&in);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Shapes past a loop-limited driver's budget for one token of the rows
 * kernel (MOECL_DP_LOOP_LIMIT: rusticl's 65535 iterations a work-item,
 * every loop counted), few tokens so that they run on rusticl, through
 * the device path: experts x hidden at 5.5 and 8 times the budget and at
 * the largest hidden size (the split-K kernel there), and 2048 experts at
 * top 64 on ascending values (the gating's most insertions) are checked
 * against the reference. 4096 experts at top 64 pass even the split-K
 * kernel's budget: a loop-limited device refuses it (UNSUPPORTED, the
 * outputs untouched), any other routes it. */
START_TEST(test_loop_budget)
{
    static const uint32_t shapes[][5] = {
        /* tokens, hidden, experts, top_k, ascending logits over a zero table */
        {3, 4096, 88, 8, 0}, {3, 4096, 128, 8, 0}, {2, 65536, 8, 2, 0}, {1, 16, 2048, 64, 1}, {2, 16, 4096, 64, 1},
    };
    moecl_context *ctx = harness_context();
    const bool limited = ctx->params.value[MOECL_DP_LOOP_LIMIT] != 0;
    for (size_t s = 0; s < COUNT(shapes); s++) {
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(shapes[s][0], shapes[s][1], shapes[s][2], 0.5f);
        d.top_k = shapes[s][3];
        const int outputs = OUT_PAIRS | OUT_WEIGHTS | OUT_IDS;
        if (!shapes[s][4]) {
            random_case(ctx, &d, outputs, 2 * (900 + s) + 1, false);
            continue;
        }
        harness_rng rng = harness_rng_for(920 + s);
        grounded_inputs in = random_inputs(&rng, &d);
        memset(in.ground, 0, (size_t)d.num_experts * d.hidden_dim * ref_dtype_size(d.hidden_dtype));
        for (uint32_t t = 0; t < d.num_tokens; t++)
            for (uint32_t e = 0; e < d.num_experts; e++)
                in.logits[(size_t)t * d.num_experts + e] = (float)e / 1024.0f;
        grounded_outputs out = alloc_outputs(&d, outputs);
        if (limited && d.num_experts == 4096) {
            const size_t slots = (size_t)d.num_tokens * row_slots(&d);
            moecl_buffer hb = harness_buffer(ctx, (size_t)d.num_tokens * d.hidden_dim * 4, 0, in.hidden);
            moecl_buffer lb = harness_buffer(ctx, (size_t)d.num_tokens * d.num_experts * 4, 0, in.logits);
            moecl_buffer gb = harness_buffer(ctx, (size_t)d.num_experts * d.hidden_dim * 4, 0, in.ground);
            memset(out.ids, HARNESS_POISON, slots * 4);
            moecl_buffer ib = harness_buffer(ctx, slots * 4, 0, out.ids);
            const moecl_buffer none = {NULL, 0};
            const moecl_status st = moecl_grounded_router(ctx, &d, hb, lb, gb, none, none, ib, 0, NULL, NULL);
            ck_assert_msg(st == MOECL_ERROR_UNSUPPORTED, "4096 experts, top 64: %s", moecl_status_string(st));
            ck_assert_msg(strstr(moecl_context_error(ctx), "loop limit") != NULL, "%s", moecl_context_error(ctx));
            harness_read(ctx, ib, slots * 4, out.ids);
            for (size_t i = 0; i < slots; i++)
                ck_assert_uint_eq((uint32_t)out.ids[i], 0xFFFFFFFFu);
            const moecl_buffer all[] = {hb, lb, gb, ib};
            for (size_t i = 0; i < COUNT(all); i++)
                harness_release(all[i]);
        } else {
            run(ctx, &d, &in, outputs, true, &out);
            check(&d, &in, outputs, &out);
        }
        free_outputs(&out);
        free_inputs(&in);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Invalid fields: each gives INVALID_ARGUMENT naming the field and leaves
 * the outputs untouched, on the host path, the device path and _prepare. */
START_TEST(test_invalid)
{
    moecl_context *ctx = harness_context();
    const moecl_grounded_router_desc good = moecl_grounded_router_desc_init(4, 8, 16, 1.0f);
    struct {
        const char *field;
        moecl_grounded_router_desc d;
    } cases[28];
    int n = 0;
#define BAD(name, stmt)                                                                                                \
    do {                                                                                                               \
        cases[n].field = name;                                                                                         \
        cases[n].d = good;                                                                                             \
        moecl_grounded_router_desc *d = &cases[n].d;                                                                   \
        stmt;                                                                                                          \
        n++;                                                                                                           \
    } while (0)
    BAD("hidden_dim", d->hidden_dim = 0);
    BAD("hidden_dim", d->hidden_dim = 65537);
    BAD("num_experts", d->num_experts = 0);
    BAD("num_experts", d->num_experts = 4097);
    BAD("top_k", d->top_k = 0);
    BAD("top_k", d->top_k = 17);
    BAD("top_k", (d->num_experts = 100, d->top_k = 65));
    BAD("alpha", d->alpha = NAN);
    BAD("alpha", d->alpha = INFINITY);
    BAD("hidden_dtype", d->hidden_dtype = (moecl_dtype)7);
    BAD("precision", d->precision = (moecl_precision)3);
    BAD("precision", d->precision = (moecl_precision)-1);
    BAD("scoring", d->gating.scoring = (moecl_scoring)4);
    BAD("weighting", d->gating.weighting = (moecl_weighting)3);
    BAD("num_expert_groups", (d->gating.num_expert_groups = 3, d->gating.topk_group = 1));
    BAD("topk_group", (d->gating.num_expert_groups = 4, d->gating.topk_group = 0));
    BAD("topk_group", d->gating.topk_group = 1);
    BAD("top_k", (d->gating.num_expert_groups = 16, d->gating.topk_group = 1));
    BAD("group_score", (d->gating.num_expert_groups = 4, d->gating.topk_group = 2,
                        d->gating.group_score = (moecl_group_score)2));
    BAD("group_fill", d->gating.group_fill = (moecl_group_fill)2);
    BAD("routed_scaling_factor", d->gating.routed_scaling_factor = NAN);
    BAD("renormalize_floor", (d->gating.renormalize = true, d->gating.renormalize_floor = 0x1p-140f));
    BAD("renormalize_eps", (d->gating.renormalize = true, d->gating.renormalize_eps = -1.0f));
    BAD("renormalize_eps", (d->gating.renormalize_floor = 1.0f, d->gating.renormalize_eps = 1e-20f));
    BAD("logits_dtype", d->logits_dtype = (moecl_dtype)3);
    BAD("logit_softcap", d->logit_softcap = -30.0f);
    BAD("logit_softcap", d->logit_softcap = NAN);
    BAD("logit_softcap", d->logit_softcap = 0x1p-140f);
#undef BAD
    float hidden[4 * 8] = {0}, ground[16 * 8] = {0}, logits[4 * 16] = {0};
    float pairs[4 * 2 * 2 + 1];
    moecl_buffer hb = harness_buffer(ctx, sizeof(hidden), 0, hidden), gb = harness_buffer(ctx, sizeof(ground), 0, ground);
    moecl_buffer lb = harness_buffer(ctx, sizeof(logits), 0, logits), pb = harness_buffer(ctx, sizeof(pairs), 0, NULL);
    moecl_buffer none = {NULL, 0};
    for (int i = 0; i < n; i++) {
        memset(pairs, HARNESS_POISON, sizeof(pairs));
        moecl_status st = moecl_grounded_router_host(ctx, &cases[i].d, hidden, logits, ground, pairs, NULL, NULL);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "case %d (%s): status %d", i, cases[i].field, (int)st);
        ck_assert_msg(strstr(moecl_context_error(ctx), cases[i].field), "message \"%s\" does not name %s",
                      moecl_context_error(ctx), cases[i].field);
        for (size_t b = 0; b < sizeof(pairs); b++)
            ck_assert_uint_eq(((unsigned char *)pairs)[b], HARNESS_POISON);
        ck_assert_int_eq(moecl_grounded_router_prepare(ctx, &cases[i].d), MOECL_ERROR_INVALID_ARGUMENT);
        cl_event done = (cl_event)&done;
        st = moecl_grounded_router(ctx, &cases[i].d, hb, lb, gb, pb, none, none, 0, NULL, &done);
        ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_ptr_eq(done, (cl_event)&done);
        /* moecl_router: the same checks, with logits absent, nothing written. */
        float w[4 * 2 + 1];
        int32_t ids[4 * 2 + 1];
        memset(w, HARNESS_POISON, sizeof(w));
        memset(ids, HARNESS_POISON, sizeof(ids));
        st = moecl_router_host(ctx, &cases[i].d, hidden, NULL, ground, NULL, w, ids);
        ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_msg(strstr(moecl_context_error(ctx), cases[i].field), "router: message \"%s\" does not name %s",
                      moecl_context_error(ctx), cases[i].field);
        for (size_t b = 0; b < sizeof(w); b++)
            ck_assert_uint_eq(((unsigned char *)w)[b] & ((unsigned char *)ids)[b], HARNESS_POISON);
        st = moecl_router(ctx, &cases[i].d, hb, none, gb, none, pb, pb, 0, NULL, &done);
        ck_assert_int_eq(st, MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_ptr_eq(done, (cl_event)&done);
    }
    /* moecl_router needs both topk_weights and topk_ids. */
    {
        float w[4 * 2];
        ck_assert_int_eq(moecl_router_host(ctx, &good, hidden, NULL, ground, NULL, w, NULL), MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_int_eq(moecl_router(ctx, &good, hb, none, gb, none, pb, none, 0, NULL, NULL),
                         MOECL_ERROR_INVALID_ARGUMENT);
    }
    /* No output at all, and a too-small output buffer. */
    ck_assert_int_eq(moecl_grounded_router_host(ctx, &good, hidden, logits, ground, NULL, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_grounded_router(ctx, &good, hb, lb, gb, none, none, none, 0, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    moecl_grounded_router_desc big = good;
    big.num_tokens = 100; /* past the 64 bytes of slack harness_buffer adds */
    ck_assert_int_eq(moecl_grounded_router(ctx, &big, hb, lb, gb, pb, none, none, 0, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "token_hidden"));
    moecl_buffer pb_late = {pb.mem, 128}; /* 68 bytes + 64 of slack: 64 more do not fit */
    ck_assert_int_eq(moecl_grounded_router(ctx, &good, hb, lb, gb, pb_late, none, none, 0, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "out_pairs"));
    harness_release(hb);
    harness_release(gb);
    harness_release(lb);
    harness_release(pb);
    moecl_context_destroy(ctx);
}
END_TEST

/* _prepare ahead of the call, then an event chain from the device path. */
START_TEST(test_prepare)
{
    moecl_context *ctx = harness_context();
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(0, 96, 24, -0.75f);
    d.top_k = 3;
    ck_assert_int_eq(moecl_grounded_router_prepare(ctx, &d), MOECL_SUCCESS);
    d.num_tokens = 77;
    random_case(ctx, &d, OUT_PAIRS, 500, true);
    random_case(ctx, &d, OUT_WEIGHTS | OUT_IDS, 501, true);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- moecl_router: the gating pipeline on g (docs/routing.md, section 3) ---- */

static void describe_router(const moecl_grounded_router_desc *d, bool bias, bool logits, char *buf, size_t size)
{
    const moecl_gating *g = &d->gating;
    snprintf(buf, size,
             "T=%u H=%u E=%u k=%u alpha=%g dtype=%d scoring=%d weighting=%d groups=%u/%u gs=%d fill=%d renorm=%d "
             "floor=%g eps=%g factor=%g round=%d softcap=%g shared=%u/%g%s%s",
             d->num_tokens, d->hidden_dim, d->num_experts, d->top_k, (double)d->alpha, (int)d->hidden_dtype,
             (int)g->scoring, (int)g->weighting, g->num_expert_groups, g->topk_group, (int)g->group_score,
             (int)g->group_fill, (int)g->renormalize, (double)g->renormalize_floor, (double)g->renormalize_eps,
             (double)g->routed_scaling_factor, (int)d->logits_dtype, (double)d->logit_softcap,
             d->num_shared_experts, (double)d->shared_expert_weight, bias ? " bias" : "", !logits ? " no-logits" : d->router_logits_row ? " logits-row" : "");
}

/* moecl_router on the host path or the device path (offsets, poison, one
 * element past each output), then the reference's check. */
static void run_router(moecl_context *ctx, const moecl_grounded_router_desc *d, const grounded_inputs *in,
                       const float *bias, bool device_path, float *w, int32_t *ids)
{
    const size_t nk = (size_t)d->num_tokens * row_slots(d), in_size = ref_dtype_size(d->hidden_dtype);
    memset(w, HARNESS_POISON, nk * 4 + 4);
    memset(ids, HARNESS_POISON, nk * 4 + 4);
    char what[320];
    describe_router(d, bias != NULL, in->logits != NULL, what, sizeof(what));
    moecl_status st;
    if (!device_path) {
        st = moecl_router_host(ctx, d, in->hidden, in->logits, in->ground, bias, w, ids);
        ck_assert_msg(st == MOECL_SUCCESS, "host path %s: %s: %s", what, moecl_status_string(st),
                      moecl_context_error(ctx));
    } else {
        moecl_buffer hb = harness_buffer(ctx, (size_t)d->num_tokens * d->hidden_dim * in_size, 2 * in_size, in->hidden);
        moecl_buffer lb = in->logits ? harness_buffer(ctx, (size_t)d->num_tokens * d->num_experts * 4, 128, in->logits)
                                     : (moecl_buffer){NULL, 0};
        moecl_buffer gb = harness_buffer(ctx, (size_t)d->num_experts * d->hidden_dim * in_size, 64, in->ground);
        moecl_buffer bb = bias ? harness_buffer(ctx, (size_t)d->num_experts * 4, 36, bias) : (moecl_buffer){NULL, 0};
        moecl_buffer wb = harness_buffer(ctx, nk * 4, 8, NULL), ib = harness_buffer(ctx, nk * 4, 12, NULL);
        cl_event done = NULL;
        st = moecl_router(ctx, d, hb, lb, gb, bb, wb, ib, 0, NULL, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "device path %s: %s: %s", what, moecl_status_string(st),
                      moecl_context_error(ctx));
        ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
        clReleaseEvent(done);
        harness_read_topk(ctx, wb, ib, nk, w, ids, what);
        harness_release(hb);
        harness_release(lb);
        harness_release(gb);
        harness_release(bb);
        harness_release(wb);
        harness_release(ib);
    }
    char msg[512] = "";
    int bad = ref_check_router(d, in->hidden, in->logits, in->ground, bias, NULL, w, ids, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s (%s path): %d bad rows; first: %s", what, device_path ? "device" : "host", bad, msg);
}

/* Random inputs (logits dropped where !with_logits, a bias of order 0.1
 * where with_bias, NaN and inf in a few rows where special) through both
 * paths. */
static void router_case(moecl_context *ctx, const moecl_grounded_router_desc *d, bool with_bias, bool with_logits,
                        bool special, uint64_t stream)
{
    harness_rng rng = harness_rng_for(stream);
    grounded_inputs in = random_inputs(&rng, d);
    if (!with_logits) {
        free(in.logits);
        in.logits = NULL;
    }
    float *bias = with_bias ? harness_random_tensor(&rng, MOECL_F32, d->num_experts, 0.1f) : NULL;
    if (special && d->num_tokens >= 4) {
        const uint32_t H = d->hidden_dim, E = d->num_experts;
        harness_store(d->hidden_dtype, in.hidden, (size_t)1 * H + H / 2, NAN); /* a row of NaN g */
        harness_store(d->hidden_dtype, in.hidden, (size_t)2 * H, INFINITY);    /* infinities */
        if (in.logits) {
            in.logits[(size_t)3 * E + E / 3] = NAN;
            in.logits[(size_t)3 * E + E - 1] = INFINITY;
            in.logits[(size_t)3 * E] = -INFINITY;
        }
    }
    const size_t nk = (size_t)d->num_tokens * row_slots(d);
    float *w = malloc(nk * 4 + 4);
    int32_t *ids = malloc(nk * 4 + 4);
    for (int path = 0; path < 2; path++)
        run_router(ctx, d, &in, bias, path == 1, w, ids);
    free(w);
    free(ids);
    free(bias);
    free_inputs(&in);
}

/* Every scoring with every weighting, rotating bias, absent logits,
 * groups, renormalisation, factor and dtype. */
START_TEST(test_router_gatings)
{
    moecl_context *ctx = harness_context();
    /* hidden, experts, top_k, groups, topk_group */
    static const uint32_t shapes[][5] = {{64, 16, 4, 0, 0}, {40, 60, 6, 4, 2}, {96, 256, 8, 8, 4}};
    unsigned i = 0;
    for (int scoring = 0; scoring < 4; scoring++)
        for (int weighting = 0; weighting < 3; weighting++, i++) {
            const uint32_t *sh = shapes[i % 3];
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(19 + 11 * i, sh[0], sh[1], i % 2 ? 0.5f : 2.0f);
            d.top_k = sh[2];
            d.hidden_dtype = (moecl_dtype)(i % 3);
            d.gating.scoring = (moecl_scoring)scoring;
            d.gating.weighting = (moecl_weighting)weighting;
            d.gating.num_expert_groups = (i / 3) % 2 ? sh[3] : 0;
            d.gating.topk_group = (i / 3) % 2 ? sh[4] : 0;
            d.gating.group_score = (moecl_group_score)(i % 2);
            d.gating.group_fill = i % 4 == 3 ? MOECL_GROUP_FILL_ZERO : MOECL_GROUP_FILL_NEG_INF;
            d.gating.renormalize = i % 2 == 0;
            d.gating.routed_scaling_factor = i % 3 == 1 ? 2.5f : 1.0f;
            router_case(ctx, &d, i % 2 == 1, i % 4 < 2, i % 5 == 0, 800 + i);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* The tensor-core kernel (forced; emulated here) with the gatings the
 * tiled kernel cannot merge: DeepSeek-V3's router (sigmoid, bias, groups,
 * renormalised, scaled) and DeepSeek-V4's sqrtsoftplus, bf16 and f16, and
 * f32 at each tensor-core precision, with and without router logits. */
START_TEST(test_mma_gatings)
{
    moecl_context *ctx = mma_context();
    for (int v = 0; v < 4; v++) {
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(37 + 8 * v, 72, 64, 1.0f);
        d.hidden_dtype = v < 2 ? (moecl_dtype)(MOECL_BF16 - v) : MOECL_F32;
        d.precision = v == 3 ? MOECL_PRECISION_3XTF32 : MOECL_PRECISION_TF32;
        d.top_k = 8;
        d.gating = (moecl_gating){MOECL_SCORING_SIGMOID, MOECL_WEIGHTS_SCORE, 8, 4, MOECL_GROUP_SCORE_TOP2_SUM,
                                  MOECL_GROUP_FILL_NEG_INF, true, 0.0f, 2.5f, 1e-20f};
        router_case(ctx, &d, true, v % 2 == 1, v == 0, 950 + v);
        d.top_k = 6;
        d.gating = (moecl_gating){MOECL_SCORING_SQRTSOFTPLUS, MOECL_WEIGHTS_SOFTMAX_CHOSEN, 0, 0,
                                  MOECL_GROUP_SCORE_MAX, MOECL_GROUP_FILL_ZERO, v % 2 == 0, 0.0f, 1.5f, 0.0f};
        router_case(ctx, &d, v != 1, v % 2 == 0, v == 2, 960 + v);
        /* g as a bf16 or f16 model has it: rounded, capped, a gate bias row. */
        d.logits_dtype = v % 2 ? MOECL_F16 : MOECL_BF16;
        d.logit_softcap = v < 2 ? 4.0f : 0.0f;
        d.router_logits_row = true;
        router_case(ctx, &d, v % 2 == 0, true, v == 1, 970 + v);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* The tensor-core kernel (forced; emulated here) on ragged shapes: token,
 * expert and hidden counts off the tile (16 x 8 x 16 words), one and many
 * warps along the experts, every dtype at each precision, both paths. */
START_TEST(test_mma_shapes)
{
    static const uint32_t shapes[][4] = {{1, 16, 8, 2},   {37, 100, 20, 4}, {70, 257, 130, 8},
                                         {5, 9, 3, 3},    {129, 64, 64, 1}, {40, 1000, 257, 64},
                                         {3, 1, 1, 1}};
    moecl_context *ctx = mma_context();
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int v = 0; v < 4; v++, i++) {
            if (harness_quick_skips((unsigned)(s + v)))
                continue; /* quick: two of the four kinds a shape, each kind at every other shape */
            moecl_grounded_router_desc d =
                moecl_grounded_router_desc_init(shapes[s][0], shapes[s][1], shapes[s][2], i % 2 ? -0.75f : 0.5f);
            d.top_k = shapes[s][3];
            d.hidden_dtype = v < 2 ? (moecl_dtype)(v + 1) : MOECL_F32;
            d.precision = v == 3 ? MOECL_PRECISION_3XTF32 : MOECL_PRECISION_TF32;
            random_case(ctx, &d, i % 3 == 0 ? OUT_PAIRS : OUT_PAIRS | OUT_WEIGHTS | OUT_IDS, 600 + i, true);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* DeepSeek-V3's router in one launch (a smaller hidden size): sigmoid,
 * bias, 8 groups keeping 4 by the sum of their top two, top 8,
 * renormalised, factor 2.5, no router logits; and DeepSeek-V4's
 * sqrtsoftplus with its bias, top 6, factor 1.5. */
START_TEST(test_router_deepseek)
{
    moecl_context *ctx = harness_context();
    for (int dt = 0; dt < 3; dt++) {
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(65, 128, 256, 1.0f);
        d.hidden_dtype = (moecl_dtype)dt;
        d.top_k = 8;
        d.gating = (moecl_gating){MOECL_SCORING_SIGMOID, MOECL_WEIGHTS_SCORE, 8, 4, MOECL_GROUP_SCORE_TOP2_SUM,
                                  MOECL_GROUP_FILL_NEG_INF, true, 0.0f, 2.5f, 1e-20f};
        router_case(ctx, &d, true, false, dt == 0, 900 + dt);
        d.top_k = 6;
        d.gating = (moecl_gating){MOECL_SCORING_SQRTSOFTPLUS, MOECL_WEIGHTS_SCORE, 0, 0, MOECL_GROUP_SCORE_MAX,
                                  MOECL_GROUP_FILL_NEG_INF, true, 0.0f, 1.5f, 0.0f};
        router_case(ctx, &d, true, false, dt == 0, 910 + dt);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* The logits as the model has them: g rounded to bf16 or f16, capped,
 * the router logits one shared row (a gate bias), alone and together,
 * with every scoring, groups and the tiled kernel's shapes (a hundred
 * tokens and more), logits large enough that f16 rounds coarsely. */
START_TEST(test_router_model_logits)
{
    moecl_context *ctx = harness_context();
    /* hidden, experts, top_k, groups, topk_group, tokens */
    static const uint32_t shapes[][6] = {{64, 16, 4, 0, 0, 21}, {40, 60, 6, 4, 2, 33}, {96, 256, 8, 8, 4, 130}};
    static const moecl_dtype rounds[] = {MOECL_F32, MOECL_BF16, MOECL_F16};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (size_t r = 0; r < COUNT(rounds); r++)
            for (int capped = 0; capped < 2; capped++, i++) {
                /* quick: one case a shape, each rounding once */
                if (harness_quick() ? r != (s + (size_t)capped) % 3 || capped != (int)(s % 2) : false)
                    continue;
                const uint32_t *sh = shapes[s];
                moecl_grounded_router_desc d = moecl_grounded_router_desc_init(sh[5], sh[0], sh[1], 4.0f);
                d.top_k = sh[2];
                d.hidden_dtype = (moecl_dtype)(i % 3);
                d.gating.scoring = (moecl_scoring)(i % 4);
                d.gating.weighting = (moecl_weighting)(i % 3);
                d.gating.num_expert_groups = i % 2 ? sh[3] : 0;
                d.gating.topk_group = i % 2 ? sh[4] : 0;
                d.gating.renormalize = i % 3 == 0;
                d.logits_dtype = rounds[r];
                d.logit_softcap = capped ? (i % 2 ? 3.0f : 30.0f) : 0.0f;
                d.router_logits_row = i % 4 < 2;
                router_case(ctx, &d, i % 2 == 1, i % 5 != 4, i % 3 == 2, 1700 + i);
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* Fixed rows (g = the router logits, alpha 0): 1 + 2^-7 - 2^-12 rounds to
 * nearest 1 + 2^-7 in bf16 and in f16 (truncated, it would not), so the
 * rounded g tie and go to the lower index, where fp32 chooses 1 + 2^-7
 * first; 70000 is infinite in f16; the cap
 * 30 tanh(g / 30) brings 100 and 50 close; one shared row routes every
 * token alike. */
START_TEST(test_router_model_logits_rows)
{
    moecl_context *ctx = harness_context();
    static const float logits[3 * 4] = {1.007568359375f, 1.0078125f, 0.5f, -1.0f, 100.0f, 50.0f, 0.0f, -50.0f,
                                        70000.0f, 2.0f, 1.0f, 0.0f};
    float hidden[3 * 4] = {0}, ground[4 * 4] = {0};
    grounded_inputs in = {hidden, ground, (float *)logits};
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(3, 4, 4, 0.0f);
    float w[3 * 2 + 1];
    int32_t ids[3 * 2 + 1];
    static const moecl_dtype rounds[] = {MOECL_F32, MOECL_BF16, MOECL_F16};
    for (size_t r = 0; r < COUNT(rounds); r++)
        for (int path = 0; path < 2; path++) {
            d.logits_dtype = rounds[r];
            run_router(ctx, &d, &in, NULL, path == 1, w, ids);
            const int first = rounds[r] == MOECL_F32 ? 1 : 0;
            ck_assert_msg(ids[0] == first && ids[1] == 1 - first, "round %d: ids [%d, %d]", (int)rounds[r], ids[0],
                          ids[1]);
            if (rounds[r] != MOECL_F32)
                ck_assert_msg(w[0] == 0.5f && w[1] == 0.5f, "round %d: tied weights %g %g", (int)rounds[r],
                              (double)w[0], (double)w[1]);
            /* softmax over [inf, 2] is [NaN, NaN] (inf - inf); finite in
             * fp32 and bf16 it is [1, 0]. */
            ck_assert_msg(rounds[r] == MOECL_F16 ? isnan(w[4]) : w[4] == 1.0f, "round %d: 70000's weight %g",
                          (int)rounds[r], (double)w[4]);
        }
    d.logits_dtype = MOECL_F32;
    d.logit_softcap = 30.0f;
    const double c100 = 30.0 * tanh(100.0 / 30.0), c50 = 30.0 * tanh(50.0 / 30.0);
    for (int path = 0; path < 2; path++) {
        run_router(ctx, &d, &in, NULL, path == 1, w, ids);
        const double w0 = 1.0 / (1.0 + exp(c50 - c100));
        ck_assert_msg(ids[2] == 0 && ids[3] == 1 && fabs(w[2] - w0) < 1e-5 && fabs(w[3] - (1.0 - w0)) < 1e-5,
                      "softcap 30: ids [%d, %d] weights %g %g, want %g %g", ids[2], ids[3], (double)w[2],
                      (double)w[3], w0, 1.0 - w0);
    }
    d.logit_softcap = 0.0f;
    d.router_logits_row = true;
    for (int path = 0; path < 2; path++) {
        run_router(ctx, &d, &in, NULL, path == 1, w, ids);
        for (int t = 0; t < 3; t++)
            ck_assert_msg(ids[2 * t] == 1 && ids[2 * t + 1] == 0, "one row: token %d ids [%d, %d]", t, ids[2 * t],
                          ids[2 * t + 1]);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* TensorRT-LLM's Llama 4 row as g (alpha 0: g is the router logit): RAW
 * selection, the sigmoid of the chosen, top 2: ids [1, 6]. And exact
 * ties: a row of equal g gives ids 0..k-1 whatever the scoring. */
START_TEST(test_router_llama4_and_ties)
{
    moecl_context *ctx = harness_context();
    static const float logits[8] = {20, 30, 17, 0, 1, 2, 25, -1};
    float hidden[4] = {1, 2, 3, 4}, ground[8 * 4];
    for (int i = 0; i < 32; i++)
        ground[i] = (float)(i % 5) - 2.0f;
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(1, 4, 8, 0.0f);
    d.gating.scoring = MOECL_SCORING_RAW;
    d.gating.weighting = MOECL_WEIGHTS_SIGMOID_CHOSEN;
    grounded_inputs in = {hidden, ground, (float *)logits};
    float w[3];
    int32_t ids[3];
    for (int path = 0; path < 2; path++) {
        run_router(ctx, &d, &in, NULL, path == 1, w, ids);
        ck_assert_msg(ids[0] == 1 && ids[1] == 6, "Llama 4: ids [%d, %d], want [1, 6]", ids[0], ids[1]);
        ck_assert_msg(fabs(w[0] - 1.0 / (1.0 + exp(-30.0))) < 1e-6 && fabs(w[1] - 1.0 / (1.0 + exp(-25.0))) < 1e-6,
                      "Llama 4: weights %g %g", (double)w[0], (double)w[1]);
    }
    /* Ties: equal ground rows, no logits. */
    float tie_hidden[3 * 16], tie_ground[24 * 16];
    for (int i = 0; i < 3 * 16; i++)
        tie_hidden[i] = (float)(i % 7) * 0.125f - 0.25f;
    for (int i = 0; i < 24 * 16; i++)
        tie_ground[i] = (float)(i % 16) * 0.0625f;
    grounded_inputs tie = {tie_hidden, tie_ground, NULL};
    for (int scoring = 0; scoring < 4; scoring++) {
        moecl_grounded_router_desc t = moecl_grounded_router_desc_init(3, 16, 24, 1.0f);
        t.top_k = 5;
        t.gating.scoring = (moecl_scoring)scoring;
        t.gating.weighting = (moecl_weighting)(scoring % 3);
        float tw[16];
        int32_t tids[16];
        for (int path = 0; path < 2; path++) {
            run_router(ctx, &t, &tie, NULL, path == 1, tw, tids);
            for (int j = 0; j < 15; j++)
                ck_assert_msg(tids[j] == j % 5, "tie row, scoring %d: slot %d id %d", scoring, j, tids[j]);
        }
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- moecl_router_ex: dtypes, padding rows, load statistics, capture,
 * per-expert scale (docs/routing.md, section 3) ---- */

/* The options of a moecl_router_ex case; num_valid is used where valid. */
typedef struct ex_options {
    bool counts, load, valid, capture, scale;
    int32_t num_valid;
    moecl_index_dtype capture_dtype;
    const void *gate; /* shared_expert_gate [S][H] of hidden_dtype, or NULL */
} ex_options;

static size_t index_bytes(moecl_index_dtype t) { return t == MOECL_I64 ? 8 : t == MOECL_I16 ? 2 : 4; }

/* A device buffer of n elements of elem bytes at an offset of a few
 * elements, poison around it (data copied in where given). */
static moecl_buffer ex_buffer(moecl_context *ctx, size_t n, size_t elem, const void *data)
{
    return harness_buffer(ctx, n * elem, 3 * elem, data);
}

/* Read size bytes and the 4 after them, which must still be poison. */
static void ex_read(moecl_context *ctx, moecl_buffer b, size_t size, void *out, const char *name, const char *what)
{
    char *tmp = malloc(size + 4);
    ck_assert_ptr_nonnull(tmp);
    harness_read(ctx, b, size + 4, tmp);
    uint32_t tail;
    memcpy(&tail, tmp + size, 4);
    ck_assert_msg(tail == 0xFFFFFFFFu, "%s: wrote past the end of %s", what, name);
    memcpy(out, tmp, size);
    free(tmp);
}

/* One moecl_router_ex call (host or device path) on inputs in, a bias of
 * desc->bias_dtype or NULL, the per-expert scale, the options; every
 * output poisoned first, checked against ref_check_router_ex. The weights
 * and ids written go to w_out and ids_out where not NULL (their typed
 * bytes). */
static void run_router_ex(moecl_context *ctx, const moecl_grounded_router_desc *d, const grounded_inputs *in,
                          const void *bias, const float *scale, const ex_options *o, bool device_path, void *w_out,
                          void *ids_out)
{
    /* nk: the slots (the shared ones too), ncap: the routed ones (the
     * capture's); E: the experts counted (the shared ones too). */
    const size_t T = d->num_tokens, nk = T * row_slots(d), ncap = T * d->top_k;
    const size_t E = (size_t)d->num_experts + d->num_shared_experts;
    const size_t w_size = ref_dtype_size(d->weights_dtype), id_size = index_bytes(d->ids_dtype);
    const size_t cap_size = index_bytes(o->capture_dtype), in_size = ref_dtype_size(d->hidden_dtype);
    void *w = harness_poisoned(nk * w_size), *ids = harness_poisoned(nk * id_size);
    void *cap = o->capture ? harness_poisoned(ncap * cap_size) : NULL;
    int32_t *counts = o->counts ? harness_poisoned(E * 4) : NULL;
    int32_t *load = o->load ? malloc(E * 4) : NULL, *load_before = o->load ? malloc(E * 4) : NULL;
    for (size_t e = 0; load && e < E; e++)
        load[e] = load_before[e] = (int32_t)(e * 7 % 13) - 3;
    const int32_t valid = o->num_valid;
    char what[400];
    describe_router(d, bias != NULL, in->logits != NULL, what, sizeof(what));
    const size_t used = strlen(what);
    snprintf(what + used, sizeof(what) - used, " weights=%d ids=%d bias=%d%s%s%s capture=%d%s valid=%d (%s path)",
             (int)d->weights_dtype, (int)d->ids_dtype, (int)d->bias_dtype, o->counts ? " counts" : "",
             o->load ? " load" : "", o->scale ? " scale" : "", o->capture ? (int)o->capture_dtype : -1,
             o->valid ? "" : " (no count)", (int)valid, device_path ? "device" : "host");
    if (o->gate)
        snprintf(what + strlen(what), sizeof(what) - strlen(what), " shared gate");
    moecl_status st;
    if (!device_path) {
        moecl_router_host_tensors h;
        memset(&h, 0, sizeof(h));
        h.struct_size = sizeof(h);
        h.token_hidden = in->hidden;
        h.router_logits = in->logits;
        h.expert_ground = in->ground;
        h.bias = bias;
        h.topk_weights = w;
        h.topk_ids = ids;
        h.expert_counts = counts;
        h.expert_load = load;
        h.num_valid_tokens = o->valid ? &valid : NULL;
        h.captured_ids = cap;
        h.captured_ids_dtype = o->capture_dtype;
        h.expert_scale = o->scale ? scale : NULL;
        h.shared_expert_gate = o->gate;
        st = moecl_router_ex_host(ctx, d, &h);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    } else {
        const moecl_buffer none = {NULL, 0};
        moecl_router_tensors t;
        memset(&t, 0, sizeof(t));
        t.struct_size = sizeof(t);
        t.token_hidden = ex_buffer(ctx, T * d->hidden_dim, in_size, in->hidden);
        t.router_logits = in->logits ? ex_buffer(ctx, T * E, 4, in->logits) : none;
        t.expert_ground = ex_buffer(ctx, E * d->hidden_dim, in_size, in->ground);
        t.bias = bias ? ex_buffer(ctx, E, ref_dtype_size(d->bias_dtype), bias) : none;
        t.topk_weights = ex_buffer(ctx, nk, w_size, NULL);
        t.topk_ids = ex_buffer(ctx, nk, id_size, NULL);
        t.expert_counts = o->counts ? ex_buffer(ctx, E, 4, NULL) : none;
        t.expert_load = o->load ? ex_buffer(ctx, E, 4, load) : none;
        t.num_valid_tokens = o->valid ? ex_buffer(ctx, 1, 4, &valid) : none;
        t.captured_ids = o->capture ? ex_buffer(ctx, ncap, cap_size, NULL) : none;
        t.captured_ids_dtype = o->capture_dtype;
        t.expert_scale = o->scale ? ex_buffer(ctx, d->num_experts, 4, scale) : none;
        t.shared_expert_gate =
            o->gate ? ex_buffer(ctx, (size_t)d->num_shared_experts * d->hidden_dim, in_size, o->gate) : none;
        cl_event done = NULL;
        st = moecl_router_ex(ctx, d, &t, 0, NULL, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
        clReleaseEvent(done);
        ex_read(ctx, t.topk_weights, nk * w_size, w, "topk_weights", what);
        ex_read(ctx, t.topk_ids, nk * id_size, ids, "topk_ids", what);
        if (cap)
            ex_read(ctx, t.captured_ids, ncap * cap_size, cap, "captured_ids", what);
        if (counts)
            ex_read(ctx, t.expert_counts, E * 4, counts, "expert_counts", what);
        if (load)
            ex_read(ctx, t.expert_load, E * 4, load, "expert_load", what);
        const moecl_buffer all[] = {t.token_hidden, t.router_logits, t.expert_ground,    t.bias,
                                    t.topk_weights, t.topk_ids,      t.expert_counts,    t.expert_load,
                                    t.num_valid_tokens, t.captured_ids, t.expert_scale, t.shared_expert_gate};
        for (size_t i = 0; i < COUNT(all); i++)
            harness_release(all[i]);
    }
    const ref_router_ex x = {bias,   o->scale ? scale : NULL, o->valid ? &valid : NULL, w, ids, cap, o->capture_dtype,
                             counts, load ? load_before : NULL, load, o->gate};
    char msg[512] = "";
    const int bad = ref_check_router_ex(d, in->hidden, in->logits, in->ground, &x, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d bad rows; first: %s", what, bad, msg);
    if (w_out)
        memcpy(w_out, w, nk * w_size);
    if (ids_out)
        memcpy(ids_out, ids, nk * id_size);
    free(w);
    free(ids);
    free(cap);
    free(counts);
    free(load);
    free(load_before);
}

/* A scale per expert that is never 1 (so that a kernel without it fails
 * the check), some negative: Gemma 4's is learned, of either sign. */
static float *expert_scales(uint32_t experts)
{
    float *s = malloc((size_t)experts * 4);
    for (uint32_t e = 0; e < experts; e++)
        s[e] = (0.375f + 0.25f * (float)(e % 7)) * (e % 5 == 3 ? -1.0f : 1.0f);
    return s;
}

/* Random inputs (NaN and inf rows where special, as router_case) through
 * moecl_router_ex with the options, both paths; the bias of bias_dtype. */
static void router_ex_case(moecl_context *ctx, const moecl_grounded_router_desc *d, bool with_bias, bool with_logits,
                           bool special, const ex_options *o, uint64_t stream)
{
    harness_rng rng = harness_rng_for(stream);
    grounded_inputs in = random_inputs(&rng, d);
    if (!with_logits) {
        free(in.logits);
        in.logits = NULL;
    }
    void *bias = with_bias ? harness_random_tensor(&rng, d->bias_dtype, d->num_experts, 0.1f) : NULL;
    if (special && d->num_tokens >= 4) {
        harness_store(d->hidden_dtype, in.hidden, (size_t)1 * d->hidden_dim + d->hidden_dim / 2, NAN);
        harness_store(d->hidden_dtype, in.hidden, (size_t)2 * d->hidden_dim, INFINITY);
    }
    float *scale = expert_scales(d->num_experts);
    for (int path = 0; path < 2; path++)
        run_router_ex(ctx, d, &in, bias, scale, o, path == 1, NULL, NULL);
    free(scale);
    free(bias);
    free_inputs(&in);
}

/* The options one at a time and all together, every output dtype, on the
 * kernels the launch class runs at these shapes: a team per token (16 and
 * 60 experts, GPU class), the tiled kernel (256 experts, the seed's
 * gating, a hundred tokens and more), the plain loops (CPU class, or any
 * gating the tiled kernel cannot merge); the valid count at the rows' end,
 * inside, 0, negative and past the end. */
START_TEST(test_router_ex)
{
    moecl_context *ctx = harness_context();
    /* hidden, experts, top_k, groups, topk_group, tokens */
    static const uint32_t shapes[][6] = {{64, 16, 4, 0, 0, 21}, {40, 60, 6, 4, 2, 33}, {96, 256, 8, 0, 0, 130}};
    static const int32_t valid_of[] = {7, 0, -3, 1000, 21};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int v = 0; v < 6; v++, i++) {
            if (harness_quick_skips((unsigned)(s + (size_t)v)))
                continue;
            const uint32_t *sh = shapes[s];
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(sh[5], sh[0], sh[1], 2.0f);
            d.top_k = sh[2];
            d.hidden_dtype = (moecl_dtype)(i % 3);
            d.weights_dtype = (moecl_dtype)(v % 3);
            d.ids_dtype = (moecl_index_dtype)(v % 2);
            d.bias_dtype = (moecl_dtype)((v + 1) % 3);
            /* The tiled kernel's gating on the wide shape (selection on g,
             * no bias); Gemma 4's softmax, renormalised, elsewhere. */
            const bool tiled = s == 2 && v % 2 == 0;
            d.gating.scoring = tiled ? MOECL_SCORING_RAW : MOECL_SCORING_SOFTMAX;
            d.gating.weighting = tiled ? MOECL_WEIGHTS_SOFTMAX_CHOSEN : MOECL_WEIGHTS_SCORE;
            d.gating.renormalize = !tiled;
            d.gating.num_expert_groups = sh[3];
            d.gating.topk_group = sh[4];
            d.gating.routed_scaling_factor = v == 3 ? 2.5f : 1.0f;
            /* v 0..4: one option each (the valid count twice), 5: all */
            const ex_options o = {v == 0 || v == 5, v == 1 || v == 5,
                                  v == 2 || v == 4 || v == 5,
                                  v == 3 || v == 5,
                                  v == 4 || v == 5 || v == 1,
                                  valid_of[(s + (size_t)v) % COUNT(valid_of)],
                                  (moecl_index_dtype)((v + s) % 3 == 0 ? MOECL_I16 : (v + s) % 3 == 1 ? MOECL_I32
                                                                                                        : MOECL_I64),
                                  NULL};
            router_ex_case(ctx, &d, !tiled && v % 3 != 2, v != 4, v == 5, &o, 1900 + i);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Given only moecl_router's six tensors, moecl_router_ex writes what
 * moecl_router writes; and the options that do not change the routing
 * (the histograms, the capture, a valid count of every row) leave the
 * weights and ids as they are, bit for bit. */
START_TEST(test_router_ex_same_bits)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][4] = {{64, 16, 4, 45}, {96, 256, 8, 130}};
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int dt = 0; dt < 3; dt++) {
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(shapes[s][3], shapes[s][0], shapes[s][1],
                                                                           1.0f);
            d.top_k = shapes[s][2];
            d.hidden_dtype = (moecl_dtype)dt;
            d.weights_dtype = (moecl_dtype)dt;
            harness_rng rng = harness_rng_for(2100 + 3 * s + (size_t)dt);
            grounded_inputs in = random_inputs(&rng, &d);
            const size_t nk = (size_t)d.num_tokens * d.top_k, w_bytes = nk * ref_dtype_size(d.weights_dtype);
            void *w0 = malloc(w_bytes), *w1 = malloc(w_bytes);
            int32_t *id0 = malloc(nk * 4), *id1 = malloc(nk * 4);
            const ex_options plain = {false, false, false, false, false, 0, MOECL_I32, NULL};
            const ex_options all = {true, true, true, true, false, (int32_t)d.num_tokens, MOECL_I16, NULL};
            for (int path = 0; path < 2; path++) {
                run_router_ex(ctx, &d, &in, NULL, NULL, &plain, path == 1, w0, id0);
                run_router_ex(ctx, &d, &in, NULL, NULL, &all, path == 1, w1, id1);
                ck_assert_msg(memcmp(w0, w1, w_bytes) == 0 && memcmp(id0, id1, nk * 4) == 0,
                              "shape %zu dtype %d: the options changed the routing", s, dt);
            }
            /* moecl_router_host itself: the same bits as _ex without options. */
            ck_assert_int_eq(moecl_router_host(ctx, &d, in.hidden, in.logits, in.ground, NULL, w1, id1),
                             MOECL_SUCCESS);
            ck_assert_msg(memcmp(w0, w1, w_bytes) == 0 && memcmp(id0, id1, nk * 4) == 0,
                          "shape %zu dtype %d: moecl_router_host differs from moecl_router_ex_host", s, dt);
            free(w0);
            free(w1);
            free(id0);
            free(id1);
            free_inputs(&in);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Exact ties and a row of equal g (ids 0..k-1) with every option, the
 * capture int16, bf16 weights and int64 ids. */
START_TEST(test_router_ex_ties)
{
    moecl_context *ctx = harness_context();
    float tie_hidden[3 * 16], tie_ground[24 * 16];
    for (int i = 0; i < 3 * 16; i++)
        tie_hidden[i] = (float)(i % 7) * 0.125f - 0.25f;
    for (int i = 0; i < 24 * 16; i++)
        tie_ground[i] = (float)(i % 16) * 0.0625f;
    grounded_inputs tie = {tie_hidden, tie_ground, NULL};
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(3, 16, 24, 1.0f);
    d.top_k = 5;
    d.weights_dtype = MOECL_BF16;
    d.ids_dtype = MOECL_I64;
    float *scale = expert_scales(d.num_experts);
    const ex_options o = {true, true, true, true, true, 2, MOECL_I16, NULL};
    int64_t ids[16];
    for (int path = 0; path < 2; path++) {
        run_router_ex(ctx, &d, &tie, NULL, scale, &o, path == 1, NULL, ids);
        for (int j = 0; j < 15; j++)
            ck_assert_msg(ids[j] == (j < 10 ? j % 5 : -1), "tie rows: slot %d id %lld", j, (long long)ids[j]);
    }
    free(scale);
    moecl_context_destroy(ctx);
}
END_TEST

/* Shared experts through moecl_router_ex with every option (the
 * histograms over E + S, a valid count two rows short (all rows where
 * there are two or fewer), the capture of the routed slots, the scale,
 * which leaves the shared slots), NaN and inf in hidden rows 1 and 2, both
 * paths: the constant weight, then the per-token gate (Qwen2-MoE's
 * shared_expert_gate). */
static void shared_ex_case(moecl_context *ctx, moecl_grounded_router_desc *d, bool with_bias, bool with_logits,
                           moecl_index_dtype capture_dtype, uint64_t stream)
{
    for (int gate = 0; gate < 2; gate++) {
        harness_rng rng = harness_rng_for(stream + (uint64_t)gate);
        void *g = gate ? harness_random_tensor(&rng, d->hidden_dtype,
                                               (size_t)d->num_shared_experts * d->hidden_dim, 1.0f)
                       : NULL;
        d->ids_dtype = (moecl_index_dtype)gate;
        const int32_t valid = (int32_t)d->num_tokens - (d->num_tokens > 2 ? 2 : 0);
        const ex_options o = {true, true, true, true, true, valid, capture_dtype, g};
        router_ex_case(ctx, d, with_bias, with_logits, true, &o, stream + 10 + (uint64_t)gate);
        free(g);
    }
}

/* Shared experts (num_shared_experts) at three shapes, each a cold
 * compile of its own kernels, on those the launch class takes there (the
 * CPU class: the plain loops at all three): a decode step (one token, 16
 * experts: a team per token in the GPU class, DeepSeek-style gating), many
 * work-groups (70 tokens over 256 experts, the seed's gating: the tiled
 * kernel, or two work-groups of the plain loops) and the largest S (62
 * shared slots after 2 routed ones, the 64-slot limit; sigmoid with a bias
 * at 256 experts: the plain loops in the GPU class too). Every dtype of
 * the hidden states and the weights once. moecl_grounded_router's outputs
 * (out_pairs too holds top_k + S slots; all three, then the pairs alone)
 * at the decode shape, moecl_router at the largest S. */
START_TEST(test_router_shared)
{
    moecl_context *ctx = harness_context();
    /* hidden, experts, top_k, shared, tokens, DeepSeek-style gating */
    static const uint32_t shapes[][6] = {{64, 16, 4, 1, 1, 1}, {96, 256, 8, 2, 70, 0}, {48, 256, 2, 62, 12, 1}};
    for (size_t s = 0; s < COUNT(shapes); s++) {
        const uint32_t *sh = shapes[s];
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(sh[4], sh[0], sh[1], 1.0f);
        d.top_k = sh[2];
        d.num_shared_experts = sh[3];
        d.shared_expert_weight = s % 2 ? -0.75f : 0.4f;
        d.hidden_dtype = (moecl_dtype)(s % 3);
        d.weights_dtype = (moecl_dtype)((s + 1) % 3);
        if (sh[5]) {
            d.gating.scoring = MOECL_SCORING_SIGMOID;
            d.gating.weighting = MOECL_WEIGHTS_SCORE;
            d.gating.renormalize = true;
            d.gating.routed_scaling_factor = 2.5f;
        }
        shared_ex_case(ctx, &d, sh[5] != 0, s % 2 == 0, s % 2 ? MOECL_I16 : MOECL_I32, 2300 + 20 * s);
        /* The entry points without moecl_router_ex's options write f32
         * weights and int32 ids here. */
        d.weights_dtype = MOECL_F32;
        d.ids_dtype = MOECL_I32;
        if (s == 0) {
            random_case(ctx, &d, OUT_PAIRS | OUT_WEIGHTS | OUT_IDS, 2390, true);
            random_case(ctx, &d, OUT_PAIRS, 2391, true);
        } else if (s == 2) {
            router_case(ctx, &d, true, true, true, 2392);
        }
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* The tensor-core kernel (forced; emulated here) with shared experts. */
START_TEST(test_mma_router_shared)
{
    moecl_context *ctx = mma_context();
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(19, 40, 64, 1.0f);
    d.hidden_dtype = MOECL_BF16;
    d.top_k = 6;
    d.num_shared_experts = 2;
    d.shared_expert_weight = 0.5f;
    d.weights_dtype = MOECL_F16;
    d.gating.scoring = MOECL_SCORING_SOFTMAX;
    d.gating.weighting = MOECL_WEIGHTS_SCORE;
    d.gating.renormalize = true;
    shared_ex_case(ctx, &d, true, false, MOECL_I16, 2400);
    moecl_context_destroy(ctx);
}
END_TEST

/* The tensor-core kernel (forced; emulated here) with every option. */
START_TEST(test_mma_router_ex)
{
    moecl_context *ctx = mma_context();
    for (int v = 0; v < 2; v++) {
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(37, 72, 64, 1.0f);
        d.hidden_dtype = v ? MOECL_F16 : MOECL_BF16;
        d.top_k = 8;
        d.weights_dtype = v ? MOECL_BF16 : MOECL_F16;
        d.ids_dtype = (moecl_index_dtype)v;
        d.bias_dtype = MOECL_BF16;
        d.gating.scoring = MOECL_SCORING_SOFTMAX;
        d.gating.renormalize = true;
        d.gating.weighting = MOECL_WEIGHTS_SCORE;
        const ex_options o = {true, true, true, true, true, 30, v ? MOECL_I32 : MOECL_I16, NULL};
        router_ex_case(ctx, &d, v == 1, v == 0, true, &o, 2200 + v);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* moecl_router_ex's own errors: the record, the capture's type, the
 * optional tensors' sizes; nothing written. And int64 ids are refused by
 * the grounded route dispatch, by name. */
START_TEST(test_router_ex_invalid)
{
    moecl_context *ctx = harness_context();
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(4, 8, 16, 1.0f);
    const size_t nk = 8;
    moecl_buffer hb = harness_buffer(ctx, 4 * 8 * 4, 0, NULL), gb = harness_buffer(ctx, 16 * 8 * 4, 0, NULL);
    moecl_buffer wb = harness_buffer(ctx, nk * 4, 0, NULL), ib = harness_buffer(ctx, nk * 4, 0, NULL);
    /* 2 bytes from its offset to its end (the harness adds 64 after) */
    moecl_buffer small = harness_buffer(ctx, 2, 0, NULL);
    small.offset = HARNESS_SLACK;
    moecl_router_tensors t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    t.token_hidden = hb;
    t.expert_ground = gb;
    t.topk_weights = wb;
    t.topk_ids = ib;
    ck_assert_int_eq(moecl_router_ex(ctx, &d, NULL, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    static const size_t sizes[] = {0, sizeof(t) - 1, sizeof(t) + 8};
    for (size_t i = 0; i < COUNT(sizes); i++) {
        moecl_router_tensors bad = t;
        bad.struct_size = sizes[i];
        ck_assert_int_eq(moecl_router_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "struct_size"));
    }
    /* Each optional tensor too small: named. */
    static const char *const names[] = {"expert_counts", "expert_load", "num_valid_tokens", "captured_ids",
                                        "expert_scale"};
    for (size_t i = 0; i < COUNT(names); i++) {
        moecl_router_tensors bad = t;
        moecl_buffer *slot[] = {&bad.expert_counts, &bad.expert_load, &bad.num_valid_tokens, &bad.captured_ids,
                                &bad.expert_scale};
        *slot[i] = small;
        ck_assert_int_eq(moecl_router_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_msg(strstr(moecl_context_error(ctx), names[i]) != NULL, "%s: %s", names[i],
                      moecl_context_error(ctx));
    }
    /* Bad types: the capture's, the weights', the ids', the bias'. */
    moecl_router_tensors bad = t;
    bad.captured_ids_dtype = (moecl_index_dtype)3;
    ck_assert_int_eq(moecl_router_ex(ctx, &d, &bad, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "captured_ids_dtype"));
    moecl_router_host_tensors h;
    memset(&h, 0, sizeof(h));
    h.struct_size = sizeof(h);
    h.captured_ids_dtype = (moecl_index_dtype)-1;
    ck_assert_int_eq(moecl_router_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "captured_ids_dtype"));
    h.struct_size = 8;
    ck_assert_int_eq(moecl_router_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    static const char *const fields[] = {"weights_dtype", "ids_dtype", "bias_dtype"};
    for (int f = 0; f < 3; f++) {
        moecl_grounded_router_desc b = d;
        if (f == 0)
            b.weights_dtype = (moecl_dtype)3;
        else if (f == 1)
            b.ids_dtype = MOECL_I16;
        else
            b.bias_dtype = (moecl_dtype)7;
        ck_assert_int_eq(moecl_router_ex(ctx, &b, &t, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_msg(strstr(moecl_context_error(ctx), fields[f]) != NULL, "%s", moecl_context_error(ctx));
    }
    /* Shared experts: top_k + S past 64, a weight NaN or infinite, a gate
     * without them, a gate too small; each named. */
    static const char *const shared_fields[] = {"num_shared_experts", "shared_expert_weight", "shared_expert_weight",
                                                "shared_expert_gate", "shared_expert_gate"};
    for (int f = 0; f < 5; f++) {
        moecl_grounded_router_desc b = d;
        moecl_router_tensors g = t;
        b.num_shared_experts = f == 0 ? 63 : f == 3 ? 0 : 1;
        b.top_k = f == 4 ? 1 : b.top_k; /* the outputs' rows still 2 slots: only the gate is too small */
        b.shared_expert_weight = f == 1 ? NAN : f == 2 ? INFINITY : 1.0f;
        g.shared_expert_gate = f >= 3 ? small : (moecl_buffer){NULL, 0};
        ck_assert_int_eq(moecl_router_ex(ctx, &b, &g, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
        ck_assert_msg(strstr(moecl_context_error(ctx), shared_fields[f]) != NULL, "%d: %s", f,
                      moecl_context_error(ctx));
    }
    moecl_grounded_router_desc too_many = d;
    too_many.num_shared_experts = 63; /* k 2 + 63 > 64 */
    float hw[1] = {0};
    ck_assert_int_eq(moecl_router_host(ctx, &too_many, hw, NULL, hw, NULL, hw, hw), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "num_shared_experts"));
    h.struct_size = sizeof(h);
    h.captured_ids_dtype = MOECL_I32;
    h.shared_expert_gate = hw;
    ck_assert_int_eq(moecl_router_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "shared_expert_gate"));
    /* Outputs too small for their types: int64 ids and f32 weights in
     * buffers of half the bytes. */
    moecl_grounded_router_desc wide = d;
    wide.ids_dtype = MOECL_I64;
    moecl_router_tensors short_ids = t;
    short_ids.topk_ids.offset = 40; /* 56 bytes to the end (with the slack), 64 needed */
    ck_assert_int_eq(moecl_router_ex(ctx, &wide, &short_ids, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "topk_ids"));
    /* Nothing was written. */
    uint32_t out[8];
    harness_read(ctx, wb, sizeof(out), out);
    for (int i = 0; i < 8; i++)
        ck_assert_uint_eq(out[i], 0xFFFFFFFFu);
    /* The grounded route dispatch takes int32 ids only. */
    int32_t counts[16], sorted[512], blocks[64], post;
    int64_t ids64[8];
    float hidden[32] = {0}, ground[128] = {0}, logits[64] = {0}, w[8];
    ck_assert_int_eq(moecl_grounded_route_dispatch_host(ctx, &wide, 16, hidden, logits, ground, w, (int32_t *)ids64,
                                                        counts, sorted, blocks, &post, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "ids_dtype"));
    /* A record of the first version (up to expert_scale) is read as one:
     * a shared_expert_gate past it is not looked at. */
    moecl_router_tensors v1 = t;
    v1.struct_size = offsetof(moecl_router_tensors, expert_scale) + sizeof(moecl_buffer);
    v1.shared_expert_gate = small;
    ck_assert_int_eq(moecl_router_ex(ctx, &d, &v1, 0, NULL, NULL), MOECL_SUCCESS);
    ck_assert_int_eq(clFinish(moecl_context_queue(ctx)), CL_SUCCESS);
    const moecl_buffer all[] = {hb, gb, wb, ib, small};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(all[i]);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("grounded_router");
    TCase *tc = tcase_create("reference");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_invalid);
    tcase_add_test(tc, test_seed_shape);
    tcase_add_loop_test(tc, test_special_rows, 0, 1);
    tcase_add_test(tc, test_prepare);
    tcase_add_test(tc, test_router_llama4_and_ties);
    tcase_add_test(tc, test_router_gatings);
    tcase_add_test(tc, test_router_deepseek);
    tcase_add_test(tc, test_router_model_logits);
    tcase_add_test(tc, test_router_model_logits_rows);
    tcase_add_test(tc, test_router_ex_invalid);
    tcase_add_test(tc, test_router_ex);
    tcase_add_test(tc, test_router_ex_same_bits);
    tcase_add_test(tc, test_router_ex_ties);
    tcase_add_test(tc, test_router_shared);
    /* --quick: without the grid and the dtype sweep. */
    if (!harness_quick()) {
        tcase_add_test(tc, test_topk_alpha_dtypes);
        tcase_add_test(tc, test_grid);
    }
    suite_add_tcase(s, tc);
    /* Shapes past a loop-limited driver's budget (--case loop_budget). */
    TCase *budget = tcase_create("loop_budget");
    tcase_set_timeout(budget, 1200);
    tcase_add_test(budget, test_loop_budget);
    suite_add_tcase(s, budget);
    /* The tensor-core kernel, forced (--case mma runs it alone). */
    TCase *mma = tcase_create("mma");
    tcase_set_timeout(mma, 1200);
    tcase_add_loop_test(mma, test_special_rows, 1, 3);
    tcase_add_test(mma, test_mma_shapes);
    tcase_add_test(mma, test_mma_gatings);
    tcase_add_test(mma, test_mma_router_ex);
    tcase_add_test(mma, test_mma_router_shared);
    suite_add_tcase(s, mma);
    return harness_run(s);
}
