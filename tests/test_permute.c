/* moecl_permute, moecl_permute_scatter and moecl_combine against the
 * reference (tests/reference.c):
 * routings from the reference moe_align on fresh random ids (invalid ids
 * among them), every input and output dtype, top_k 1, 2, 8, 64, hidden 1,
 * 7, 64, 4096, both entry points (host; device buffers at odd offsets,
 * poisoned, after a wait-list event), special values (NaN, inf, -0, ties
 * of rounding), the validation errors, and a mutated kernel that the
 * suite must catch. Permute and its scatter are compared bit for bit (the
 * scatter also with 16-byte aligned rows, and with positions out of
 * range); combine bit for bit
 * with the documented f32 order (NaN with NaN where a value is computed),
 * and that order against float64 within its error bound. meson runs it
 * once per launch class (--variant class=cpu|gpu). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "internal.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static const moecl_dtype dtypes[] = {MOECL_F32, MOECL_F16, MOECL_BF16};
static const char *const dtype_names[] = {"f32", "f16", "bf16"};

/* A routing from the reference moe_align: ids uniform over the experts,
 * about one in eight -1 (a padding token's), block_size block. */
typedef struct routing {
    uint32_t num_tokens, top_k, num_experts, block_size;
    uint32_t num_padded;
    int32_t *ids, *sorted, *positions;
    int32_t post;
} routing;

static void routing_make(harness_rng *rng, uint32_t t, uint32_t k, uint32_t e, uint32_t block, routing *r)
{
    const moecl_moe_align_desc d = moecl_moe_align_desc_init(t, k, e, block);
    r->num_tokens = t;
    r->top_k = k;
    r->num_experts = e;
    r->block_size = block;
    r->num_padded = (uint32_t)moecl_moe_align_max_padded(&d);
    const size_t slots = (size_t)t * k;
    r->ids = malloc((slots ? slots : 1) * 4);
    r->sorted = malloc((r->num_padded ? r->num_padded : 1) * 4);
    r->positions = malloc((slots ? slots : 1) * 4);
    int32_t *counts = malloc(e * 4), *blocks = malloc((r->num_padded / block + 1) * 4), invalid;
    ck_assert(r->ids && r->sorted && r->positions && counts && blocks);
    for (size_t s = 0; s < slots; s++)
        r->ids[s] = harness_rand_u32(rng) % 8 == 0 ? -1 : (int32_t)(harness_rand_u32(rng) % e);
    ref_moe_align(&d, r->ids, counts, r->sorted, blocks, &r->post, r->positions, &invalid);
    free(counts);
    free(blocks);
}

static void routing_free(routing *r)
{
    free(r->ids);
    free(r->sorted);
    free(r->positions);
}

/* Random values in dtype, with special ones where special: NaN, +-inf,
 * -0, and values halfway between two bf16 or f16 neighbours. */
static void *make_values(harness_rng *rng, moecl_dtype dtype, size_t n, bool special)
{
    void *v = harness_random_tensor(rng, dtype, n ? n : 1, 1.0f);
    ck_assert_ptr_nonnull(v);
    if (special)
        for (size_t i = 0; i < n; i++) {
            /* Halfway cases of bf16 and f16 (f32 inputs), and 65520,
             * which rounds to inf in f16. */
            static const float ties[] = {1.00390625f, -3.01171875f, 1.00048828125f, 65520.0f};
            const uint32_t u = harness_rand_u32(rng) % 16;
            if (u < 8)
                harness_store(dtype, v, i, u == 0 ? NAN : u == 1 ? INFINITY : u == 2 ? -INFINITY : u == 3 ? -0.0f
                                                                                              : ties[u - 4]);
        }
    return v;
}

/* Element i of a and b (dtype) agree: the same bits, or both NaN where
 * nan_equal (a computed value's payload is the device's). */
static bool same_element(moecl_dtype dtype, const void *a, const void *b, size_t i, bool nan_equal)
{
    const size_t z = moecl_dtype_size(dtype);
    if (memcmp((const unsigned char *)a + i * z, (const unsigned char *)b + i * z, z) == 0)
        return true;
    return nan_equal && isnan(ref_load(dtype, a, i)) && isnan(ref_load(dtype, b, i));
}

/* The wait list of a device-path call: an event completed after the
 * call returns. */
static cl_event user_event(moecl_context *ctx)
{
    cl_int err;
    cl_event user = clCreateUserEvent(moecl_context_cl_context(ctx), &err);
    ck_assert_int_eq(err, CL_SUCCESS);
    return user;
}

/* After a device-path call st: complete its wait list, wait for done,
 * and read out_bytes of out (at its offset) into got, failing where a
 * byte before the offset or in the slack after the tensor changed. */
static void device_finish(moecl_context *ctx, moecl_status st, cl_event user, cl_event done, moecl_buffer out,
                          size_t out_bytes, unsigned char *got, const char *what)
{
    clSetUserEventStatus(user, CL_COMPLETE);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s (%s)", what, moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    clReleaseEvent(user);
    unsigned char before[64];
    ck_assert(out.offset <= sizeof(before));
    harness_read(ctx, (moecl_buffer){out.mem, 0}, out.offset, before);
    ck_assert_msg(harness_first_unpoisoned(before, out.offset) == out.offset, "%s: a byte before out changed", what);
    harness_read(ctx, out, out_bytes + HARNESS_SLACK, got);
    ck_assert_msg(harness_first_unpoisoned(got + out_bytes, HARNESS_SLACK) == HARNESS_SLACK,
                  "%s: a byte after out changed", what);
}

/* ---- permute ---- */

/* How permute's rows are made: the gather, or the scatter with row starts
 * of the device path at odd offsets or 16-byte aligned. */
typedef enum permute_mode { GATHER, SCATTER, SCATTER_ALIGNED } permute_mode;
static const char *const mode_names[] = {"permute", "permute_scatter", "permute_scatter aligned"};

static void check_permute_case(moecl_context *ctx, harness_rng *rng, const routing *r, uint32_t hidden,
                               moecl_dtype in, moecl_dtype out, bool special, bool device_path, int32_t post,
                               permute_mode mode)
{
    moecl_permute_desc d = moecl_permute_desc_init(r->num_tokens, r->top_k, hidden, r->num_padded);
    d.in_dtype = in;
    d.out_dtype = out;
    const size_t in_z = moecl_dtype_size(in), out_z = moecl_dtype_size(out);
    const size_t rows_in = r->num_tokens, h = hidden, padded = r->num_padded;
    void *x = make_values(rng, in, rows_in * h, special);
    const size_t out_bytes = padded * h * out_z;
    unsigned char *got = harness_poisoned(out_bytes + HARNESS_SLACK), *want = harness_poisoned(out_bytes + 1);
    ck_assert(got && want);
    ref_permute(&d, x, r->sorted, post, want);
    char what[160];
    snprintf(what, sizeof(what), "%s T=%u k=%u E=%u block=%u hidden=%u %s->%s post=%d %s%s path", mode_names[mode],
             r->num_tokens, r->top_k, r->num_experts, r->block_size, hidden, dtype_names[in], dtype_names[out],
             (int)post, special ? "special values, " : "", device_path ? "device" : "host");
    if (!device_path) {
        const moecl_status st = mode == GATHER
                                    ? moecl_permute_host(ctx, &d, x, r->sorted, &post, got)
                                    : moecl_permute_scatter_host(ctx, &d, x, r->sorted, &post, r->positions, got);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s (%s)", what, moecl_status_string(st), moecl_context_error(ctx));
    } else {
        const bool aligned = mode == SCATTER_ALIGNED;
        const size_t off_in = aligned ? 16 : 3 * in_z, off_ids = 8, off_post = 12, off_out = aligned ? 32 : 5 * out_z;
        moecl_buffer bx = harness_buffer(ctx, rows_in * h * in_z, off_in, x);
        moecl_buffer bs = harness_buffer(ctx, padded * 4, off_ids, r->sorted);
        moecl_buffer bp = harness_buffer(ctx, 4, off_post, &post);
        moecl_buffer bpos = harness_buffer(ctx, rows_in * r->top_k * 4, 20, r->positions);
        moecl_buffer bo = harness_buffer(ctx, out_bytes, off_out, NULL);
        cl_event user = user_event(ctx), done = NULL;
        const moecl_status st = mode == GATHER ? moecl_permute(ctx, &d, bx, bs, bp, bo, 1, &user, &done)
                                               : moecl_permute_scatter(ctx, &d, bx, bs, bp, bpos, bo, 1, &user, &done);
        device_finish(ctx, st, user, done, bo, out_bytes, got, what);
        harness_release(bx);
        harness_release(bs);
        harness_release(bp);
        harness_release(bpos);
        harness_release(bo);
    }
    /* Rows past post are poison in both (ref_permute leaves them). */
    const bool nan_equal = in != out;
    for (size_t i = 0; i < padded * h; i++)
        ck_assert_msg(same_element(out, got, want, i, nan_equal), "%s: row %zu column %zu differs (%s)", what, i / h,
                      i % h, i / h >= (size_t)(post < 0 ? 0 : post) ? "a row past post was written" : "value");
    free(x);
    free(got);
    free(want);
}

/* Special values, every dtype pair, both paths; post at 0, mid-way, past
 * the capacity and negative. */
START_TEST(test_permute_special)
{
    moecl_context *ctx = harness_context();
    unsigned config = 0;
    for (size_t i = 0; i < COUNT(dtypes); i++)
        for (size_t o = 0; o < COUNT(dtypes); o++)
            for (int device = 0; device < 2; device++, config++) {
                harness_rng rng = harness_rng_for(200 + config);
                routing r;
                routing_make(&rng, 21, 2, 8, 8, &r);
                const int32_t posts[] = {0, r.post / 2, (int32_t)r.num_padded + 5, -3};
                for (int m = GATHER; m <= SCATTER_ALIGNED; m++) {
                    check_permute_case(ctx, &rng, &r, 67, dtypes[i], dtypes[o], true, device, r.post,
                                       (permute_mode)m);
                    /* 64 columns: the scatter's uint4 words where aligned. */
                    check_permute_case(ctx, &rng, &r, 64, dtypes[i], dtypes[o], true, device, r.post,
                                       (permute_mode)m);
                    check_permute_case(ctx, &rng, &r, 9, dtypes[i], dtypes[o], false, device, posts[config % 4],
                                       (permute_mode)m);
                    check_permute_case(ctx, &rng, &r, 8, dtypes[i], dtypes[o], false, device,
                                       posts[(config + 1) % 4], (permute_mode)m);
                }
                routing_free(&r);
            }
    /* No tokens: every row is padding (the sentinel 0). */
    harness_rng rng = harness_rng_for(299);
    routing r;
    routing_make(&rng, 0, 4, 8, 4, &r);
    for (int m = GATHER; m <= SCATTER_ALIGNED; m++) {
        check_permute_case(ctx, &rng, &r, 13, MOECL_BF16, MOECL_F32, false, true, (int32_t)r.num_padded,
                           (permute_mode)m);
        check_permute_case(ctx, &rng, &r, 16, MOECL_BF16, MOECL_BF16, false, m != GATHER, (int32_t)r.num_padded,
                           (permute_mode)m);
    }
    routing_free(&r);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- combine ---- */

static void check_combine_case(moecl_context *ctx, harness_rng *rng, const routing *r, uint32_t hidden,
                               moecl_dtype in, moecl_dtype out, int shared, bool special, bool device_path)
{
    moecl_combine_desc d = moecl_combine_desc_init(r->num_tokens, r->top_k, hidden, r->num_padded);
    d.in_dtype = in;
    d.out_dtype = out;
    d.shared_dtype = shared >= 0 ? (moecl_dtype)shared : MOECL_F32;
    const size_t in_z = moecl_dtype_size(in), out_z = moecl_dtype_size(out), sh_z = moecl_dtype_size(d.shared_dtype);
    const size_t t = r->num_tokens, k = r->top_k, h = hidden, padded = r->num_padded;
    void *y = make_values(rng, in, padded * h, special);
    float *w = malloc((t * k > 0 ? t * k : 1) * 4);
    ck_assert_ptr_nonnull(w);
    for (size_t i = 0; i < t * k; i++)
        w[i] = harness_rand_u32(rng) % 7 == 0 ? 0.0f : (float)harness_rand_uniform(rng);
    if (special && t * k > 0)
        w[0] = NAN; /* where slot 0 is invalid, it contributes nothing */
    void *sh = shared >= 0 ? make_values(rng, d.shared_dtype, t * h, special) : NULL;
    const size_t out_bytes = t * h * out_z;
    unsigned char *got = harness_poisoned(out_bytes + HARNESS_SLACK), *want = harness_poisoned(out_bytes + 1);
    ck_assert(got && want);
    ref_combine(&d, y, w, r->positions, sh, want);
    char what[192];
    snprintf(what, sizeof(what), "combine T=%u k=%u E=%u block=%u hidden=%u %s->%s shared=%s %s%s path",
             r->num_tokens, r->top_k, r->num_experts, r->block_size, hidden, dtype_names[in], dtype_names[out],
             shared >= 0 ? dtype_names[shared] : "none", special ? "special values, " : "",
             device_path ? "device" : "host");
    if (!device_path) {
        const moecl_status st = moecl_combine_host(ctx, &d, y, w, r->positions, sh, got);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s (%s)", what, moecl_status_string(st), moecl_context_error(ctx));
    } else {
        const size_t off_in = 7 * in_z, off_out = 3 * out_z, off_sh = 9 * sh_z;
        moecl_buffer by = harness_buffer(ctx, padded * h * in_z, off_in, y);
        moecl_buffer bw = harness_buffer(ctx, t * k * 4, 4, w);
        moecl_buffer bp = harness_buffer(ctx, t * k * 4, 16, r->positions);
        moecl_buffer bsh = sh ? harness_buffer(ctx, t * h * sh_z, off_sh, sh) : (moecl_buffer){NULL, 0};
        moecl_buffer bo = harness_buffer(ctx, out_bytes, off_out, NULL);
        cl_event user = user_event(ctx), done = NULL;
        const moecl_status st = moecl_combine(ctx, &d, by, bw, bp, bsh, bo, 1, &user, &done);
        device_finish(ctx, st, user, done, bo, out_bytes, got, what);
        harness_release(by);
        harness_release(bw);
        harness_release(bp);
        harness_release(bsh);
        harness_release(bo);
    }
    for (size_t i = 0; i < t * h; i++) {
        ck_assert_msg(same_element(out, got, want, i, true), "%s: token %zu column %zu: 0x%x, the f32 order 0x%x",
                      what, i / h, i % h, out == MOECL_F32 ? ((uint32_t *)(void *)got)[i] : ((uint16_t *)got)[i],
                      out == MOECL_F32 ? ((uint32_t *)(void *)want)[i] : ((uint16_t *)want)[i]);
        /* The order itself against float64: (k + 1) roundings of f32 and
         * the output's rounding. */
        if (!special) {
            double mag;
            const double exact = ref_combine_f64(&d, y, w, r->positions, sh, i / h, i % h, &mag);
            const double unit = out == MOECL_F32 ? 0x1p-24 : out == MOECL_F16 ? 0x1p-11 : 0x1p-8;
            const double bound = (double)(2 * k + 3) * 0x1p-24 * mag + unit * fabs(exact) * 1.0001 +
                                 (out == MOECL_F16 ? 0x1p-25 : 0.0);
            const double v = ref_load(out, want, i);
            ck_assert_msg(fabs(v - exact) <= bound,
                          "%s: the f32 order %.9g is %.3g from float64 %.9g (bound %.3g)", what, v, fabs(v - exact),
                          exact, bound);
        }
    }
    free(y);
    free(w);
    free(sh);
    free(got);
    free(want);
}

/* Every dtype pair at every top_k and hidden of the grid, on routings
 * with invalid ids; the host and device paths and combine's shared rows
 * (none, or each dtype) by turns. */
static void grid(bool combine, permute_mode mode)
{
    moecl_context *ctx = harness_context();
    static const uint32_t topks[] = {1, 2, 8, 64}, hiddens[] = {1, 7, 64, 4096};
    unsigned config = 0;
    for (size_t ki = 0; ki < COUNT(topks); ki++)
        for (size_t hi = 0; hi < COUNT(hiddens); hi++)
            for (size_t i = 0; i < COUNT(dtypes); i++)
                for (size_t o = 0; o < COUNT(dtypes); o++, config++) {
                    if (harness_quick_skips(config + (unsigned)(i + o)))
                        continue;
                    const uint32_t k = topks[ki], h = hiddens[hi];
                    /* Fewer tokens at the widest rows: the suite stays short. */
                    const uint32_t t = h >= 4096 ? 3 : 37, e = k > 8 ? 64 : 16;
                    harness_rng rng = harness_rng_for((combine ? 300 : 100 + 1000 * mode) + config);
                    routing r;
                    routing_make(&rng, t, k, e, 4, &r);
                    const bool device = config % 2 == 0;
                    if (combine)
                        check_combine_case(ctx, &rng, &r, h, dtypes[i], dtypes[o],
                                           config % 4 == 3 ? -1 : (int)(config % 3), false, device);
                    else
                        check_permute_case(ctx, &rng, &r, h, dtypes[i], dtypes[o], false, device, r.post,
                                           mode == SCATTER && config % 4 == 0 ? SCATTER_ALIGNED : mode);
                    routing_free(&r);
                }
    moecl_context_destroy(ctx);
}

START_TEST(test_combine_grid)
{
    grid(true, GATHER);
}
END_TEST

START_TEST(test_permute_grid)
{
    grid(false, GATHER);
}
END_TEST

START_TEST(test_scatter_grid)
{
    grid(false, SCATTER);
}
END_TEST

/* Rows whose copy loops pass a loop-limited driver's budget with one
 * work-item a row (MOECL_DP_LOOP_LIMIT: rusticl's 65535 iterations a
 * work-item, every loop counted): combine at hidden 65536, top 8 (16384
 * vectors a slot), permute and the scatter at hidden 262148 (65537
 * vectors), through the device path against the reference. Few tokens,
 * so that they run on rusticl. */
START_TEST(test_loop_budget)
{
    moecl_context *ctx = harness_context();
    harness_rng rng = harness_rng_for(950);
    routing r;
    routing_make(&rng, 2, 8, 4, 4, &r);
    check_combine_case(ctx, &rng, &r, 65536, MOECL_F32, MOECL_F32, -1, false, true);
    routing_free(&r);
    routing_make(&rng, 2, 1, 2, 2, &r);
    check_permute_case(ctx, &rng, &r, 262148, MOECL_F32, MOECL_F32, false, true, r.post, GATHER);
    check_permute_case(ctx, &rng, &r, 262148, MOECL_F32, MOECL_F32, false, true, r.post, SCATTER);
    routing_free(&r);
    moecl_context_destroy(ctx);
}
END_TEST

/* Positions the scatter must skip (-1 and other negatives, n and past,
 * past num_padded, INT32_MAX): their slots' rows keep the poison, every
 * other row below n is permute's, and no row from n on and no byte
 * around out is written. Aligned and odd offsets, each dtype pair. */
START_TEST(test_scatter_skips_positions)
{
    moecl_context *ctx = harness_context();
    unsigned config = 0;
    for (size_t i = 0; i < COUNT(dtypes); i++)
        for (size_t o = 0; o < COUNT(dtypes); o++, config++) {
            harness_rng rng = harness_rng_for(700 + config);
            routing r;
            routing_make(&rng, 29, 4, 8, 4, &r);
            const uint32_t h = config % 2 ? 32 : 19, slots = r.num_tokens * r.top_k;
            const int32_t post = r.post - 4; /* the last block's rows past n */
            const size_t padded = r.num_padded, out_z = moecl_dtype_size(dtypes[o]);
            moecl_permute_desc d = moecl_permute_desc_init(r.num_tokens, r.top_k, h, r.num_padded);
            d.in_dtype = dtypes[i];
            d.out_dtype = dtypes[o];
            void *x = make_values(&rng, dtypes[i], (size_t)r.num_tokens * h, false);
            const size_t out_bytes = padded * h * out_z;
            unsigned char *got = harness_poisoned(out_bytes + HARNESS_SLACK), *want = harness_poisoned(out_bytes + 1);
            ck_assert(got && want);
            ref_permute(&d, x, r.sorted, post, want);
            /* Every fifth placed slot's position out of range: its row
             * keeps the poison. */
            static const int32_t bad[] = {-1, -7, INT32_MIN, INT32_MAX, 0x7ffffff0};
            unsigned spoiled = 0;
            for (uint32_t s = 0; s < slots; s++) {
                const int32_t p = r.positions[s];
                if (p < 0 || s % 5 != 0)
                    continue;
                if (p < post)
                    memset(want + (size_t)p * h * out_z, HARNESS_POISON, h * out_z);
                r.positions[s] = spoiled % 6 == 5 ? (int32_t)padded + (int32_t)spoiled : spoiled % 6 == 4
                                                                                          ? post + (int32_t)(s % 3)
                                                                                          : bad[spoiled % 6];
                spoiled++;
            }
            ck_assert_uint_gt(spoiled, 3);
            moecl_buffer bx = harness_buffer(ctx, (size_t)r.num_tokens * h * moecl_dtype_size(dtypes[i]),
                                             config % 2 ? 0 : moecl_dtype_size(dtypes[i]), x);
            moecl_buffer bs = harness_buffer(ctx, padded * 4, 4, r.sorted);
            moecl_buffer bp = harness_buffer(ctx, 4, 0, &post);
            moecl_buffer bpos = harness_buffer(ctx, (size_t)slots * 4, 8, r.positions);
            moecl_buffer bo = harness_buffer(ctx, out_bytes, config % 2 ? 16 : out_z, NULL);
            cl_event user = user_event(ctx), done = NULL;
            const moecl_status st = moecl_permute_scatter(ctx, &d, bx, bs, bp, bpos, bo, 1, &user, &done);
            device_finish(ctx, st, user, done, bo, out_bytes, got, "scatter with positions out of range");
            for (size_t e = 0; e < padded * h; e++)
                ck_assert_msg(memcmp(got + e * out_z, want + e * out_z, out_z) == 0,
                              "%s->%s hidden %u: row %zu column %zu differs (post %d)", dtype_names[i],
                              dtype_names[o], h, e / h, e % h, (int)post);
            harness_release(bx);
            harness_release(bs);
            harness_release(bp);
            harness_release(bpos);
            harness_release(bo);
            free(x);
            free(got);
            free(want);
            routing_free(&r);
        }
    moecl_context_destroy(ctx);
}
END_TEST

START_TEST(test_combine_special)
{
    moecl_context *ctx = harness_context();
    unsigned config = 0;
    for (size_t i = 0; i < COUNT(dtypes); i++)
        for (size_t o = 0; o < COUNT(dtypes); o++)
            for (int device = 0; device < 2; device++, config++) {
                harness_rng rng = harness_rng_for(400 + config);
                routing r;
                routing_make(&rng, 19, 3, 8, 8, &r);
                check_combine_case(ctx, &rng, &r, 67, dtypes[i], dtypes[o], (int)(config % 3), true, device);
                check_combine_case(ctx, &rng, &r, 5, dtypes[i], dtypes[o], -1, true, device);
                routing_free(&r);
            }
    /* Every id invalid: rows of 0, or the shared rows. */
    harness_rng rng = harness_rng_for(499);
    routing r;
    routing_make(&rng, 6, 2, 4, 4, &r);
    for (size_t s = 0; s < 12; s++)
        r.positions[s] = -1;
    check_combine_case(ctx, &rng, &r, 11, MOECL_F32, MOECL_F32, -1, false, true);
    check_combine_case(ctx, &rng, &r, 11, MOECL_F32, MOECL_BF16, MOECL_F16, false, false);
    routing_free(&r);
    moecl_context_destroy(ctx);
}
END_TEST

/* The gather then the weighted sum with weight 1 and top_k 1 restores the
 * rows: the two ops are each other's inverse on a routing. */
START_TEST(test_round_trip)
{
    moecl_context *ctx = harness_context();
    harness_rng rng = harness_rng_for(500);
    routing r;
    routing_make(&rng, 50, 1, 8, 16, &r);
    const size_t h = 33, t = r.num_tokens, padded = r.num_padded;
    float *x = harness_random_tensor(&rng, MOECL_F32, t * h, 1.0f), *perm = calloc(padded * h, 4),
          *back = malloc(t * h * 4), *w = malloc(t * 4);
    ck_assert(x && perm && back && w);
    for (size_t i = 0; i < t; i++)
        w[i] = 1.0f;
    const moecl_permute_desc pd = moecl_permute_desc_init(r.num_tokens, 1, (uint32_t)h, r.num_padded);
    ck_assert_int_eq(moecl_permute_host(ctx, &pd, x, r.sorted, &r.post, perm), MOECL_SUCCESS);
    const moecl_combine_desc cd = moecl_combine_desc_init(r.num_tokens, 1, (uint32_t)h, r.num_padded);
    ck_assert_int_eq(moecl_combine_host(ctx, &cd, perm, w, r.positions, NULL, back), MOECL_SUCCESS);
    for (size_t i = 0; i < t * h; i++)
        ck_assert_msg(back[i] == (r.ids[i / h] < 0 ? 0.0f : x[i]), "token %zu column %zu not restored", i / h, i % h);
    free(x);
    free(perm);
    free(back);
    free(w);
    routing_free(&r);
    moecl_context_destroy(ctx);
}
END_TEST

/* ---- validation ---- */

static void assert_unchanged(moecl_context *ctx, moecl_buffer b, size_t size, const char *what)
{
    clFinish(moecl_context_queue(ctx));
    unsigned char *buf = malloc(size);
    ck_assert_ptr_nonnull(buf);
    harness_read(ctx, b, size, buf);
    ck_assert_msg(harness_first_unpoisoned(buf, size) == size, "%s: a rejected call changed the output", what);
    free(buf);
}

static void expect_invalid(moecl_context *ctx, moecl_status st, const char *field, const char *what)
{
    ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %s", what, moecl_status_string(st));
    ck_assert_msg(strstr(moecl_context_error(ctx), field) != NULL, "%s: the message \"%s\" does not name %s", what,
                  moecl_context_error(ctx), field);
}

START_TEST(test_bad_input)
{
    moecl_context *ctx = harness_context(), *other = harness_context();
    const uint32_t t = 4, k = 2, h = 8, padded = 16;
    int32_t sorted[16], post = 16, positions[8];
    for (int i = 0; i < 16; i++)
        sorted[i] = i % 9;
    for (int i = 0; i < 8; i++)
        positions[i] = i;
    float x[64] = {0}, w[8] = {0};
    moecl_buffer bx = harness_buffer(ctx, sizeof(x), 0, x), bs = harness_buffer(ctx, sizeof(sorted), 0, sorted);
    moecl_buffer bp = harness_buffer(ctx, 4, 0, &post), bo = harness_buffer(ctx, padded * h * 4, 0, NULL);
    moecl_buffer by = harness_buffer(ctx, padded * h * 4, 0, NULL), bw = harness_buffer(ctx, sizeof(w), 0, w);
    moecl_buffer bpos = harness_buffer(ctx, sizeof(positions), 0, positions);
    moecl_buffer bco = harness_buffer(ctx, t * h * 4, 0, NULL), foreign = harness_buffer(other, 4096, 0, NULL);
    const moecl_buffer none = {NULL, 0}, odd = {bo.mem, 2};

    const moecl_permute_desc pd = moecl_permute_desc_init(t, k, h, padded);
    moecl_permute_desc p = pd;
    p.top_k = 0;
    expect_invalid(ctx, moecl_permute(ctx, &p, bx, bs, bp, bo, 0, NULL, NULL), "top_k", "permute top_k 0");
    p = pd;
    p.top_k = 65;
    expect_invalid(ctx, moecl_permute(ctx, &p, bx, bs, bp, bo, 0, NULL, NULL), "top_k", "permute top_k 65");
    p = pd;
    p.hidden = 0;
    expect_invalid(ctx, moecl_permute(ctx, &p, bx, bs, bp, bo, 0, NULL, NULL), "hidden", "permute hidden 0");
    p = pd;
    p.num_padded = 0x80000000u;
    expect_invalid(ctx, moecl_permute(ctx, &p, bx, bs, bp, bo, 0, NULL, NULL), "num_padded", "permute num_padded");
    p = pd;
    p.in_dtype = (moecl_dtype)3;
    expect_invalid(ctx, moecl_permute(ctx, &p, bx, bs, bp, bo, 0, NULL, NULL), "in_dtype", "permute in_dtype");
    p = pd;
    p.out_dtype = (moecl_dtype)-1;
    expect_invalid(ctx, moecl_permute(ctx, &p, bx, bs, bp, bo, 0, NULL, NULL), "out_dtype", "permute out_dtype");
    expect_invalid(ctx, moecl_permute(ctx, NULL, bx, bs, bp, bo, 0, NULL, NULL), "desc", "permute desc NULL");
    expect_invalid(ctx, moecl_permute(ctx, &pd, none, bs, bp, bo, 0, NULL, NULL), "hidden_states", "permute no x");
    expect_invalid(ctx, moecl_permute(ctx, &pd, bx, none, bp, bo, 0, NULL, NULL), "sorted_token_ids",
                   "permute no ids");
    expect_invalid(ctx, moecl_permute(ctx, &pd, bx, bs, none, bo, 0, NULL, NULL), "num_tokens_post_padded",
                   "permute no post");
    expect_invalid(ctx, moecl_permute(ctx, &pd, bx, bs, bp, odd, 0, NULL, NULL), "out", "permute odd offset");
    expect_invalid(ctx, moecl_permute(ctx, &pd, bx, bs, bp, foreign, 0, NULL, NULL), "out", "permute foreign out");
    expect_invalid(ctx, moecl_permute(ctx, &pd, bx, bs, bp, bw, 0, NULL, NULL), "out", "permute small out");
    expect_invalid(ctx, moecl_permute(ctx, &pd, bx, bs, bp, bo, 1, NULL, NULL), "wait", "permute wait NULL");
    ck_assert_int_eq(moecl_permute(NULL, &pd, bx, bs, bp, bo, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    expect_invalid(ctx, moecl_permute_host(ctx, &pd, x, sorted, NULL, NULL), "num_tokens_post_padded",
                   "permute_host no post");
    expect_invalid(ctx, moecl_permute_host(ctx, &pd, x, sorted, &post, NULL), "out", "permute_host no out");
    assert_unchanged(ctx, bo, padded * h * 4, "permute");

    p = pd;
    p.top_k = 65;
    expect_invalid(ctx, moecl_permute_scatter(ctx, &p, bx, bs, bp, bpos, bo, 0, NULL, NULL), "top_k",
                   "scatter top_k 65");
    p = pd;
    p.in_dtype = (moecl_dtype)3;
    expect_invalid(ctx, moecl_permute_scatter(ctx, &p, bx, bs, bp, bpos, bo, 0, NULL, NULL), "in_dtype",
                   "scatter in_dtype");
    expect_invalid(ctx, moecl_permute_scatter(ctx, NULL, bx, bs, bp, bpos, bo, 0, NULL, NULL), "desc",
                   "scatter desc NULL");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, none, bs, bp, bpos, bo, 0, NULL, NULL), "hidden_states",
                   "scatter no x");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, none, bp, bpos, bo, 0, NULL, NULL), "sorted_token_ids",
                   "scatter no ids");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, bs, none, bpos, bo, 0, NULL, NULL),
                   "num_tokens_post_padded", "scatter no post");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, bs, bp, none, bo, 0, NULL, NULL), "slot_positions",
                   "scatter no positions");
    /* 28 of the 32 bytes past the offset (the harness adds 64 of slack) */
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, bs, bp, (moecl_buffer){bpos.mem, 68}, bo, 0, NULL, NULL),
                   "slot_positions", "scatter small positions");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, bs, bp, bpos, odd, 0, NULL, NULL), "out",
                   "scatter odd offset");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, bs, bp, bpos, foreign, 0, NULL, NULL), "out",
                   "scatter foreign out");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, bs, bp, bpos, bw, 0, NULL, NULL), "out",
                   "scatter small out");
    expect_invalid(ctx, moecl_permute_scatter(ctx, &pd, bx, bs, bp, bpos, bo, 1, NULL, NULL), "wait",
                   "scatter wait NULL");
    ck_assert_int_eq(moecl_permute_scatter(NULL, &pd, bx, bs, bp, bpos, bo, 0, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    expect_invalid(ctx, moecl_permute_scatter_host(ctx, &pd, x, sorted, NULL, positions, NULL),
                   "num_tokens_post_padded", "scatter_host no post");
    expect_invalid(ctx, moecl_permute_scatter_host(ctx, &pd, x, sorted, &post, NULL, NULL), "slot_positions",
                   "scatter_host no positions");
    expect_invalid(ctx, moecl_permute_scatter_host(ctx, &pd, x, sorted, &post, positions, NULL), "out",
                   "scatter_host no out");
    assert_unchanged(ctx, bo, padded * h * 4, "permute_scatter");

    const moecl_combine_desc cd = moecl_combine_desc_init(t, k, h, padded);
    moecl_combine_desc c = cd;
    c.top_k = 0;
    expect_invalid(ctx, moecl_combine(ctx, &c, by, bw, bpos, none, bco, 0, NULL, NULL), "top_k", "combine top_k");
    c = cd;
    c.hidden = (1u << 20) + 1;
    expect_invalid(ctx, moecl_combine(ctx, &c, by, bw, bpos, none, bco, 0, NULL, NULL), "hidden", "combine hidden");
    c = cd;
    c.shared_dtype = (moecl_dtype)7;
    expect_invalid(ctx, moecl_combine(ctx, &c, by, bw, bpos, none, bco, 0, NULL, NULL), "shared_dtype",
                   "combine shared_dtype");
    expect_invalid(ctx, moecl_combine(ctx, &cd, none, bw, bpos, none, bco, 0, NULL, NULL), "expert_out",
                   "combine no expert_out");
    expect_invalid(ctx, moecl_combine(ctx, &cd, by, none, bpos, none, bco, 0, NULL, NULL), "topk_weights",
                   "combine no weights");
    expect_invalid(ctx, moecl_combine(ctx, &cd, by, bw, none, none, bco, 0, NULL, NULL), "slot_positions",
                   "combine no positions");
    expect_invalid(ctx, moecl_combine(ctx, &cd, by, bw, bpos, bw, bco, 0, NULL, NULL), "shared_out",
                   "combine small shared");
    expect_invalid(ctx, moecl_combine(ctx, &cd, by, bw, bpos, none, bw, 0, NULL, NULL), "out", "combine small out");
    expect_invalid(ctx, moecl_combine_host(ctx, &cd, NULL, w, positions, NULL, NULL), "expert_out",
                   "combine_host no expert_out");
    assert_unchanged(ctx, bco, t * h * 4, "combine");

    /* Nothing to do: success, and a marker event. */
    const moecl_combine_desc empty = moecl_combine_desc_init(0, 2, 8, 0);
    cl_event done = NULL;
    ck_assert_int_eq(moecl_combine(ctx, &empty, none, none, none, none, none, 0, NULL, &done), MOECL_SUCCESS);
    ck_assert_ptr_nonnull(done);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    const moecl_permute_desc no_rows = moecl_permute_desc_init(0, 2, 8, 0);
    ck_assert_int_eq(moecl_permute(ctx, &no_rows, none, none, bp, none, 0, NULL, NULL), MOECL_SUCCESS);
    ck_assert_int_eq(moecl_permute_host(ctx, &no_rows, NULL, NULL, &post, NULL), MOECL_SUCCESS);
    ck_assert_int_eq(moecl_permute_scatter(ctx, &no_rows, none, none, bp, none, none, 0, NULL, &done), MOECL_SUCCESS);
    ck_assert_ptr_nonnull(done);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    ck_assert_int_eq(moecl_permute_scatter_host(ctx, &no_rows, NULL, NULL, &post, NULL, NULL), MOECL_SUCCESS);

    moecl_buffer all[] = {bx, bs, bp, bo, by, bw, bpos, bco, foreign};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(all[i]);
    moecl_context_destroy(ctx);
    moecl_context_destroy(other);
}
END_TEST

/* ---- mutants ---- */

/* Each mutant must fail the suite's checks: the vector path's rounding
 * (f32 to bf16 truncated), the scalar tail's source column (off by
 * one), the sum's order (j descending), the invalid slots (a position -1
 * read as row 0), the scatter's destinations (every slot to its token's
 * first position), its uint4 words (each even word twice) and its
 * padding (the sentinel's rows left unzeroed, caught on a poisoned
 * device buffer). */
START_TEST(test_mutation_caught)
{
    static const char *const edits[][2] = {
        {"#define PM_STORE4_2(p, v, x) vstore4(pm_bf16_of4(x), (v), (p))",
         "#define PM_STORE4_2(p, v, x) vstore4(convert_ushort4(as_uint4(x) >> 16), (v), (p))"},
        {"        PM_STORE1(OUT_DTYPE, o, i, PM_LOAD1(IN_DTYPE, src, i));",
         "        PM_STORE1(OUT_DTYPE, o, i, PM_LOAD1(IN_DTYPE, src, i - 1));"},
        {"        for (uint j = 0; j < a.top_k; j++) {\n            const uint at = (uint)p[j];\n"
         "            if (at < a.num_padded) {\n                const float4",
         "        for (uint jj = 0; jj < a.top_k; jj++) {\n            const uint j = a.top_k - 1 - jj;\n"
         "            const uint at = (uint)p[j];\n            if (at < a.num_padded) {\n                const float4"},
        {"            const uint at = (uint)p[j];\n            if (at < a.num_padded) {\n                const float "
         "prod",
         "            const uint at = (uint)max(p[j], 0);\n            if (at < a.num_padded) {\n"
         "                const float prod"},
        {"#define PS_AT(p, j, limit) ((uint)(p)[j] < (limit) ? (uint)(p)[j] : (limit))",
         "#define PS_AT(p, j, limit) ((uint)(p)[0] < (limit) ? (uint)(p)[0] : (limit))"},
        {"            const uint4 w = from[v];", "            const uint4 w = from[v & ~1u];"},
        {"        if ((uint)sorted[a.ids_off + p] >= a.num_tokens * a.top_k)",
         "        if ((uint)sorted[a.ids_off + p] > a.num_tokens * a.top_k)"},
    };
    for (size_t m = 0; m < COUNT(edits); m++) {
        char dir[] = "/tmp/moecl-permute-mutant-XXXXXX", path[4096];
        harness_write_mutant("permute.cl", &edits[m], 1, dir, path, sizeof(path));
        moecl_context *ctx = harness_context_with_kernel_dir(dir);
        harness_rng rng = harness_rng_for(600 + m);
        routing r;
        routing_make(&rng, 40, 8, 16, 4, &r);
        const uint32_t h = 71; /* a vector part and a tail */
        bool caught = false;
        if (m < 2) {
            moecl_permute_desc d = moecl_permute_desc_init(r.num_tokens, 8, h, r.num_padded);
            d.out_dtype = MOECL_BF16;
            const size_t n = (size_t)r.num_padded * h;
            float *x = harness_random_tensor(&rng, MOECL_F32, (size_t)r.num_tokens * h, 1.0f);
            uint16_t *got = calloc(n, 2), *want = calloc(n, 2);
            ck_assert(x && got && want);
            ck_assert_int_eq(moecl_permute_host(ctx, &d, x, r.sorted, &r.post, got), MOECL_SUCCESS);
            ref_permute(&d, x, r.sorted, r.post, want);
            caught = memcmp(got, want, n * 2) != 0;
            free(x);
            free(got);
            free(want);
        } else if (m >= 4) {
            /* f32 rows of 72 columns: 18 uint4 words, every start aligned. */
            const moecl_permute_desc d = moecl_permute_desc_init(r.num_tokens, 8, 72, r.num_padded);
            const size_t n = (size_t)r.num_padded * 72;
            float *x = harness_random_tensor(&rng, MOECL_F32, (size_t)r.num_tokens * 72, 1.0f);
            float *got = calloc(n, 4), *want = calloc(n, 4);
            ck_assert(x && got && want);
            if (m == 4 || m == 5)
                ck_assert_int_eq(moecl_permute_scatter_host(ctx, &d, x, r.sorted, &r.post, r.positions, got),
                                 MOECL_SUCCESS);
            else {
                moecl_buffer bx = harness_buffer(ctx, (size_t)r.num_tokens * 72 * 4, 0, x);
                moecl_buffer bs = harness_buffer(ctx, (size_t)r.num_padded * 4, 0, r.sorted);
                moecl_buffer bp = harness_buffer(ctx, 4, 0, &r.post);
                moecl_buffer bpos = harness_buffer(ctx, (size_t)r.num_tokens * 8 * 4, 0, r.positions);
                moecl_buffer bo = harness_buffer(ctx, n * 4, 0, NULL);
                ck_assert_int_eq(moecl_permute_scatter(ctx, &d, bx, bs, bp, bpos, bo, 0, NULL, NULL), MOECL_SUCCESS);
                harness_read(ctx, bo, n * 4, got);
                moecl_buffer all[] = {bx, bs, bp, bpos, bo};
                for (size_t i = 0; i < COUNT(all); i++)
                    harness_release(all[i]);
            }
            ref_permute(&d, x, r.sorted, r.post, want);
            caught = memcmp(got, want, (size_t)r.post * 72 * 4) != 0;
            free(x);
            free(got);
            free(want);
        } else {
            const moecl_combine_desc d = moecl_combine_desc_init(r.num_tokens, 8, h, r.num_padded);
            const size_t n = (size_t)r.num_tokens * h;
            float *y = harness_random_tensor(&rng, MOECL_F32, (size_t)r.num_padded * h, 1.0f);
            float *w = harness_random_tensor(&rng, MOECL_F32, (size_t)r.num_tokens * 8, 1.0f);
            float *got = calloc(n, 4), *want = calloc(n, 4);
            ck_assert(y && w && got && want);
            ck_assert_int_eq(moecl_combine_host(ctx, &d, y, w, r.positions, NULL, got), MOECL_SUCCESS);
            ref_combine(&d, y, w, r.positions, NULL, want);
            caught = memcmp(got, want, n * 4) != 0;
            free(y);
            free(w);
            free(got);
            free(want);
        }
        ck_assert_msg(caught, "mutant %zu (\"%s\") passed the check", m, edits[m][1]);
        routing_free(&r);
        moecl_context_destroy(ctx);
        remove(path);
        rmdir(dir);
    }
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("permute");
    TCase *tc = tcase_create("reference");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_mutation_caught);
    tcase_add_test(tc, test_permute_special);
    tcase_add_test(tc, test_combine_special);
    tcase_add_test(tc, test_permute_grid);
    tcase_add_test(tc, test_scatter_grid);
    tcase_add_test(tc, test_scatter_skips_positions);
    tcase_add_test(tc, test_combine_grid);
    suite_add_tcase(s, tc);
    /* Rows past a loop-limited driver's budget (--case loop_budget). */
    TCase *budget = tcase_create("loop_budget");
    tcase_set_timeout(budget, 600);
    tcase_add_test(budget, test_loop_budget);
    suite_add_tcase(s, budget);
    return harness_run(s);
}
