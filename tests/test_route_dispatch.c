/* moecl_route_dispatch against moecl_topk_gating followed by
 * moecl_moe_align (bit for bit: every output) and against the reference
 * (tests/reference.c): top-k as the top-k suite bounds it, the dispatch
 * outputs exactly for the ids chosen. Every top-k convention, f32/f16/bf16,
 * exact ties, NaN and inf logits, 0 tokens, sizes on both sides of
 * moe_align's one-launch limits, both paths (host; device buffers at
 * offsets, poisoned, after a wait-list event), and every validation error
 * leaving every output unchanged. meson runs it once per launch class: the
 * GPU class takes the one kernel up to 5120 slots (641 tokens at top_k 8
 * are past it), the CPU class the two calls. The case "grounded" does the
 * same for moecl_grounded_route_dispatch against moecl_grounded_router
 * followed by moecl_moe_align (the router's reference bounds its weights
 * and fixes its ids). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "internal.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* What moe_align sees of a routing: tokens, top_k, experts. */
typedef struct shape {
    uint32_t tokens, top_k, experts;
} shape;

/* The outputs of one call, with one poisoned element past each end. */
typedef struct outs {
    void *weights; /* of wsize bytes an element (room for 4 each) */
    int32_t *ids, *counts, *sorted, *blocks, *slots;
    int32_t post, invalid;
    size_t n_slots, experts, max_padded, num_blocks, wsize;
    shape sh;
    uint32_t block;
} outs;

/* Shared experts are slots and experts to moe_align. */
static shape topk_shape(const moecl_topk_gating_desc *d)
{
    return (shape){d->num_tokens, d->top_k + d->num_shared_experts, d->num_experts + d->num_shared_experts};
}

static moecl_moe_align_desc align_of(shape d, uint32_t block)
{
    return moecl_moe_align_desc_init(d.tokens, d.top_k, d.experts, block);
}

static void outs_alloc(shape d, uint32_t block, outs *o)
{
    const moecl_moe_align_desc a = align_of(d, block);
    o->sh = d;
    o->block = block;
    o->n_slots = (size_t)d.tokens * d.top_k;
    o->experts = d.experts;
    o->max_padded = (size_t)moecl_moe_align_max_padded(&a);
    o->num_blocks = o->max_padded / block;
    o->wsize = 4;
    o->weights = harness_poisoned((o->n_slots + 1) * 4);
    o->ids = harness_poisoned((o->n_slots + 1) * 4);
    o->counts = harness_poisoned((o->experts + 1) * 4);
    o->sorted = harness_poisoned((o->max_padded + 1) * 4);
    o->blocks = harness_poisoned((o->num_blocks + 1) * 4);
    o->slots = harness_poisoned((o->n_slots + 1) * 4);
    memset(&o->post, HARNESS_POISON, 4);
    memset(&o->invalid, HARNESS_POISON, 4);
    ck_assert(o->weights && o->ids && o->counts && o->sorted && o->blocks && o->slots);
}

/* outs_alloc for top-k's routing of d: weights of d's weights_dtype. */
static void outs_alloc_topk(const moecl_topk_gating_desc *d, uint32_t block, outs *o)
{
    outs_alloc(topk_shape(d), block, o);
    o->wsize = ref_dtype_size(d->weights_dtype);
}

static void outs_free(outs *o)
{
    free(o->weights);
    free(o->ids);
    free(o->counts);
    free(o->sorted);
    free(o->blocks);
    free(o->slots);
}

/* Device buffers of a call: top-k's inputs (gating, bias) or the grounded
 * router's (hidden, logits, ground), the others absent; the outputs,
 * poisoned, at odd offsets. */
typedef struct bufs {
    moecl_buffer gating, bias, hidden, logits, ground, weights, ids, counts, sorted, blocks, post, slots, invalid;
} bufs;

static bufs bufs_outputs(moecl_context *ctx, const outs *o)
{
    bufs b;
    memset(&b, 0, sizeof(b));
    b.weights = harness_buffer(ctx, o->n_slots * o->wsize, 12, NULL);
    b.ids = harness_buffer(ctx, o->n_slots * 4, 256 + 4, NULL);
    b.counts = harness_buffer(ctx, o->experts * 4, 4, NULL);
    b.sorted = harness_buffer(ctx, o->max_padded * 4, 60, NULL);
    b.blocks = harness_buffer(ctx, o->num_blocks * 4, 8, NULL);
    b.post = harness_buffer(ctx, 4, 4, NULL);
    b.slots = harness_buffer(ctx, o->n_slots * 4, 4096 + 4, NULL);
    b.invalid = harness_buffer(ctx, 4, 16, NULL);
    return b;
}

static bufs bufs_make(moecl_context *ctx, const moecl_topk_gating_desc *d, const outs *o, const void *gating,
                      const void *bias)
{
    const size_t gbytes = (size_t)d->num_tokens * d->num_experts * ref_dtype_size(d->gating_dtype);
    bufs b = bufs_outputs(ctx, o);
    b.gating = harness_buffer(ctx, gbytes, 8, gating);
    const size_t bias_bytes = d->num_experts * ref_dtype_size(d->bias_dtype);
    b.bias = bias ? harness_buffer(ctx, bias_bytes, 4, bias) : (moecl_buffer){NULL, 0};
    return b;
}

/* Read every output back with the element past its end, which must stay
 * poison. */
static void bufs_read(moecl_context *ctx, const bufs *b, outs *o, const char *what)
{
    harness_read(ctx, b->weights, o->n_slots * o->wsize + 4, o->weights);
    harness_read(ctx, b->ids, (o->n_slots + 1) * 4, o->ids);
    harness_read(ctx, b->counts, (o->experts + 1) * 4, o->counts);
    harness_read(ctx, b->sorted, (o->max_padded + 1) * 4, o->sorted);
    harness_read(ctx, b->blocks, (o->num_blocks + 1) * 4, o->blocks);
    harness_read(ctx, b->post, 4, &o->post);
    harness_read(ctx, b->slots, (o->n_slots + 1) * 4, o->slots);
    harness_read(ctx, b->invalid, 4, &o->invalid);
    const uint32_t poison = 0xFFFFFFFFu;
    ck_assert_msg(!memcmp((char *)o->weights + o->n_slots * o->wsize, &poison, 4) &&
                      !memcmp(&o->ids[o->n_slots], &poison, 4) &&
                      !memcmp(&o->counts[o->experts], &poison, 4) && !memcmp(&o->sorted[o->max_padded], &poison, 4) &&
                      !memcmp(&o->blocks[o->num_blocks], &poison, 4) && !memcmp(&o->slots[o->n_slots], &poison, 4),
                  "%s: wrote past the end of an output", what);
}

static void bufs_release(bufs *b)
{
    moecl_buffer *all[] = {&b->gating, &b->bias,   &b->hidden, &b->logits, &b->ground, &b->weights, &b->ids,
                           &b->counts, &b->sorted, &b->blocks, &b->post,   &b->slots,  &b->invalid};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(*all[i]);
}

static void wait_done(cl_event before, cl_event done)
{
    ck_assert_ptr_nonnull(done);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    if (before)
        clReleaseEvent(before);
}

/* The call under test, on device buffers (after a marker it must wait on)
 * or on host memory. */
static void run_route(moecl_context *ctx, const moecl_topk_gating_desc *d, uint32_t block, const void *gating,
                      const void *bias, bool device_path, outs *o, const char *what)
{
    moecl_status st;
    if (!device_path) {
        st = moecl_route_dispatch_host(ctx, d, block, gating, bias, o->weights, o->ids, o->counts, o->sorted,
                                       o->blocks, &o->post, o->slots, &o->invalid);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        return;
    }
    bufs b = bufs_make(ctx, d, o, gating, bias);
    cl_event before = NULL, done = NULL;
    ck_assert_int_eq(clEnqueueMarkerWithWaitList(moecl_context_queue(ctx), 0, NULL, &before), CL_SUCCESS);
    st = moecl_route_dispatch(ctx, d, block, b.gating, b.bias, b.weights, b.ids, b.counts, b.sorted, b.blocks, b.post,
                              b.slots, b.invalid, 1, &before, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    wait_done(before, done);
    bufs_read(ctx, &b, o, what);
    bufs_release(&b);
}

/* moe_align on a routing's ids after its event, then every output read
 * back and the buffers released. */
static void run_align_after(moecl_context *ctx, bufs *b, outs *o, cl_event routed, const char *what)
{
    const moecl_moe_align_desc a = align_of(o->sh, o->block);
    cl_event done = NULL;
    moecl_status st =
        moecl_moe_align(ctx, &a, b->ids, b->counts, b->sorted, b->blocks, b->post, b->slots, b->invalid, 1, &routed, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: moe_align: %s: %s", what, moecl_status_string(st),
                  moecl_context_error(ctx));
    wait_done(routed, done);
    bufs_read(ctx, b, o, what);
    bufs_release(b);
}

/* The two calls it stands for, on device buffers. */
static void run_separate(moecl_context *ctx, const moecl_topk_gating_desc *d, const void *gating,
                         const void *bias, outs *o, const char *what)
{
    bufs b = bufs_make(ctx, d, o, gating, bias);
    cl_event routed = NULL;
    moecl_status st = moecl_topk_gating(ctx, d, b.gating, b.bias, b.weights, b.ids, 0, NULL, &routed);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: top-k: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    run_align_after(ctx, &b, o, routed, what);
}

static void assert_same(const outs *x, const outs *y, const char *what)
{
    const size_t n = x->n_slots * 4;
    ck_assert_msg(!memcmp(x->weights, y->weights, x->n_slots * x->wsize), "%s: topk_weights differ from the two calls'",
                  what);
    ck_assert_msg(!memcmp(x->ids, y->ids, n), "%s: topk_ids differ from the two calls'", what);
    ck_assert_msg(!memcmp(x->counts, y->counts, x->experts * 4), "%s: expert_counts differ", what);
    ck_assert_msg(!memcmp(x->sorted, y->sorted, x->max_padded * 4), "%s: sorted_token_ids differ", what);
    ck_assert_msg(!memcmp(x->blocks, y->blocks, x->num_blocks * 4), "%s: block_expert_ids differ", what);
    ck_assert_msg(!memcmp(x->slots, y->slots, n), "%s: slot_positions differ", what);
    ck_assert_msg(x->post == y->post && x->invalid == y->invalid, "%s: num_tokens_post_padded or num_invalid differ",
                  what);
}

/* The dispatch outputs exactly as the reference places the ids the device
 * chose, no invalid slot. */
static void check_dispatch_reference(const outs *o, const char *what)
{
    char msg[600] = "";
    const moecl_moe_align_desc a = align_of(o->sh, o->block);
    const int bad = ref_check_moe_align(&a, o->sh.tokens ? o->ids : NULL, o->counts, o->sorted, o->blocks, &o->post,
                                        o->slots, &o->invalid, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d dispatch elements differ from the reference; first: %s", what, bad, msg);
    ck_assert_int_eq(o->invalid, 0);
}

/* Against the reference: the top-k result as the top-k suite bounds it,
 * the dispatch exactly for the ids the device chose, no invalid slot. */
static void check_reference(const moecl_topk_gating_desc *d, const void *gating, const void *bias, const outs *o,
                            const char *what)
{
    char msg[600] = "";
    if (d->num_tokens > 0) {
        const int rows = ref_check_topk_gating_typed(d, gating, bias, o->weights, o->ids, msg, sizeof(msg));
        ck_assert_msg(rows == 0, "%s: %d bad top-k rows: %s", what, rows, msg);
    }
    check_dispatch_reference(o, what);
}

enum logits { LOGITS_NORMAL, LOGITS_TIES, LOGITS_NONFINITE };

/* Fresh logits of d's dtype: standard normal times 2; or rounded to
 * multiples of 0.5 in [-1, 1] (exact ties everywhere); or normal with NaN,
 * +inf and -inf sprinkled in (and a row of NaN). */
static void *make_logits(harness_rng *rng, const moecl_topk_gating_desc *d, enum logits kind)
{
    const size_t n = (size_t)d->num_tokens * d->num_experts;
    void *g = harness_random_tensor(rng, d->gating_dtype, n ? n : 1, 2.0f);
    for (size_t i = 0; i < n && kind != LOGITS_NORMAL; i++) {
        const uint32_t r = harness_rand_u32(rng);
        if (kind == LOGITS_TIES)
            harness_store(d->gating_dtype, g, i, (float)((int)(r % 5) - 2) * 0.5f);
        else if (i / d->num_experts == 1 || r % 13 == 0)
            harness_store(d->gating_dtype, g, i, i / d->num_experts == 1 || r % 3 == 0 ? NAN : r % 2 ? INFINITY
                                                                                               : -INFINITY);
    }
    return g;
}

/* One case: the call on both paths against the two calls and the
 * reference. */
static void route_case(moecl_context *ctx, const moecl_topk_gating_desc *d, uint32_t block, bool with_bias,
                       enum logits kind, uint64_t stream)
{
    char what[256];
    snprintf(what, sizeof(what),
             "T=%u E=%u k=%u groups=%u/%u dtype=%d scoring=%d gscore=%d fill=%d renorm=%d floor=%g eps=%g scale=%g "
             "bias=%d block=%u logits=%d weights=%d bias_dtype=%d shared=%u/%g",
             d->num_tokens, d->num_experts, d->top_k, d->num_expert_groups, d->topk_group, (int)d->gating_dtype,
             (int)d->scoring, (int)d->group_score, (int)d->group_fill, (int)d->renormalize,
             (double)d->renormalize_floor, (double)d->renormalize_eps, (double)d->routed_scaling_factor, (int)with_bias,
             block, (int)kind, (int)d->weights_dtype, (int)d->bias_dtype, d->num_shared_experts,
             (double)d->shared_expert_weight);
    harness_rng rng = harness_rng_for(stream);
    void *gating = make_logits(&rng, d, kind);
    void *bias = with_bias ? harness_random_tensor(&rng, d->bias_dtype, d->num_experts, 2.0f / (float)d->num_experts)
                           : NULL;
    outs want, got;
    outs_alloc_topk(d, block, &want);
    outs_alloc_topk(d, block, &got);
    run_separate(ctx, d, gating, bias, &want, what);
    for (int path = 0; path < 2; path++) {
        outs_free(&got);
        outs_alloc_topk(d, block, &got);
        run_route(ctx, d, block, gating, bias, path == 1, &got, what);
        if (d->num_tokens == 0) {
            /* No top-k output is written. */
            ck_assert(harness_first_unpoisoned(got.weights, 4) == 4 && harness_first_unpoisoned(got.ids, 4) == 4);
        }
        assert_same(&got, &want, what);
        check_reference(d, gating, bias, &got, what);
    }
    outs_free(&want);
    outs_free(&got);
    free(gating);
    free(bias);
}

/* Every convention of top-k gating, at a decode size and one past
 * moe_align's one-launch limit on the CPU class. */
START_TEST(test_conventions)
{
    moecl_context *ctx = harness_context();
    typedef struct conv {
        uint32_t experts, k, groups, keep;
        moecl_scoring scoring;
        moecl_group_score gscore;
        moecl_group_fill fill;
        bool renorm, bias;
        float floor, scale, eps;
    } conv;
    static const conv convs[] = {
        {128, 8, 0, 0, MOECL_SCORING_SOFTMAX, MOECL_GROUP_SCORE_MAX, MOECL_GROUP_FILL_NEG_INF, false, false, 0, 1, 0},
        {128, 8, 0, 0, MOECL_SCORING_SOFTMAX, MOECL_GROUP_SCORE_MAX, MOECL_GROUP_FILL_NEG_INF, true, true, 0, 2.5f, 0},
        {256, 8, 8, 4, MOECL_SCORING_SIGMOID, MOECL_GROUP_SCORE_TOP2_SUM, MOECL_GROUP_FILL_NEG_INF, true, true, 0,
         2.5f, 0},
        {160, 6, 8, 3, MOECL_SCORING_SOFTMAX, MOECL_GROUP_SCORE_MAX, MOECL_GROUP_FILL_ZERO, false, false, 0, 1, 0},
        {64, 4, 0, 0, MOECL_SCORING_SIGMOID, MOECL_GROUP_SCORE_MAX, MOECL_GROUP_FILL_NEG_INF, true, false,
         6.103515625e-5f, 1, 0},
        {8, 2, 0, 0, MOECL_SCORING_SOFTMAX, MOECL_GROUP_SCORE_MAX, MOECL_GROUP_FILL_NEG_INF, false, true, 0, 0.5f, 0},
        /* DeepSeek-V3 as its model code renormalises: sum + 1e-20 */
        {256, 8, 8, 4, MOECL_SCORING_SIGMOID, MOECL_GROUP_SCORE_TOP2_SUM, MOECL_GROUP_FILL_ZERO, true, true, 0, 2.5f,
         1e-20f},
    };
    static const moecl_dtype dtypes[] = {MOECL_F32, MOECL_F16, MOECL_BF16};
    static const uint32_t blocks[] = {64, 16, 128, 1};
    unsigned i = 0;
    for (size_t c = 0; c < COUNT(convs); c++)
        for (size_t t = 0; t < COUNT(dtypes); t++, i++) {
            if (harness_quick_skips((unsigned)(c + t)))
                continue; /* quick: every convention and every dtype, not every pair */
            const conv *v = &convs[c];
            moecl_topk_gating_desc d = moecl_topk_gating_desc_init(i % 2 ? 129 : 7, v->experts, v->k);
            d.num_expert_groups = v->groups;
            d.topk_group = v->keep;
            d.scoring = v->scoring;
            d.group_score = v->gscore;
            d.group_fill = v->fill;
            d.renormalize = v->renorm;
            d.renormalize_floor = v->floor;
            d.renormalize_eps = v->eps;
            d.routed_scaling_factor = v->scale;
            d.gating_dtype = dtypes[t];
            route_case(ctx, &d, blocks[i % COUNT(blocks)], v->bias, LOGITS_NORMAL, 100 + i);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Sizes from 0 tokens through decode batches (up to 1024 slots) to past
 * moe_align's one-launch limits (8192 slots on CPUs, 5120 on GPUs). */
START_TEST(test_sizes)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {0, 1, 128, 129, 256, 641, 1025, 4096};
    for (size_t t = 0; t < COUNT(tokens); t++) {
        if (harness_quick() && tokens[t] > 1025)
            continue;
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens[t], 128, 8);
        route_case(ctx, &d, 64, t % 2 == 1, LOGITS_NORMAL, 200 + t);
    }
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(0, 4096, 2);
    route_case(ctx, &d, 128, false, LOGITS_NORMAL, 250);
    moecl_context_destroy(ctx);
}
END_TEST

/* The override's align=fused-parallel: the one kernel (GPU class) up to
 * its forced limit, 8192 slots (1024 tokens at top 8), the two calls with
 * moe_align's parallel kernel beyond it and in the CPU class; the
 * benchmark's decode sizes and sizes at and across the limit. */
START_TEST(test_fused_parallel)
{
    harness_override_with("align=fused-parallel");
    moecl_context *ctx = harness_context();
    harness_override_with(NULL);
    static const uint32_t tokens[] = {1, 129, 256, 520, 1019, 1024, 1025};
    for (size_t t = 0; t < COUNT(tokens); t++) {
        if (harness_quick() && tokens[t] > 256 && tokens[t] != 1024)
            continue;
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens[t], 128, 8);
        route_case(ctx, &d, 64, t % 2 == 1, LOGITS_NORMAL, 1400 + t);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Exact ties (to the lower index) and NaN / inf logits: the ids stay
 * distinct and in range, so num_invalid is 0, and both paths agree with
 * the two calls bit for bit. */
START_TEST(test_ties_nonfinite)
{
    moecl_context *ctx = harness_context();
    for (int kind = LOGITS_TIES; kind <= LOGITS_NONFINITE; kind++)
        for (int s = 0; s < 2; s++) {
            moecl_topk_gating_desc d = moecl_topk_gating_desc_init(65, 32, 4);
            d.scoring = s ? MOECL_SCORING_SIGMOID : MOECL_SCORING_SOFTMAX;
            d.renormalize = s == 1;
            d.gating_dtype = kind == LOGITS_TIES ? MOECL_BF16 : MOECL_F32;
            route_case(ctx, &d, 16, s == 1, (enum logits)kind, 300 + kind * 2 + s);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* DeepSeek-V3's routing with every weights_dtype and every bias (none,
 * f32, f16, bf16) at a decode size (the one kernel on the GPU class) and
 * past the one kernel's limit (the two calls): the same bits as top-k
 * then moe_align, the reference's weights within the rounding. Exact
 * ties and NaN / inf logits with 16-bit weights and a bf16 bias. int64
 * ids are refused (test_bad_input). */
START_TEST(test_out_dtypes)
{
    moecl_context *ctx = harness_context();
    unsigned i = 0;
    for (int wt = 0; wt < 3; wt++)
        for (int bt = -1; bt < 3; bt++, i++) {
            moecl_topk_gating_desc d;
            ck_assert_int_eq(moecl_topk_gating_desc_preset("deepseek-v3", i % 2 ? 7 : 641, &d), MOECL_SUCCESS);
            d.weights_dtype = (moecl_dtype)wt;
            d.bias_dtype = bt < 0 ? MOECL_F32 : (moecl_dtype)bt;
            d.gating_dtype = (moecl_dtype)(i % 3);
            route_case(ctx, &d, 16, bt >= 0, LOGITS_NORMAL, 500 + i);
        }
    for (int kind = LOGITS_TIES; kind <= LOGITS_NONFINITE; kind++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(65, 32, 4);
        d.weights_dtype = kind == LOGITS_TIES ? MOECL_BF16 : MOECL_F16;
        d.bias_dtype = MOECL_BF16;
        route_case(ctx, &d, 16, true, (enum logits)kind, 520 + kind);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Shared experts (num_shared_experts): top_k + S slots a token aligned
 * over num_experts + S experts, the same bits as top-k then moe_align,
 * in the one kernel (decode sizes, GPU class) and the two calls: the
 * DeepSeek-V3 preset with SGLang's shared weight 1 / 2.5 and bf16 weights,
 * softmax with S = 2 on exact ties. */
START_TEST(test_shared_experts)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {7, 641};
    for (size_t t = 0; t < COUNT(tokens); t++) {
        moecl_topk_gating_desc d;
        ck_assert_int_eq(moecl_topk_gating_desc_preset("deepseek-v3", tokens[t], &d), MOECL_SUCCESS);
        d.num_shared_experts = 1;
        d.shared_expert_weight = 1.0f / d.routed_scaling_factor;
        d.weights_dtype = t ? MOECL_BF16 : MOECL_F32;
        route_case(ctx, &d, 16, true, LOGITS_NORMAL, 540 + t);
    }
    moecl_topk_gating_desc d = moecl_topk_gating_desc_init(65, 32, 4);
    d.num_shared_experts = 2;
    d.shared_expert_weight = 0.5f;
    route_case(ctx, &d, 16, false, LOGITS_TIES, 545);
    moecl_context_destroy(ctx);
}
END_TEST

/* body on a context that adopted an out-of-order queue, where the
 * device has one. */
static void on_out_of_order_queue(const char *name, void (*body)(moecl_context *ctx))
{
    moecl_context *own = harness_context();
    cl_context cl = moecl_context_cl_context(own);
    cl_device_id dev = moecl_context_device(own);
    cl_command_queue_properties props = 0;
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_QUEUE_PROPERTIES, sizeof(props), &props, NULL), CL_SUCCESS);
    if (props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) {
        cl_int err;
        cl_command_queue ooo = clCreateCommandQueue(cl, dev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
        moecl_context *ctx = NULL;
        ck_assert_int_eq(moecl_context_create_from_cl(cl, dev, ooo, &ctx), MOECL_SUCCESS);
        body(ctx);
        moecl_context_destroy(ctx);
        ck_assert_int_eq(clFinish(ooo), CL_SUCCESS);
        clReleaseCommandQueue(ooo);
    } else {
        fprintf(stderr, "%s: the device has no out-of-order queue; not run\n", name);
    }
    moecl_context_destroy(own);
}

/* The one kernel after its fill (a new scratch each call), and the two
 * calls ordered by the top-k kernel's event. */
static void out_of_order_cases(moecl_context *ctx)
{
    static const uint32_t tokens[] = {1, 129, 641};
    for (size_t t = 0; t < COUNT(tokens); t++) {
        moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens[t], 128, 8);
        route_case(ctx, &d, 64, t == 1, LOGITS_NORMAL, 350 + t);
    }
}

START_TEST(test_out_of_order)
{
    on_out_of_order_queue("test_out_of_order", out_of_order_cases);
}
END_TEST

/* Every validation error, on both paths: the call fails with
 * MOECL_ERROR_INVALID_ARGUMENT and no output byte changes. */
static const moecl_topk_gating_desc *bad_input_desc(void)
{
    static moecl_topk_gating_desc d;
    d = moecl_topk_gating_desc_init(16, 64, 8);
    return &d;
}
#define BAD_INPUT_BLOCK 64u

static void expect_invalid(moecl_context *ctx, moecl_status st, const bufs *b, const outs *o, const char *what)
{
    ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: got %s", what, moecl_status_string(st));
    ck_assert_msg(moecl_context_error(ctx)[0] != '\0', "%s: no message", what);
    if (!b)
        return;
    outs after;
    outs_alloc(o->sh, o->block, &after);
    bufs_read(ctx, b, &after, what);
    const size_t sizes[] = {o->n_slots * 4, o->n_slots * 4, o->experts * 4, o->max_padded * 4, o->num_blocks * 4, 4,
                            o->n_slots * 4, 4};
    const void *data[] = {after.weights, after.ids, after.counts, after.sorted, after.blocks, &after.post, after.slots,
                          &after.invalid};
    for (size_t i = 0; i < COUNT(sizes); i++)
        ck_assert_msg(harness_first_unpoisoned(data[i], sizes[i]) == sizes[i], "%s: output %zu changed", what, i);
    outs_free(&after);
}

/* A call of either function on device buffers, for the checks below. */
typedef moecl_status (*route_call)(moecl_context *ctx, const void *desc, uint32_t block, const bufs *b);

static moecl_status call_topk(moecl_context *ctx, const void *desc, uint32_t block, const bufs *b)
{
    return moecl_route_dispatch(ctx, desc, block, b->gating, b->bias, b->weights, b->ids, b->counts, b->sorted,
                                b->blocks, b->post, b->slots, b->invalid, 0, NULL, NULL);
}

static moecl_status call_grounded(moecl_context *ctx, const void *desc, uint32_t block, const bufs *b)
{
    return moecl_grounded_route_dispatch(ctx, desc, block, b->hidden, b->logits, b->ground, b->weights, b->ids,
                                         b->counts, b->sorted, b->blocks, b->post, b->slots, b->invalid, 0, NULL,
                                         NULL);
}

/* Each buffer of b the call takes (required[i] >= 0, in bufs' field
 * order) absent where required (1), misaligned, and too small: the call
 * fails and no output changes. */
#define BUFS_FIELDS 13
static void each_bad_buffer(moecl_context *ctx, route_call call, const void *desc, uint32_t block, const bufs *b,
                            const outs *o, const int required[BUFS_FIELDS])
{
    char what[64];
    for (size_t i = 0; i < BUFS_FIELDS; i++)
        for (int kind = 0; kind < 3; kind++) {
            if (required[i] < 0 || (kind == 0 && !required[i]))
                continue;
            bufs x = *b;
            moecl_buffer *xs[BUFS_FIELDS] = {&x.gating, &x.bias,    &x.hidden, &x.logits, &x.ground,
                                             &x.weights, &x.ids,    &x.counts, &x.sorted, &x.blocks,
                                             &x.post,    &x.slots,  &x.invalid};
            moecl_buffer *m = xs[i];
            if (kind == 1 && !m->mem)
                continue; /* an absent buffer has no offset to misalign */
            moecl_buffer small = {NULL, 0};
            if (kind == 0)
                m->mem = NULL;
            else if (kind == 1)
                m->offset += 2; /* misaligned */
            else {
                cl_int err;
                small.mem = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 2, NULL, &err);
                ck_assert_int_eq(err, CL_SUCCESS);
                *m = small; /* too small for any tensor */
            }
            snprintf(what, sizeof(what), "buffer %zu, kind %d", i, kind);
            expect_invalid(ctx, call(ctx, desc, block, &x), b, o, what);
            harness_release(small);
        }
}

START_TEST(test_bad_input)
{
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc good = *bad_input_desc();
    const uint32_t block = BAD_INPUT_BLOCK;
    harness_rng rng = harness_rng_for(400);
    void *gating = harness_random_tensor(&rng, MOECL_F32, 16 * 64, 2.0f);
    outs o;
    outs_alloc(topk_shape(&good), block, &o);
    bufs b = bufs_make(ctx, &good, &o, gating, NULL);
    /* Each descriptor field out of range, then block_size. */
    moecl_topk_gating_desc bad[16];
    for (size_t i = 0; i < COUNT(bad); i++)
        bad[i] = good;
    bad[0].num_experts = 0;
    bad[1].num_experts = 4097;
    bad[2].top_k = 0;
    bad[3].top_k = 65;
    bad[4].num_expert_groups = 3;
    bad[4].topk_group = 1;
    bad[5].topk_group = 1;
    bad[6].gating_dtype = (moecl_dtype)7;
    bad[7].scoring = (moecl_scoring)4;
    bad[8].group_score = (moecl_group_score)2;
    bad[9].routed_scaling_factor = NAN;
    bad[10].renormalize_floor = 1e-40f;
    bad[11].group_fill = (moecl_group_fill)2;
    bad[12].weights_dtype = (moecl_dtype)3;
    bad[13].ids_dtype = (moecl_index_dtype)2;
    bad[14].bias_dtype = (moecl_dtype)3;
    bad[15].ids_dtype = MOECL_I64; /* valid for top-k, not here: moe_align reads int32 ids */
    char what[64];
    for (size_t i = 0; i < COUNT(bad); i++) {
        snprintf(what, sizeof(what), "descriptor case %zu", i);
        expect_invalid(ctx,
                       moecl_route_dispatch(ctx, &bad[i], block, b.gating, b.bias, b.weights, b.ids, b.counts,
                                            b.sorted, b.blocks, b.post, b.slots, b.invalid, 0, NULL, NULL),
                       &b, &o, what);
        expect_invalid(ctx,
                       moecl_route_dispatch_host(ctx, &bad[i], block, gating, NULL, o.weights, o.ids, o.counts,
                                                 o.sorted, o.blocks, &o.post, o.slots, &o.invalid),
                       NULL, &o, what);
    }
    static const uint32_t bad_blocks[] = {0, 1025};
    for (size_t i = 0; i < COUNT(bad_blocks); i++)
        expect_invalid(ctx,
                       moecl_route_dispatch(ctx, &good, bad_blocks[i], b.gating, b.bias, b.weights, b.ids, b.counts,
                                            b.sorted, b.blocks, b.post, b.slots, b.invalid, 0, NULL, NULL),
                       &b, &o, "block_size");
    moecl_topk_gating_desc huge = moecl_topk_gating_desc_init(300000000u, 64, 8);
    expect_invalid(ctx,
                   moecl_route_dispatch(ctx, &huge, block, b.gating, b.bias, b.weights, b.ids, b.counts, b.sorted,
                                        b.blocks, b.post, b.slots, b.invalid, 0, NULL, NULL),
                   &b, &o, "num_tokens * top_k past INT32_MAX");
    expect_invalid(ctx,
                   moecl_route_dispatch(ctx, NULL, block, b.gating, b.bias, b.weights, b.ids, b.counts, b.sorted,
                                        b.blocks, b.post, b.slots, b.invalid, 0, NULL, NULL),
                   &b, &o, "desc NULL");
    /* Each buffer absent (where required), too small, misaligned. */
    static const int required[BUFS_FIELDS] = {1, 0, -1, -1, -1, 1, 1, 1, 1, 1, 1, 0, 0};
    each_bad_buffer(ctx, call_topk, &good, block, &b, &o, required);
    /* A wait count without a list; NULL host outputs. */
    expect_invalid(ctx,
                   moecl_route_dispatch(ctx, &good, block, b.gating, b.bias, b.weights, b.ids, b.counts, b.sorted,
                                        b.blocks, b.post, b.slots, b.invalid, 1, NULL, NULL),
                   &b, &o, "num_wait without wait");
    expect_invalid(ctx,
                   moecl_route_dispatch_host(ctx, &good, block, gating, NULL, o.weights, o.ids, NULL, o.sorted,
                                             o.blocks, &o.post, NULL, NULL),
                   NULL, &o, "host expert_counts NULL");
    expect_invalid(ctx,
                   moecl_route_dispatch_host(ctx, &good, block, NULL, NULL, o.weights, o.ids, o.counts, o.sorted,
                                             o.blocks, &o.post, NULL, NULL),
                   NULL, &o, "host gating NULL");
    ck_assert_int_eq(moecl_route_dispatch_host(NULL, &good, block, gating, NULL, o.weights, o.ids, o.counts,
                                               o.sorted, o.blocks, &o.post, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    /* The host outputs were never written. */
    ck_assert(harness_first_unpoisoned(o.weights, o.n_slots * 4) == o.n_slots * 4);
    ck_assert(harness_first_unpoisoned(o.counts, o.experts * 4) == o.experts * 4);
    bufs_release(&b);
    outs_free(&o);
    free(gating);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- moecl_route_dispatch_ex ------------------------------------------ */

/* The optional tensors of a case: a valid count (or none), a load counter,
 * a global-to-local map over `local` experts. */
typedef struct ex_opts {
    bool has_valid, has_load, has_map;
    int32_t valid;
    uint32_t local;
} ex_opts;

/* The inputs of a case: logits, a bias or none, a map (each global expert
 * local or -1), a load counter's starting values. */
typedef struct ex_in {
    void *gating, *bias;
    int32_t *map, *load;
} ex_in;

/* moe_align's view of an ex call: the local experts and the map's length. */
static moecl_moe_align_desc ex_align(const moecl_topk_gating_desc *d, const ex_opts *x, uint32_t block)
{
    moecl_moe_align_desc a = moecl_moe_align_desc_init(d->num_tokens, d->top_k, x->has_map ? x->local : d->num_experts,
                                                       block);
    a.num_global_experts = x->has_map ? d->num_experts : 0;
    return a;
}

/* The load counter's entries: by expert id, or by local expert with a map. */
static size_t ex_load_len(const moecl_topk_gating_desc *d, const ex_opts *x)
{
    return x->has_map ? x->local : d->num_experts;
}

static void ex_outs_alloc(const moecl_topk_gating_desc *d, const ex_opts *x, uint32_t block, outs *o)
{
    outs_alloc((shape){d->num_tokens, d->top_k, x->has_map ? x->local : d->num_experts}, block, o);
    o->wsize = ref_dtype_size(d->weights_dtype);
}

/* Device buffers of an ex call: outs' outputs at their offsets, the
 * inputs, and the optional tensors at offsets of their own. */
typedef struct ex_bufs {
    bufs b;
    moecl_buffer load, valid, map;
} ex_bufs;

static ex_bufs ex_bufs_make(moecl_context *ctx, const moecl_topk_gating_desc *d, const ex_opts *x, const outs *o,
                            const ex_in *in)
{
    ex_bufs e;
    e.b = bufs_outputs(ctx, o);
    const size_t experts = d->num_experts;
    e.b.gating = harness_buffer(ctx, d->num_tokens * experts * ref_dtype_size(d->gating_dtype), 8, in->gating);
    e.b.bias = in->bias ? harness_buffer(ctx, experts * ref_dtype_size(d->bias_dtype), 4, in->bias)
                        : (moecl_buffer){NULL, 0};
    e.load = x->has_load ? harness_buffer(ctx, ex_load_len(d, x) * 4, 12, in->load) : (moecl_buffer){NULL, 0};
    e.valid = x->has_valid ? harness_buffer(ctx, 4, 20, &x->valid) : (moecl_buffer){NULL, 0};
    e.map = x->has_map ? harness_buffer(ctx, experts * 4, 36, in->map) : (moecl_buffer){NULL, 0};
    return e;
}

static moecl_route_dispatch_tensors ex_tensors(const ex_bufs *e, const ex_opts *x)
{
    moecl_route_dispatch_tensors t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    t.gating = e->b.gating;
    t.bias = e->b.bias;
    t.topk_weights = e->b.weights;
    t.topk_ids = e->b.ids;
    t.expert_counts = e->b.counts;
    t.sorted_token_ids = e->b.sorted;
    t.block_expert_ids = e->b.blocks;
    t.num_tokens_post_padded = e->b.post;
    t.slot_positions = e->b.slots;
    t.num_invalid = e->b.invalid;
    t.expert_load = e->load;
    t.num_valid_tokens = e->valid;
    t.expert_map = e->map;
    t.num_local_experts = x->has_map ? x->local : 0;
    return t;
}

static void ex_bufs_release(ex_bufs *e)
{
    bufs_release(&e->b);
    harness_release(e->load);
    harness_release(e->valid);
    harness_release(e->map);
}

/* What the call stands for: moecl_topk_gating_ex (valid count, load) then
 * moecl_moe_align_ex (map), on device buffers; *load gets the counter.
 * top-k's load is by expert id: with a map the load by local expert is
 * counted here from the ids instead. */
static void ex_run_separate(moecl_context *ctx, const moecl_topk_gating_desc *d, uint32_t block, const ex_opts *x,
                            const ex_in *in, outs *o, int32_t *load, const char *what)
{
    ex_bufs e = ex_bufs_make(ctx, d, x, o, in);
    moecl_topk_gating_tensors t;
    memset(&t, 0, sizeof(t));
    t.struct_size = sizeof(t);
    t.gating = e.b.gating;
    t.bias = e.b.bias;
    t.topk_weights = e.b.weights;
    t.topk_ids = e.b.ids;
    t.expert_load = x->has_map ? (moecl_buffer){NULL, 0} : e.load;
    t.num_valid_tokens = e.valid;
    cl_event routed = NULL, done = NULL;
    moecl_status st = moecl_topk_gating_ex(ctx, d, &t, 0, NULL, &routed);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: top-k ex: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    const moecl_moe_align_desc a = ex_align(d, x, block);
    const moecl_moe_align_tensors at = {sizeof(at), e.b.ids,   e.b.counts, e.b.sorted, e.b.blocks,
                                        e.b.post,   e.b.slots, e.b.invalid, e.map};
    st = moecl_moe_align_ex(ctx, &a, &at, 1, &routed, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: moe_align ex: %s: %s", what, moecl_status_string(st),
                  moecl_context_error(ctx));
    wait_done(routed, done);
    bufs_read(ctx, &e.b, o, what);
    if (x->has_load && !x->has_map)
        harness_read(ctx, e.load, ex_load_len(d, x) * 4, load);
    if (x->has_load && x->has_map) {
        memcpy(load, in->load, ex_load_len(d, x) * 4);
        for (size_t s = 0; s < o->n_slots; s++)
            if (o->ids[s] >= 0 && (uint32_t)o->ids[s] < d->num_experts && (uint32_t)in->map[o->ids[s]] < x->local)
                load[in->map[o->ids[s]]]++;
    }
    ex_bufs_release(&e);
}

/* The call under test, twice on the same buffers (the second must write
 * the same outputs and add to the load again): on device buffers after a
 * marker it must wait on, or on host memory. */
static void ex_run(moecl_context *ctx, const moecl_topk_gating_desc *d, uint32_t block, const ex_opts *x,
                   const ex_in *in, bool device_path, outs *o, int32_t *load, const char *what)
{
    const size_t loads = ex_load_len(d, x);
    if (!device_path) {
        if (x->has_load)
            memcpy(load, in->load, loads * 4);
        for (int call = 0; call < 2; call++) {
            const moecl_route_dispatch_host_tensors h = {
                sizeof(h),       in->gating, in->bias,        o->weights,
                o->ids,          o->counts,  o->sorted,       o->blocks,
                &o->post,        o->slots,   &o->invalid,     x->has_load ? load : NULL,
                x->has_valid ? &x->valid : NULL, x->has_map ? in->map : NULL, x->has_map ? x->local : 0};
            const moecl_status st = moecl_route_dispatch_ex_host(ctx, d, block, &h);
            ck_assert_msg(st == MOECL_SUCCESS, "%s: host: %s: %s", what, moecl_status_string(st),
                          moecl_context_error(ctx));
        }
        return;
    }
    ex_bufs e = ex_bufs_make(ctx, d, x, o, in);
    const moecl_route_dispatch_tensors t = ex_tensors(&e, x);
    for (int call = 0; call < 2; call++) {
        cl_event before = NULL, done = NULL;
        ck_assert_int_eq(clEnqueueMarkerWithWaitList(moecl_context_queue(ctx), 0, NULL, &before), CL_SUCCESS);
        const moecl_status st = moecl_route_dispatch_ex(ctx, d, block, &t, 1, &before, &done);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        wait_done(before, done);
    }
    bufs_read(ctx, &e.b, o, what);
    if (x->has_load)
        harness_read(ctx, e.load, loads * 4, load);
    ex_bufs_release(&e);
}

/* Against the float64 reference: the rows below the valid count as the
 * top-k suite bounds them, the rows past it id -1 and weight +0, the
 * dispatch exactly as ref_moe_align_map places the ids chosen, and the
 * load its start plus `calls` times the valid rows' ids (by local expert
 * with a map: the ids the map takes into [0, local)). */
static void ex_check_reference(const moecl_topk_gating_desc *d, uint32_t block, const ex_opts *x, const ex_in *in,
                               const outs *o, const int32_t *load, int calls, const char *what)
{
    const uint32_t t = d->num_tokens, k = d->top_k;
    const uint32_t n = !x->has_valid ? t : x->valid <= 0 ? 0 : (uint32_t)x->valid < t ? (uint32_t)x->valid : t;
    char msg[600] = "";
    if (n > 0) {
        moecl_topk_gating_desc dn = *d;
        dn.num_tokens = n;
        const int rows = ref_check_topk_gating_typed(&dn, in->gating, in->bias, o->weights, o->ids, msg, sizeof(msg));
        ck_assert_msg(rows == 0, "%s: %d bad top-k rows: %s", what, rows, msg);
    }
    for (size_t s = (size_t)n * k; s < (size_t)t * k; s++) {
        ck_assert_msg(o->ids[s] == -1, "%s: padding slot %zu has id %d", what, s, o->ids[s]);
        for (size_t b = 0; b < o->wsize; b++)
            ck_assert_msg(((const unsigned char *)o->weights)[s * o->wsize + b] == 0, "%s: padding slot %zu's weight",
                          what, s);
    }
    const moecl_moe_align_desc a = ex_align(d, x, block);
    const int bad = ref_check_moe_align_map(&a, t ? o->ids : NULL, x->has_map ? in->map : NULL, o->counts, o->sorted,
                                            o->blocks, &o->post, o->slots, &o->invalid, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d dispatch elements differ from the reference; first: %s", what, bad, msg);
    if (!x->has_load)
        return;
    for (uint32_t e = 0; e < ex_load_len(d, x); e++) {
        int64_t want = 0;
        for (size_t s = 0; s < (size_t)n * k; s++) {
            const int32_t id = o->ids[s];
            want += x->has_map ? id >= 0 && (uint32_t)id < d->num_experts && in->map[id] == (int32_t)e
                               : id == (int32_t)e;
        }
        ck_assert_msg(load[e] == in->load[e] + calls * want, "%s: expert_load[%u] is %d, want %d + %d * %lld", what,
                      e, load[e], in->load[e], calls, (long long)want);
    }
}

/* A map over d's experts: about half local (each local expert at least
 * once where there are enough), the rest -1. */
static int32_t *ex_make_map(harness_rng *rng, uint32_t experts, uint32_t local)
{
    int32_t *map = malloc(experts * 4);
    ck_assert_ptr_nonnull(map);
    for (uint32_t g = 0; g < experts; g++) {
        const uint32_t r = harness_rand_u32(rng);
        map[g] = r % 2 ? -1 : (int32_t)(g / 2 < local ? g / 2 : r % local);
    }
    return map;
}

static void ex_case(moecl_context *ctx, const moecl_topk_gating_desc *d, uint32_t block, bool with_bias,
                    enum logits kind, const ex_opts *x, uint64_t stream)
{
    char what[256];
    snprintf(what, sizeof(what),
             "ex T=%u E=%u k=%u dtype=%d weights=%d scoring=%d bias=%d block=%u logits=%d valid=%s%d load=%d map=%d "
             "local=%u", d->num_tokens, d->num_experts, d->top_k, (int)d->gating_dtype, (int)d->weights_dtype,
             (int)d->scoring, (int)with_bias, block, (int)kind, x->has_valid ? "" : "absent/", x->valid,
             (int)x->has_load, (int)x->has_map, x->local);
    harness_rng rng = harness_rng_for(stream);
    ex_in in;
    in.gating = make_logits(&rng, d, kind);
    in.bias = with_bias ? harness_random_tensor(&rng, d->bias_dtype, d->num_experts, 2.0f / (float)d->num_experts)
                        : NULL;
    in.map = x->has_map ? ex_make_map(&rng, d->num_experts, x->local) : NULL;
    const size_t loads = ex_load_len(d, x);
    in.load = malloc(loads * 4);
    int32_t *want_load = malloc(loads * 4), *got_load = malloc(loads * 4);
    ck_assert(in.load && want_load && got_load);
    for (size_t e = 0; e < loads; e++)
        in.load[e] = (int32_t)(harness_rand_u32(&rng) % 1000);
    outs want, got;
    ex_outs_alloc(d, x, block, &want);
    ex_run_separate(ctx, d, block, x, &in, &want, want_load, what);
    ex_check_reference(d, block, x, &in, &want, want_load, 1, what);
    /* Two calls add twice what the composition added once. */
    for (size_t e = 0; x->has_load && e < loads; e++)
        want_load[e] += want_load[e] - in.load[e];
    for (int path = 0; path < 2; path++) {
        ex_outs_alloc(d, x, block, &got);
        ex_run(ctx, d, block, x, &in, path == 1, &got, got_load, what);
        assert_same(&got, &want, what);
        ck_assert_msg(!x->has_load || !memcmp(got_load, want_load, loads * 4),
                      "%s: expert_load differs from two compositions'", what);
        ex_check_reference(d, block, x, &in, &got, got_load, 2, what);
        outs_free(&got);
    }
    outs_free(&want);
    free(in.gating);
    free(in.bias);
    free(in.map);
    free(in.load);
    free(want_load);
    free(got_load);
}

/* Valid counts 0, mid-batch, num_tokens and past it, negative and absent;
 * a load counter over two calls; maps with -1 entries over 16 or 3 local
 * experts; normal logits, exact ties and NaN / inf rows; every gating and
 * weights dtype; 7 and 129 tokens (the one kernel on the GPU class, the
 * map's calls the two calls) and 700 at top_k 8 (past the one kernel). */
START_TEST(test_ex)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {7, 129, 700};
    static const ex_opts opts[] = {
        {false, true, false, 0, 0},  {true, true, false, -1, 0}, {true, false, true, 0, 16},
        {true, true, false, -2, 0},  {true, true, true, -3, 3},  {true, true, false, -4, 0},
        {false, false, true, 0, 16}, {true, true, true, -1, 16}, {false, true, true, 0, 5},
    };
    unsigned i = 0;
    for (size_t t = 0; t < COUNT(tokens); t++)
        for (size_t o = 0; o < COUNT(opts); o++, i++) {
            if (harness_quick_skips(i))
                continue;
            ex_opts x = opts[o];
            /* -1: mid-batch; -2: num_tokens; -4: past it; 0 and -3 as they are. */
            x.valid = x.valid == -1 ? (int32_t)(tokens[t] / 2 + 1)
                      : x.valid == -2 ? (int32_t)tokens[t]
                      : x.valid == -4 ? (int32_t)tokens[t] + 5
                                      : x.valid;
            moecl_topk_gating_desc d = moecl_topk_gating_desc_init(tokens[t], i % 2 ? 64 : 128, i % 3 ? 8 : 4);
            d.gating_dtype = (moecl_dtype)(i % 3);
            d.weights_dtype = (moecl_dtype)((i / 3) % 3);
            /* NaN rows of 16-bit logits: the one kernel's NaN weights and
             * top-k's kernel's differ in their sign bit (moecl_route_dispatch's
             * too), so NaN rows come in f32 logits here. */
            if (i % 3 == LOGITS_NONFINITE)
                d.gating_dtype = MOECL_F32;
            d.scoring = i % 4 == 3 ? MOECL_SCORING_SIGMOID : MOECL_SCORING_SOFTMAX;
            d.renormalize = i % 4 == 3;
            ex_case(ctx, &d, i % 2 ? 16 : 64, i % 5 == 1, (enum logits)(i % 3), &x, 900 + i);
        }
    /* DeepSeek-V3's routing (groups, bias, sigmoid) with a map and a valid count. */
    moecl_topk_gating_desc d;
    ck_assert_int_eq(moecl_topk_gating_desc_preset("deepseek-v3", 33, &d), MOECL_SUCCESS);
    const ex_opts ds = {true, true, true, 20, 32};
    ex_case(ctx, &d, 16, true, LOGITS_NORMAL, &ds, 990);
    const ex_opts ds_load = {true, true, false, 20, 0};
    ex_case(ctx, &d, 16, true, LOGITS_TIES, &ds_load, 991);
    moecl_context_destroy(ctx);
}
END_TEST

/* moecl_route_dispatch_ex's own validation, on both entry points: the
 * call fails and no output byte (nor the load) changes. */
START_TEST(test_ex_bad_input)
{
    moecl_context *ctx = harness_context();
    const moecl_topk_gating_desc good = *bad_input_desc();
    const uint32_t block = BAD_INPUT_BLOCK;
    harness_rng rng = harness_rng_for(950);
    ex_in in = {harness_random_tensor(&rng, MOECL_F32, 16 * 64, 2.0f), NULL, ex_make_map(&rng, 64, 8),
                calloc(64, 4)};
    const ex_opts x = {true, true, true, 9, 8};
    outs o;
    ex_outs_alloc(&good, &x, block, &o);
    ex_bufs e = ex_bufs_make(ctx, &good, &x, &o, &in);
    harness_release(e.load);
    e.load = harness_buffer(ctx, 64 * 4, 12, NULL); /* poisoned: must stay so */
    const moecl_route_dispatch_tensors base = ex_tensors(&e, &x);
    moecl_buffer small = {NULL, 0};
    cl_int err;
    small.mem = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 2, NULL, &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    /* Room for the 8 local experts' load, not for the 64 experts'. */
    moecl_buffer load8 = harness_buffer(ctx, 8 * 4, 0, NULL);
    enum { CASES = 12 };
    for (int c = 0; c < CASES; c++) {
        moecl_route_dispatch_tensors t = base;
        const char *what = "";
        switch (c) {
        case 0: t.struct_size = 0; what = "struct_size 0"; break;
        case 1: t.struct_size = sizeof(t) + 8; what = "struct_size too big"; break;
        case 2: t.struct_size = offsetof(moecl_route_dispatch_tensors, expert_map); what = "struct_size short"; break;
        case 3: t.num_local_experts = 0; what = "map without num_local_experts"; break;
        case 4: t.expert_map = (moecl_buffer){NULL, 0}; what = "num_local_experts without a map"; break;
        case 5: t.num_local_experts = 4097; what = "num_local_experts 4097"; break;
        case 6: t.expert_map = small; what = "expert_map too small"; break;
        case 7: t.num_valid_tokens.offset += 2; what = "num_valid_tokens misaligned"; break;
        case 8: t.expert_load = small; what = "expert_load too small for the local experts"; break;
        case 9: t.num_valid_tokens = small; what = "num_valid_tokens too small"; break;
        case 10: t.expert_map = (moecl_buffer){NULL, 0}; t.num_local_experts = 0; t.expert_load = load8;
                 what = "expert_load too small for the experts"; break;
        default: t.expert_map.offset += 1; what = "expert_map misaligned"; break;
        }
        expect_invalid(ctx, moecl_route_dispatch_ex(ctx, &good, block, &t, 0, NULL, NULL), &e.b, &o, what);
    }
    expect_invalid(ctx, moecl_route_dispatch_ex(ctx, &good, block, NULL, 0, NULL, NULL), &e.b, &o, "tensors NULL");
    int32_t load[64];
    harness_read(ctx, e.load, 64 * 4, load);
    ck_assert(harness_first_unpoisoned(load, 64 * 4) == 64 * 4);
    /* The host form: struct_size, the map and its count, a required output. */
    for (int c = 0; c < 5; c++) {
        moecl_route_dispatch_host_tensors h = {sizeof(h), in.gating, NULL,     o.weights,  o.ids,   o.counts,
                                               o.sorted,  o.blocks,  &o.post,  o.slots,    &o.invalid, in.load,
                                               &x.valid,  in.map,    x.local};
        if (c == 0)
            h.struct_size = 8;
        else if (c == 1)
            h.num_local_experts = 0;
        else if (c == 2)
            h.expert_map = NULL;
        else if (c == 3)
            h.expert_counts = NULL;
        else
            h.num_local_experts = 4097;
        const moecl_status st = moecl_route_dispatch_ex_host(ctx, &good, block, &h);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "host case %d: %s", c,
                      moecl_status_string(st));
    }
    ck_assert_int_eq(moecl_route_dispatch_ex_host(ctx, &good, block, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert(harness_first_unpoisoned(o.weights, o.n_slots * 4) == o.n_slots * 4);
    ck_assert(harness_first_unpoisoned(o.counts, o.experts * 4) == o.experts * 4);
    for (int i = 0; i < 64; i++)
        ck_assert_int_eq(in.load[i], 0);
    harness_release(small);
    harness_release(load8);
    ex_bufs_release(&e);
    outs_free(&o);
    free(in.gating);
    free(in.map);
    free(in.load);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- moecl_grounded_route_dispatch ----------------------------------- */

static shape grounded_shape(const moecl_grounded_router_desc *d)
{
    return (shape){d->num_tokens, d->top_k + d->num_shared_experts, d->num_experts + d->num_shared_experts};
}

typedef struct grounded_in {
    void *hidden, *ground;
    float *logits;
} grounded_in;

/* Fresh inputs scaled like a model's (hidden states of RMS 1 / sqrt(H),
 * so that the dot products are of order one); with ties, a zero ground
 * table and logits that are multiples of 0.5 in [-1, 1], so that every g
 * ties exactly with others. */
static grounded_in grounded_inputs(harness_rng *rng, const moecl_grounded_router_desc *d, bool ties)
{
    const size_t th = (size_t)d->num_tokens * d->hidden_dim, eh = (size_t)d->num_experts * d->hidden_dim;
    const size_t te = (size_t)d->num_tokens * d->num_experts;
    grounded_in in;
    in.hidden = harness_random_tensor(rng, d->hidden_dtype, th ? th : 1, 1.0f / sqrtf((float)d->hidden_dim));
    in.ground = harness_random_tensor(rng, d->hidden_dtype, eh, 1.0f);
    in.logits = harness_random_tensor(rng, MOECL_F32, te ? te : 1, 1.0f);
    for (size_t i = 0; ties && i < eh; i++)
        harness_store(d->hidden_dtype, in.ground, i, 0.0f);
    for (size_t i = 0; ties && i < te; i++)
        in.logits[i] = (float)((int)(harness_rand_u32(rng) % 5) - 2) * 0.5f;
    return in;
}

static bufs grounded_bufs(moecl_context *ctx, const moecl_grounded_router_desc *d, const outs *o,
                          const grounded_in *in)
{
    const size_t in_size = ref_dtype_size(d->hidden_dtype);
    bufs b = bufs_outputs(ctx, o);
    b.hidden = harness_buffer(ctx, (size_t)d->num_tokens * d->hidden_dim * in_size, 2 * in_size, in->hidden);
    b.logits = harness_buffer(ctx, (size_t)d->num_tokens * d->num_experts * 4, 128, in->logits);
    b.ground = harness_buffer(ctx, (size_t)d->num_experts * d->hidden_dim * in_size, 64, in->ground);
    return b;
}

/* The call under test on host memory or on device buffers (after a marker
 * it must wait on). */
static void run_grounded_route(moecl_context *ctx, const moecl_grounded_router_desc *d, uint32_t block,
                               const grounded_in *in, bool device_path, outs *o, const char *what)
{
    moecl_status st;
    if (!device_path) {
        st = moecl_grounded_route_dispatch_host(ctx, d, block, in->hidden, in->logits, in->ground, o->weights, o->ids,
                                                o->counts, o->sorted, o->blocks, &o->post, o->slots, &o->invalid);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        return;
    }
    bufs b = grounded_bufs(ctx, d, o, in);
    cl_event before = NULL, done = NULL;
    ck_assert_int_eq(clEnqueueMarkerWithWaitList(moecl_context_queue(ctx), 0, NULL, &before), CL_SUCCESS);
    st = moecl_grounded_route_dispatch(ctx, d, block, b.hidden, b.logits, b.ground, b.weights, b.ids, b.counts,
                                       b.sorted, b.blocks, b.post, b.slots, b.invalid, 1, &before, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    wait_done(before, done);
    bufs_read(ctx, &b, o, what);
    bufs_release(&b);
}

/* moecl_grounded_router (weights and ids), then moecl_moe_align. */
static void run_grounded_separate(moecl_context *ctx, const moecl_grounded_router_desc *d, const grounded_in *in,
                                  outs *o, const char *what)
{
    bufs b = grounded_bufs(ctx, d, o, in);
    cl_event routed = NULL;
    moecl_status st = moecl_grounded_router(ctx, d, b.hidden, b.logits, b.ground, (moecl_buffer){NULL, 0}, b.weights,
                                            b.ids, 0, NULL, &routed);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: grounded router: %s: %s", what, moecl_status_string(st),
                  moecl_context_error(ctx));
    run_align_after(ctx, &b, o, routed, what);
}

/* One case: both paths against the two calls (bit for bit) and against
 * the reference (the router's weights within its bound, its ids and the
 * dispatch exactly). */
static void grounded_case(moecl_context *ctx, const moecl_grounded_router_desc *d, uint32_t block, bool ties,
                          uint64_t stream)
{
    char what[240];
    snprintf(what, sizeof(what), "grounded T=%u H=%u E=%u k=%u alpha=%g dtype=%d round=%d softcap=%g row=%d block=%u "
             "ties=%d shared=%u/%g", d->num_tokens, d->hidden_dim, d->num_experts, d->top_k, (double)d->alpha,
             (int)d->hidden_dtype, (int)d->logits_dtype, (double)d->logit_softcap, (int)d->router_logits_row, block,
             (int)ties, d->num_shared_experts, (double)d->shared_expert_weight);
    harness_rng rng = harness_rng_for(stream);
    grounded_in in = grounded_inputs(&rng, d, ties);
    outs want, got;
    outs_alloc(grounded_shape(d), block, &want);
    run_grounded_separate(ctx, d, &in, &want, what);
    for (int path = 0; path < 2; path++) {
        outs_alloc(grounded_shape(d), block, &got);
        run_grounded_route(ctx, d, block, &in, path == 1, &got, what);
        if (d->num_tokens == 0)
            ck_assert(harness_first_unpoisoned(got.weights, 4) == 4 && harness_first_unpoisoned(got.ids, 4) == 4);
        assert_same(&got, &want, what);
        char msg[600] = "";
        const int rows = ref_check_grounded_router(d, in.hidden, in.logits, in.ground, NULL, got.weights, got.ids, msg,
                                                   sizeof(msg));
        ck_assert_msg(rows == 0, "%s: %d bad routing rows: %s", what, rows, msg);
        check_dispatch_reference(&got, what);
        outs_free(&got);
    }
    outs_free(&want);
    free(in.hidden);
    free(in.ground);
    free(in.logits);
}

/* The seed shape (hidden 128, 16 experts, top 2) from 0 tokens through
 * decode batches to past the one kernel's 5120 slots and moe_align's
 * one-launch limits. */
START_TEST(test_grounded_sizes)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {0, 1, 7, 129, 256, 641, 1025, 2561, 4096};
    for (size_t t = 0; t < COUNT(tokens); t++) {
        if (harness_quick() && tokens[t] > 1025)
            continue;
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(tokens[t], 128, 16, 1.0f);
        grounded_case(ctx, &d, 64, false, 500 + t);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Other hidden sizes (odd ones too), expert counts, top_k, alpha, dtypes
 * and block sizes. */
START_TEST(test_grounded_shapes)
{
    moecl_context *ctx = harness_context();
    typedef struct gshape {
        uint32_t hidden, experts, k;
        float alpha;
        moecl_dtype dtype;
        uint32_t block;
    } gshape;
    static const gshape shapes[] = {{37, 8, 1, 0.5f, MOECL_F32, 16},   {64, 64, 4, 1.0f, MOECL_F16, 128},
                                    {128, 32, 8, -2.0f, MOECL_BF16, 1}, {256, 60, 3, 1.0f, MOECL_F32, 64},
                                    {16, 128, 8, 1.0f, MOECL_F32, 64}};
    for (size_t i = 0; i < COUNT(shapes); i++)
        for (int t = 0; t < 2; t++) {
            const gshape *g = &shapes[i];
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(t ? 129 : 7, g->hidden, g->experts, g->alpha);
            d.top_k = g->k;
            d.hidden_dtype = g->dtype;
            grounded_case(ctx, &d, g->block, false, 600 + 2 * i + t);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* g as a bf16 or f16 model has it (rounded, capped, one shared row of
 * router logits) through both paths, decode-sized (the one kernel where
 * the class allows) and past it. */
START_TEST(test_grounded_model_logits)
{
    moecl_context *ctx = harness_context();
    static const moecl_dtype rounds[] = {MOECL_BF16, MOECL_F16, MOECL_F32};
    for (size_t r = 0; r < COUNT(rounds); r++)
        for (int t = 0; t < 2; t++) {
            if (harness_quick() && (size_t)t != r % 2)
                continue; /* quick: each rounding once */
            moecl_grounded_router_desc d = moecl_grounded_router_desc_init(t ? 129 : 7, 64, 32, 2.0f);
            d.top_k = 4;
            d.hidden_dtype = (moecl_dtype)((r + (size_t)t) % 3);
            d.logits_dtype = rounds[r];
            d.logit_softcap = t ? 2.0f : 0.0f;
            d.router_logits_row = r != 1;
            grounded_case(ctx, &d, 16, false, 650 + 2 * r + (size_t)t);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Shared experts: top_k + S slots a token aligned over num_experts + S
 * experts, the same bits as the grounded router then moe_align, in the
 * one kernel (decode sizes, GPU class) and the two calls; DeepSeek-V3's
 * sigmoid gating with SGLang's weight 1 / 2.5, and S = 2 on ties. */
START_TEST(test_grounded_shared)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {7, 129};
    for (size_t t = 0; t < COUNT(tokens); t++) {
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(tokens[t], 64, 32, 1.0f);
        d.top_k = 4;
        d.gating.scoring = MOECL_SCORING_SIGMOID;
        d.gating.weighting = MOECL_WEIGHTS_SCORE;
        d.gating.renormalize = true;
        d.gating.routed_scaling_factor = 2.5f;
        d.num_shared_experts = 1;
        d.shared_expert_weight = 1.0f / 2.5f;
        d.hidden_dtype = t ? MOECL_BF16 : MOECL_F32;
        grounded_case(ctx, &d, 16, false, 720 + t);
    }
    moecl_grounded_router_desc d = moecl_grounded_router_desc_init(65, 64, 32, 1.0f);
    d.num_shared_experts = 2;
    d.shared_expert_weight = 0.5f;
    grounded_case(ctx, &d, 16, true, 725);
    moecl_context_destroy(ctx);
}
END_TEST

/* Exact ties in g everywhere: to the lower index, as the router breaks
 * them, on both paths. */
START_TEST(test_grounded_ties)
{
    moecl_context *ctx = harness_context();
    for (int i = 0; i < 2; i++) {
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(65, 64, 32, 1.0f);
        d.top_k = i ? 4 : 2;
        d.hidden_dtype = i ? MOECL_BF16 : MOECL_F32;
        grounded_case(ctx, &d, 16, true, 700 + i);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* As test_out_of_order, for the grounded router (2561 tokens: the two
 * calls). */
static void grounded_out_of_order_cases(moecl_context *ctx)
{
    static const uint32_t tokens[] = {1, 129, 2561};
    for (size_t t = 0; t < COUNT(tokens); t++) {
        moecl_grounded_router_desc d = moecl_grounded_router_desc_init(tokens[t], 128, 16, 1.0f);
        grounded_case(ctx, &d, 64, false, 750 + t);
    }
}

START_TEST(test_grounded_out_of_order)
{
    on_out_of_order_queue("test_grounded_out_of_order", grounded_out_of_order_cases);
}
END_TEST

/* Every validation error, on both paths: MOECL_ERROR_INVALID_ARGUMENT and
 * no output byte changed. */
START_TEST(test_grounded_bad_input)
{
    moecl_context *ctx = harness_context();
    const moecl_grounded_router_desc good = moecl_grounded_router_desc_init(16, 32, 16, 1.0f);
    const uint32_t block = 64;
    harness_rng rng = harness_rng_for(800);
    grounded_in in = grounded_inputs(&rng, &good, false);
    outs o;
    outs_alloc(grounded_shape(&good), block, &o);
    bufs b = grounded_bufs(ctx, &good, &o, &in);
    /* Each field of good (16 tokens, hidden 32, 16 experts, top 2) out of
     * range: hidden, experts, top_k (17: more than the experts), alpha,
     * dtype. */
    moecl_grounded_router_desc bad[8];
    for (size_t i = 0; i < COUNT(bad); i++)
        bad[i] = good;
    bad[0].hidden_dim = 0;
    bad[1].hidden_dim = 65537;
    bad[2].num_experts = 0;
    bad[3].num_experts = 4097;
    bad[4].top_k = 0;
    bad[5].top_k = 17;
    bad[6].alpha = NAN;
    bad[7].hidden_dtype = (moecl_dtype)7;
    char what[64];
    for (size_t i = 0; i < COUNT(bad); i++) {
        snprintf(what, sizeof(what), "grounded descriptor case %zu", i);
        expect_invalid(ctx, call_grounded(ctx, &bad[i], block, &b), &b, &o, what);
        expect_invalid(ctx,
                       moecl_grounded_route_dispatch_host(ctx, &bad[i], block, in.hidden, in.logits, in.ground,
                                                          o.weights, o.ids, o.counts, o.sorted, o.blocks, &o.post,
                                                          o.slots, &o.invalid),
                       NULL, &o, what);
    }
    static const uint32_t bad_blocks[] = {0, 1025};
    for (size_t i = 0; i < COUNT(bad_blocks); i++)
        expect_invalid(ctx, call_grounded(ctx, &good, bad_blocks[i], &b), &b, &o, "grounded block_size");
    moecl_grounded_router_desc huge = moecl_grounded_router_desc_init(300000000u, 32, 16, 1.0f);
    huge.top_k = 8;
    expect_invalid(ctx, call_grounded(ctx, &huge, block, &b), &b, &o, "grounded num_tokens * top_k past INT32_MAX");
    expect_invalid(ctx, call_grounded(ctx, NULL, block, &b), &b, &o, "grounded desc NULL");
    static const int required[BUFS_FIELDS] = {-1, -1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
    each_bad_buffer(ctx, call_grounded, &good, block, &b, &o, required);
    expect_invalid(ctx,
                   moecl_grounded_route_dispatch(ctx, &good, block, b.hidden, b.logits, b.ground, b.weights, b.ids,
                                                 b.counts, b.sorted, b.blocks, b.post, b.slots, b.invalid, 1, NULL,
                                                 NULL),
                   &b, &o, "grounded num_wait without wait");
    /* Host pointers: each required one NULL. */
    const void *hidden = in.hidden, *logits = in.logits, *ground = in.ground;
    for (int i = 0; i < 7; i++) {
        snprintf(what, sizeof(what), "grounded host pointer %d NULL", i);
        expect_invalid(ctx,
                       moecl_grounded_route_dispatch_host(ctx, &good, block, i == 0 ? NULL : hidden,
                                                          i == 1 ? NULL : (const float *)logits, i == 2 ? NULL : ground,
                                                          i == 3 ? NULL : o.weights, i == 4 ? NULL : o.ids,
                                                          i == 5 ? NULL : o.counts, o.sorted, o.blocks,
                                                          i == 6 ? NULL : &o.post, NULL, NULL),
                       NULL, &o, what);
    }
    ck_assert_int_eq(moecl_grounded_route_dispatch_host(NULL, &good, block, hidden, in.logits, ground, o.weights,
                                                        o.ids, o.counts, o.sorted, o.blocks, &o.post, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert(harness_first_unpoisoned(o.weights, o.n_slots * 4) == o.n_slots * 4);
    ck_assert(harness_first_unpoisoned(o.counts, o.experts * 4) == o.experts * 4);
    bufs_release(&b);
    outs_free(&o);
    free(in.hidden);
    free(in.ground);
    free(in.logits);
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("route_dispatch");
    TCase *tc = tcase_create("route_dispatch");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_conventions);
    tcase_add_test(tc, test_sizes);
    tcase_add_test(tc, test_ties_nonfinite);
    tcase_add_test(tc, test_out_of_order);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_out_dtypes);
    tcase_add_test(tc, test_shared_experts);
    suite_add_tcase(s, tc);
    /* The override's align=fused-parallel (--case parallel). */
    TCase *par = tcase_create("parallel");
    tcase_set_timeout(par, 1200);
    tcase_add_test(par, test_fused_parallel);
    suite_add_tcase(s, par);
    /* moecl_route_dispatch_ex's optional tensors (--case ex). */
    TCase *ex = tcase_create("ex");
    tcase_set_timeout(ex, 1200);
    tcase_add_test(ex, test_ex);
    tcase_add_test(ex, test_ex_bad_input);
    suite_add_tcase(s, ex);
    /* The grounded router's, a case of its own so that a run can take it
     * alone (--case grounded). */
    TCase *grounded = tcase_create("grounded");
    tcase_set_timeout(grounded, 1200);
    tcase_add_test(grounded, test_grounded_sizes);
    tcase_add_test(grounded, test_grounded_shapes);
    tcase_add_test(grounded, test_grounded_ties);
    tcase_add_test(grounded, test_grounded_shared);
    tcase_add_test(grounded, test_grounded_model_logits);
    tcase_add_test(grounded, test_grounded_out_of_order);
    tcase_add_test(grounded, test_grounded_bad_input);
    suite_add_tcase(s, grounded);
    return harness_run(s);
}
