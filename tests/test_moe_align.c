/* moecl_moe_align against the reference (tests/reference.c), compared
 * exactly: random, skewed and empty loads, invalid ids, every block size
 * and expert count of the grid, both paths (host; device buffers with
 * offsets, poisoned, chained by events), the gather/scatter round trip,
 * every validation error, and a mutated kernel that the suite must catch.
 * meson runs it once per launch class (--variant class=cpu|gpu), so the CPU
 * (one work-item per chunk) and GPU (tiles of work-items) kernels are both
 * checked on every device. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "internal.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* One result, every output poisoned before the call. */
typedef struct result {
    int32_t *counts, *sorted, *blocks, *slots;
    int32_t post, invalid;
    size_t slots_n, max_padded, num_blocks;
} result;

static void result_alloc(const moecl_moe_align_desc *d, result *r)
{
    r->slots_n = (size_t)d->num_tokens * d->top_k;
    r->max_padded = (size_t)moecl_moe_align_max_padded(d);
    r->num_blocks = r->max_padded / d->block_size;
    /* One element past each output, which must stay poison. */
    r->counts = malloc(((size_t)d->num_experts + 1) * 4);
    r->sorted = malloc((r->max_padded + 1) * 4);
    r->blocks = malloc((r->num_blocks + 1) * 4);
    r->slots = malloc((r->slots_n + 1) * 4);
    ck_assert(r->counts && r->sorted && r->blocks && r->slots);
}

static void result_poison(const moecl_moe_align_desc *d, result *r)
{
    memset(r->counts, HARNESS_POISON, ((size_t)d->num_experts + 1) * 4);
    memset(r->sorted, HARNESS_POISON, (r->max_padded + 1) * 4);
    memset(r->blocks, HARNESS_POISON, (r->num_blocks + 1) * 4);
    memset(r->slots, HARNESS_POISON, (r->slots_n + 1) * 4);
    memset(&r->post, HARNESS_POISON, 4);
    memset(&r->invalid, HARNESS_POISON, 4);
}

static void result_free(result *r)
{
    free(r->counts);
    free(r->sorted);
    free(r->blocks);
    free(r->slots);
}

static void describe(const moecl_moe_align_desc *d, bool device_path, char *buf, size_t size)
{
    snprintf(buf, size, "T=%u k=%u E=%u block=%u G=%u %s path", d->num_tokens, d->top_k, d->num_experts,
             d->block_size, d->num_global_experts, device_path ? "device" : "host");
}

/* Run d on ids through the host path or the device path (buffers at odd
 * offsets, after a wait-list event), outputs poisoned first; with_optional
 * asks for slot_positions and num_invalid. Without a map (d's
 * num_global_experts 0) through moecl_moe_align and moecl_moe_align_host,
 * with one through their _ex forms, the map at an offset too. */
static void run_on_map(moecl_context *ctx, const moecl_moe_align_desc *d, const int32_t *ids, const int32_t *map,
                       bool device_path, bool with_optional, result *r)
{
    char what[128];
    describe(d, device_path, what, sizeof(what));
    result_poison(d, r);
    moecl_status st;
    if (!device_path) {
        int32_t *slots = with_optional ? r->slots : NULL, *invalid = with_optional ? &r->invalid : NULL;
        if (d->num_global_experts) {
            const moecl_moe_align_host_tensors t = {sizeof(t), ids,     r->counts, r->sorted, r->blocks,
                                                    &r->post,  slots,   invalid,   map};
            st = moecl_moe_align_ex_host(ctx, d, &t);
        } else {
            st = moecl_moe_align_host(ctx, d, ids, r->counts, r->sorted, r->blocks, &r->post, slots, invalid);
        }
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        return;
    }
    const size_t e = d->num_experts;
    moecl_buffer in = harness_buffer(ctx, r->slots_n * 4, 12, ids);
    moecl_buffer cb = harness_buffer(ctx, e * 4, 4, NULL);
    moecl_buffer sb = harness_buffer(ctx, r->max_padded * 4, 256 + 4, NULL);
    moecl_buffer bb = harness_buffer(ctx, r->num_blocks * 4, 8, NULL);
    moecl_buffer pb = harness_buffer(ctx, 4, 60, NULL);
    moecl_buffer none = {NULL, 0};
    moecl_buffer lb = with_optional ? harness_buffer(ctx, r->slots_n * 4, 4096 + 4, NULL) : none;
    moecl_buffer ib = with_optional ? harness_buffer(ctx, 4, 4, NULL) : none;
    /* A marker to wait on: the call must honour its wait list. */
    moecl_buffer mb = d->num_global_experts ? harness_buffer(ctx, (size_t)d->num_global_experts * 4, 20, map) : none;
    cl_event before = NULL, done = NULL;
    ck_assert_int_eq(clEnqueueMarkerWithWaitList(moecl_context_queue(ctx), 0, NULL, &before), CL_SUCCESS);
    if (d->num_global_experts) {
        const moecl_moe_align_tensors t = {sizeof(t), in, cb, sb, bb, pb, lb, ib, mb};
        st = moecl_moe_align_ex(ctx, d, &t, 1, &before, &done);
    } else {
        st = moecl_moe_align(ctx, d, in, cb, sb, bb, pb, lb, ib, 1, &before, &done);
    }
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    clReleaseEvent(before);
    harness_read(ctx, cb, (e + 1) * 4, r->counts);
    harness_read(ctx, sb, (r->max_padded + 1) * 4, r->sorted);
    harness_read(ctx, bb, (r->num_blocks + 1) * 4, r->blocks);
    harness_read(ctx, pb, 4, &r->post);
    if (with_optional) {
        harness_read(ctx, lb, (r->slots_n + 1) * 4, r->slots);
        harness_read(ctx, ib, 4, &r->invalid);
    }
    /* Nothing past the ends (the slack of harness_buffer is poison). */
    const uint32_t poison = 0xFFFFFFFFu;
    ck_assert_msg(!memcmp(&r->counts[e], &poison, 4) && !memcmp(&r->sorted[r->max_padded], &poison, 4) &&
                      !memcmp(&r->blocks[r->num_blocks], &poison, 4) &&
                      (!with_optional || !memcmp(&r->slots[r->slots_n], &poison, 4)),
                  "%s: wrote past the end of an output", what);
    harness_release(in);
    harness_release(cb);
    harness_release(sb);
    harness_release(bb);
    harness_release(pb);
    harness_release(lb);
    harness_release(ib);
    harness_release(mb);
}

static void run_on(moecl_context *ctx, const moecl_moe_align_desc *d, const int32_t *ids, bool device_path,
                   bool with_optional, result *r)
{
    run_on_map(ctx, d, ids, NULL, device_path, with_optional, r);
}

static void check_result_map(const moecl_moe_align_desc *d, const int32_t *ids, const int32_t *map,
                             bool device_path, bool with_optional, const result *r)
{
    char msg[256], what[128];
    describe(d, device_path, what, sizeof(what));
    int bad = ref_check_moe_align_map(d, ids, map, r->counts, r->sorted, r->blocks, &r->post,
                                      with_optional ? r->slots : NULL, with_optional ? &r->invalid : NULL, msg,
                                      sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d elements differ; first: %s", what, bad, msg);
}

static void check_result(const moecl_moe_align_desc *d, const int32_t *ids, bool device_path, bool with_optional,
                         const result *r)
{
    check_result_map(d, ids, NULL, device_path, with_optional, r);
}

/* Load kinds. */
enum load {
    LOAD_UNIFORM,   /* ids uniform in [0, E), repeats allowed */
    LOAD_DISTINCT,  /* each row k distinct ids (a routing result), when k <= E */
    LOAD_ONE,       /* every slot to one expert */
    LOAD_SPARSE,    /* only every 5th expert has slots */
    LOAD_INVALID,   /* uniform, with -1 rows, E, large and negative ids */
    NUM_LOADS
};

static int32_t *make_ids(harness_rng *rng, const moecl_moe_align_desc *d, enum load load)
{
    const size_t slots = (size_t)d->num_tokens * d->top_k;
    const uint32_t e = d->num_experts, k = d->top_k;
    int32_t *ids = malloc(slots * 4 + 4);
    ck_assert_ptr_nonnull(ids);
    const int32_t one = (int32_t)(harness_rand_u32(rng) % e);
    for (size_t t = 0; t < d->num_tokens; t++) {
        const bool padding_row = load == LOAD_INVALID && harness_rand_u32(rng) % 8 == 0;
        for (uint32_t j = 0; j < k; j++) {
            int32_t *id = &ids[t * k + j];
            switch (load) {
            case LOAD_DISTINCT:
                if (k <= e) {
                    bool again;
                    do {
                        *id = (int32_t)(harness_rand_u32(rng) % e);
                        again = false;
                        for (uint32_t i = 0; i < j; i++)
                            again |= ids[t * k + i] == *id;
                    } while (again);
                    break;
                }
                /* fall through */
            case LOAD_UNIFORM:
                *id = (int32_t)(harness_rand_u32(rng) % e);
                break;
            case LOAD_ONE:
                *id = one;
                break;
            case LOAD_SPARSE:
                *id = (int32_t)((harness_rand_u32(rng) % ((e + 4) / 5)) * 5);
                break;
            default: {
                static const int32_t bad[] = {-1, -2, INT32_MIN, INT32_MAX, 4096, 1 << 20};
                const uint32_t r = harness_rand_u32(rng);
                if (padding_row)
                    *id = -1;
                else if (r % 10 == 0)
                    *id = r % 20 == 0 ? (int32_t)e : bad[(r / 20) % COUNT(bad)];
                else
                    *id = (int32_t)(r % e);
                break;
            }
            }
        }
    }
    return ids;
}

static void random_case(moecl_context *ctx, const moecl_moe_align_desc *d, enum load load, uint64_t stream,
                        int paths)
{
    harness_rng rng = harness_rng_for(stream);
    int32_t *ids = make_ids(&rng, d, load);
    result r;
    result_alloc(d, &r);
    for (int path = 0; path < 2; path++) {
        /* paths: 1 host, 2 device, 3 both */
        if (!(paths & (1 << path)))
            continue;
        const bool optional = path == 1 || stream % 2 == 0;
        run_on(ctx, d, ids, path == 1, optional, &r);
        check_result(d, ids, path == 1, optional, &r);
    }
    result_free(&r);
    free(ids);
}

/* tokens x top_k x experts x block_size; the load and the path rotate. */
START_TEST(test_grid)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {0, 1, 7, 4096, 65536};
    static const uint32_t topk[] = {1, 2, 8};
    static const uint32_t experts[] = {1, 8, 128, 256, 4096};
    static const uint32_t blocks[] = {1, 16, 64, 128};
    unsigned i = 0;
    for (size_t t = 0; t < COUNT(tokens); t++)
        for (size_t k = 0; k < COUNT(topk); k++)
            for (size_t e = 0; e < COUNT(experts); e++)
                for (size_t b = 0; b < COUNT(blocks); b++, i++) {
                    /* The largest token count at top_k 8 with every expert
                     * count and block size once, not with every pair. */
                    if (tokens[t] == 65536 && (k + e + b) % 3 != 0)
                        continue;
                    if (harness_quick() && tokens[t] == 65536)
                        continue;
                    moecl_moe_align_desc d = moecl_moe_align_desc_init(tokens[t], topk[k], experts[e], blocks[b]);
                    random_case(ctx, &d, (enum load)(i % NUM_LOADS), 1000 + i, 1 << (i % 2));
                }
    moecl_context_destroy(ctx);
}
END_TEST

/* Every load at the seed-like shapes, both paths. */
START_TEST(test_loads)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][4] = {{4083, 8, 128, 64}, {1019, 8, 256, 128}, {129, 6, 160, 16}, {333, 2, 4096, 64}};
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int load = 0; load < NUM_LOADS; load++) {
            moecl_moe_align_desc d = moecl_moe_align_desc_init(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3]);
            random_case(ctx, &d, (enum load)load, 2000 + s * 10 + load, 3);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Skewed and degenerate: every slot to the first, a middle or the last
 * expert; every slot invalid; a single expert; one slot. Checked against
 * the reference and against the facts directly. */
START_TEST(test_skewed)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][4] = {{4096, 8, 256, 64}, {7, 2, 8, 16}, {65, 1, 4096, 1}, {1000, 8, 1, 128}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++) {
        moecl_moe_align_desc d = moecl_moe_align_desc_init(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3]);
        const size_t slots = (size_t)d.num_tokens * d.top_k;
        const int32_t targets[] = {0, (int32_t)d.num_experts / 2, (int32_t)d.num_experts - 1, -1};
        int32_t *ids = malloc(slots * 4);
        result r;
        result_alloc(&d, &r);
        for (size_t tg = 0; tg < COUNT(targets); tg++, i++) {
            for (size_t x = 0; x < slots; x++)
                ids[x] = targets[tg];
            for (int path = 0; path < 2; path++) {
                run_on(ctx, &d, ids, path == 1, true, &r);
                check_result(&d, ids, path == 1, true, &r);
                const int32_t target = targets[tg];
                const size_t padded = target < 0 ? 0 : (slots + d.block_size - 1) / d.block_size * d.block_size;
                ck_assert_int_eq(r.post, (int32_t)padded);
                ck_assert_int_eq(r.invalid, target < 0 ? (int32_t)slots : 0);
                if (target >= 0) {
                    ck_assert_int_eq(r.counts[target], (int32_t)slots);
                    for (size_t x = 0; x < slots; x++)
                        ck_assert_int_eq(r.sorted[x], (int32_t)x);
                    ck_assert_int_eq(r.blocks[0], target);
                }
            }
        }
        result_free(&r);
        free(ids);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* num_tokens 0: counts 0, post 0, every entry the sentinel 0, every block
 * -1, num_invalid 0; and a done event. */
START_TEST(test_empty)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][3] = {{8, 128, 64}, {1, 1, 1}, {2, 4096, 128}};
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int path = 0; path < 2; path++) {
            moecl_moe_align_desc d = moecl_moe_align_desc_init(0, shapes[s][0], shapes[s][1], shapes[s][2]);
            result r;
            result_alloc(&d, &r);
            run_on(ctx, &d, NULL, path == 1, true, &r);
            check_result(&d, NULL, path == 1, true, &r);
            ck_assert_int_eq(r.post, 0);
            ck_assert_int_eq(r.invalid, 0);
            for (size_t p = 0; p < r.max_padded; p++)
                ck_assert_int_eq(r.sorted[p], 0);
            for (size_t b = 0; b < r.num_blocks; b++)
                ck_assert_int_eq(r.blocks[b], -1);
            result_free(&r);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* Gathering rows by sorted_token_ids (skipping the sentinel) and
 * scattering them back by slot_positions restores the original order;
 * sorted_token_ids[slot_positions[s]] == s for every valid slot. */
START_TEST(test_round_trip)
{
    moecl_context *ctx = harness_context();
    moecl_moe_align_desc d = moecl_moe_align_desc_init(2044, 8, 128, 64);
    harness_rng rng = harness_rng_for(3000);
    int32_t *ids = make_ids(&rng, &d, LOAD_INVALID);
    result r;
    result_alloc(&d, &r);
    run_on(ctx, &d, ids, true, true, &r);
    check_result(&d, ids, true, true, &r);
    const size_t slots = r.slots_n, sentinel = slots;
    /* A payload per slot, gathered into expert order. */
    uint64_t *payload = malloc(slots * 8), *gathered = malloc(r.max_padded * 8), *back = malloc(slots * 8);
    for (size_t s = 0; s < slots; s++)
        payload[s] = harness_rand_u32(&rng) | (uint64_t)s << 32;
    for (size_t p = 0; p < (size_t)r.post; p++)
        gathered[p] = (size_t)r.sorted[p] == sentinel ? 0 : payload[r.sorted[p]];
    for (size_t s = 0; s < slots; s++) {
        if (r.slots[s] < 0) {
            ck_assert_msg(ids[s] < 0 || ids[s] >= (int32_t)d.num_experts, "slot %zu: id %d but position -1", s,
                          ids[s]);
            back[s] = payload[s];
            continue;
        }
        ck_assert_int_eq(r.sorted[r.slots[s]], (int32_t)s);
        ck_assert_int_lt(r.slots[s], r.post);
        back[s] = gathered[r.slots[s]];
    }
    ck_assert_msg(memcmp(back, payload, slots * 8) == 0, "the round trip did not restore the order");
    free(payload);
    free(gathered);
    free(back);
    result_free(&r);
    free(ids);
    moecl_context_destroy(ctx);
}
END_TEST

/* _prepare, then two calls chained on the device by events, the second
 * reading the first's slot_positions as its ids (any int32 data works). */
START_TEST(test_prepare_and_chain)
{
    moecl_context *ctx = harness_context();
    moecl_moe_align_desc d = moecl_moe_align_desc_init(0, 2, 16, 4);
    ck_assert_int_eq(moecl_moe_align_prepare(ctx, &d), MOECL_SUCCESS);
    d.num_tokens = 100;
    harness_rng rng = harness_rng_for(4000);
    int32_t *ids = make_ids(&rng, &d, LOAD_UNIFORM);
    const size_t slots = 200, max_padded = (size_t)moecl_moe_align_max_padded(&d);
    moecl_buffer in = harness_buffer(ctx, slots * 4, 0, ids);
    moecl_buffer c = harness_buffer(ctx, 64, 0, NULL), s = harness_buffer(ctx, max_padded * 4, 0, NULL);
    moecl_buffer b = harness_buffer(ctx, max_padded, 0, NULL), p = harness_buffer(ctx, 4, 0, NULL);
    moecl_buffer slot1 = harness_buffer(ctx, slots * 4, 0, NULL), none = {NULL, 0};
    cl_event first = NULL, second = NULL;
    ck_assert_int_eq(moecl_moe_align(ctx, &d, in, c, s, b, p, slot1, none, 0, NULL, &first), MOECL_SUCCESS);
    moecl_moe_align_desc d2 = moecl_moe_align_desc_init(100, 2, 4096, 1);
    const size_t mp2 = (size_t)moecl_moe_align_max_padded(&d2);
    moecl_buffer c2 = harness_buffer(ctx, 4096 * 4, 0, NULL), s2 = harness_buffer(ctx, mp2 * 4, 0, NULL);
    moecl_buffer b2 = harness_buffer(ctx, mp2 * 4, 0, NULL), p2 = harness_buffer(ctx, 4, 0, NULL);
    moecl_buffer i2 = harness_buffer(ctx, 4, 0, NULL);
    ck_assert_int_eq(moecl_moe_align(ctx, &d2, slot1, c2, s2, b2, p2, none, i2, 1, &first, &second), MOECL_SUCCESS);
    ck_assert_int_eq(clWaitForEvents(1, &second), CL_SUCCESS);
    int32_t *pos = malloc(slots * 4), *counts = malloc(4096 * 4), *sorted = malloc(mp2 * 4), *blocks = malloc(mp2 * 4);
    int32_t post, invalid;
    harness_read(ctx, slot1, slots * 4, pos);
    harness_read(ctx, c2, 4096 * 4, counts);
    harness_read(ctx, s2, mp2 * 4, sorted);
    harness_read(ctx, b2, mp2 * 4, blocks);
    harness_read(ctx, p2, 4, &post);
    harness_read(ctx, i2, 4, &invalid);
    char msg[256];
    ck_assert_msg(ref_check_moe_align(&d2, pos, counts, sorted, blocks, &post, NULL, &invalid, msg, sizeof(msg)) == 0,
                  "chained call: %s", msg);
    clReleaseEvent(first);
    clReleaseEvent(second);
    moecl_buffer all[] = {in, c, s, b, p, slot1, c2, s2, b2, p2, i2};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(all[i]);
    free(ids);
    free(pos);
    free(counts);
    free(sorted);
    free(blocks);
    moecl_context_destroy(ctx);
}
END_TEST

/* The six outputs (counts, sorted, blocks, post, slots, invalid) of
 * sizes[i] bytes (at most 512) are still poison after rejected calls. */
static void assert_poison(moecl_context *ctx, const moecl_buffer outs[6], const size_t sizes[6])
{
    clFinish(moecl_context_queue(ctx));
    for (size_t i = 0; i < 6; i++) {
        unsigned char buf[512];
        ck_assert(sizes[i] <= sizeof(buf));
        harness_read(ctx, outs[i], sizes[i], buf);
        for (size_t x = 0; x < sizes[i]; x++)
            ck_assert_msg(buf[x] == HARNESS_POISON, "output %zu byte %zu changed by a rejected call", i, x);
    }
}

/* Every validation error: the status, a message naming the field, nothing
 * written (device buffers and host arrays keep their poison). */
START_TEST(test_bad_input)
{
    moecl_context *ctx = harness_context();
    moecl_context *other = harness_context();
    const moecl_moe_align_desc good = moecl_moe_align_desc_init(16, 2, 8, 4);
    const size_t slots = 32, mp = (size_t)moecl_moe_align_max_padded(&good), nb = mp / 4;
    int32_t ids[32];
    for (size_t s = 0; s < slots; s++)
        ids[s] = (int32_t)(s % 8);
    moecl_buffer in = harness_buffer(ctx, slots * 4, 0, ids);
    moecl_buffer c = harness_buffer(ctx, 8 * 4, 0, NULL), s = harness_buffer(ctx, mp * 4, 0, NULL);
    moecl_buffer b = harness_buffer(ctx, nb * 4, 0, NULL), p = harness_buffer(ctx, 4, 0, NULL);
    moecl_buffer l = harness_buffer(ctx, slots * 4, 0, NULL), iv = harness_buffer(ctx, 4, 0, NULL);
    moecl_buffer foreign = harness_buffer(other, 4096, 0, NULL);
    moecl_buffer none = {NULL, 0};
    cl_mem small = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 8, NULL, NULL);
    moecl_buffer tiny = {small, 0};
    struct {
        const char *label, *field;
        moecl_moe_align_desc d;
        int which; /* buffer to replace: 0 none, 1 ids .. 7 invalid */
        moecl_buffer with;
        int wait;  /* 1: num_wait 1 with wait NULL */
    } cases[] = {
        {"experts 0", "num_experts", moecl_moe_align_desc_init(16, 2, 0, 4), 0, {0}, 0},
        {"experts 4097", "num_experts", moecl_moe_align_desc_init(16, 2, 4097, 4), 0, {0}, 0},
        {"top_k 0", "top_k", moecl_moe_align_desc_init(16, 0, 8, 4), 0, {0}, 0},
        {"top_k 65", "top_k", moecl_moe_align_desc_init(16, 65, 8, 4), 0, {0}, 0},
        {"block 0", "block_size", moecl_moe_align_desc_init(16, 2, 8, 0), 0, {0}, 0},
        {"block 1025", "block_size", moecl_moe_align_desc_init(16, 2, 8, 1025), 0, {0}, 0},
        {"too many tokens", "num_tokens", moecl_moe_align_desc_init(UINT32_MAX / 64, 64, 8, 4), 0, {0}, 0},
        {"int32 overflow by padding", "num_tokens", moecl_moe_align_desc_init(INT32_MAX / 64 - 100, 64, 4096, 1024),
         0, {0}, 0},
        {"ids absent", "topk_ids", good, 1, none, 0},
        {"ids small", "topk_ids", good, 1, tiny, 0},
        {"ids unaligned", "topk_ids", good, 1, {in.mem, 2}, 0},
        {"ids foreign", "topk_ids", good, 1, foreign, 0},
        {"counts absent", "expert_counts", good, 2, none, 0},
        {"counts small", "expert_counts", good, 2, tiny, 0},
        {"sorted absent", "sorted_token_ids", good, 3, none, 0},
        {"sorted small", "sorted_token_ids", good, 3, {s.mem, 128}, 0},
        {"blocks absent", "block_expert_ids", good, 4, none, 0},
        {"blocks small", "block_expert_ids", good, 4, tiny, 0},
        {"post absent", "num_tokens_post_padded", good, 5, none, 0},
        {"post past the end", "num_tokens_post_padded", good, 5, {p.mem, 68}, 0},
        {"slots small", "slot_positions", good, 6, tiny, 0},
        {"slots foreign", "slot_positions", good, 6, foreign, 0},
        {"invalid unaligned", "num_invalid", good, 7, {iv.mem, 1}, 0},
        {"wait NULL", "wait", good, 0, {0}, 1},
    };
    for (size_t i = 0; i < COUNT(cases); i++) {
        moecl_buffer a[8] = {none, in, c, s, b, p, l, iv};
        if (cases[i].which)
            a[cases[i].which] = cases[i].with;
        cl_event done = NULL;
        moecl_status st = moecl_moe_align(ctx, &cases[i].d, a[1], a[2], a[3], a[4], a[5], a[6], a[7],
                                          cases[i].wait ? 1 : 0, NULL, &done);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", cases[i].label, (int)st,
                      moecl_status_string(st));
        ck_assert_msg(done == NULL, "%s: an event was returned", cases[i].label);
        ck_assert_msg(strstr(moecl_context_error(ctx), cases[i].field) != NULL, "%s: message \"%s\" does not name %s",
                      cases[i].label, moecl_context_error(ctx), cases[i].field);
        /* The host path and prepare reject the descriptor errors too. */
        if (cases[i].which == 0 && !cases[i].wait) {
            int32_t counts[8], sorted[64], blocks[16], post = -7, slotpos[32], invalid = -7;
            memset(counts, HARNESS_POISON, sizeof(counts));
            memset(sorted, HARNESS_POISON, sizeof(sorted));
            st = moecl_moe_align_host(ctx, &cases[i].d, ids, counts, sorted, blocks, &post, slotpos, &invalid);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s (host): status %d", cases[i].label, (int)st);
            ck_assert_msg(strstr(moecl_context_error(ctx), cases[i].field) != NULL, "%s (host): \"%s\"",
                          cases[i].label, moecl_context_error(ctx));
            ck_assert_int_eq(post, -7);
            ck_assert_int_eq(invalid, -7);
            for (size_t x = 0; x < 8; x++)
                ck_assert_int_eq(counts[x], -1);
            ck_assert_int_eq(moecl_moe_align_prepare(ctx, &cases[i].d), MOECL_ERROR_INVALID_ARGUMENT);
        }
    }
    /* Host path: missing required arrays. */
    int32_t counts[8], sorted[64], blocks[16], post = -7;
    ck_assert_int_eq(moecl_moe_align_host(ctx, &good, NULL, counts, sorted, blocks, &post, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "topk_ids"));
    ck_assert_int_eq(moecl_moe_align_host(ctx, &good, ids, counts, NULL, blocks, &post, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "sorted_token_ids"));
    ck_assert_int_eq(moecl_moe_align_host(ctx, &good, ids, counts, sorted, blocks, NULL, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "num_tokens_post_padded"));
    ck_assert_int_eq(post, -7);
    ck_assert_int_eq(moecl_moe_align_host(ctx, NULL, ids, counts, sorted, blocks, &post, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_moe_align(NULL, &good, in, c, s, b, p, l, iv, 0, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_moe_align_prepare(NULL, &good), MOECL_ERROR_INVALID_ARGUMENT);
    /* After all that, the device outputs are untouched poison. */
    const moecl_buffer outs[] = {c, s, b, p, l, iv};
    const size_t sizes[] = {8 * 4, mp * 4, nb * 4, 4, slots * 4, 4};
    assert_poison(ctx, outs, sizes);
    ck_assert_uint_eq(moecl_moe_align_max_padded(NULL), 0);
    ck_assert_uint_eq(moecl_moe_align_max_padded(&good), 32 + 8 * 3);
    moecl_buffer all[] = {in, c, s, b, p, l, iv, foreign, tiny};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(all[i]);
    moecl_context_destroy(other);
    moecl_context_destroy(ctx);
}
END_TEST

/* The checker must reject a wrong answer: poison, an unstable order (two
 * slots of one expert swapped), a wrong block, a wrong count. */
START_TEST(test_checker_rejects)
{
    moecl_moe_align_desc d = moecl_moe_align_desc_init(64, 2, 8, 4);
    harness_rng rng = harness_rng_for(5000);
    int32_t *ids = make_ids(&rng, &d, LOAD_INVALID);
    result r;
    result_alloc(&d, &r);
    ref_moe_align(&d, ids, r.counts, r.sorted, r.blocks, &r.post, r.slots, &r.invalid);
    char msg[256];
    ck_assert_int_eq(ref_check_moe_align(&d, ids, r.counts, r.sorted, r.blocks, &r.post, r.slots, &r.invalid, msg,
                                         sizeof(msg)),
                     0);
    int32_t *sorted = malloc(r.max_padded * 4);
    memcpy(sorted, r.sorted, r.max_padded * 4);
    /* Swap the first two entries of the first expert with two slots. */
    for (size_t p = 0; p + 1 < (size_t)r.post; p++)
        if (sorted[p] != (int32_t)r.slots_n && sorted[p + 1] != (int32_t)r.slots_n &&
            ids[sorted[p]] == ids[sorted[p + 1]]) {
            int32_t t = sorted[p];
            sorted[p] = sorted[p + 1];
            sorted[p + 1] = t;
            break;
        }
    ck_assert_int_ne(ref_check_moe_align(&d, ids, r.counts, sorted, r.blocks, &r.post, NULL, NULL, msg, sizeof(msg)),
                     0);
    ck_assert_ptr_nonnull(strstr(msg, "sorted_token_ids"));
    r.blocks[1] ^= 1;
    ck_assert_int_ne(ref_check_moe_align(&d, ids, r.counts, r.sorted, r.blocks, &r.post, NULL, NULL, msg, sizeof(msg)),
                     0);
    r.blocks[1] ^= 1;
    r.counts[3]++;
    ck_assert_int_ne(ref_check_moe_align(&d, ids, r.counts, r.sorted, r.blocks, &r.post, NULL, NULL, msg, sizeof(msg)),
                     0);
    result_poison(&d, &r);
    ck_assert_int_ne(ref_check_moe_align(&d, ids, r.counts, r.sorted, r.blocks, &r.post, r.slots, &r.invalid, msg,
                                         sizeof(msg)),
                     0);
    free(sorted);
    result_free(&r);
    free(ids);
}
END_TEST

/* A copy of cl/moe_align.cl with each edits[i][0] replaced by
 * edits[i][1] (each must occur once) in a new folder dir (a mkdtemp
 * template), for MOECL_KERNEL_DIR; file receives its path. */
static void write_mutant(const char *const (*edits)[2], size_t n, char *dir, char *file, size_t file_size)
{
    const char *cl_dir = getenv("MOECL_TEST_CL_DIR");
    ck_assert_msg(cl_dir && *cl_dir, "MOECL_TEST_CL_DIR is not set (meson sets it to the source cl/ folder)");
    snprintf(file, file_size, "%s/moe_align.cl", cl_dir);
    FILE *f = fopen(file, "rb");
    ck_assert_msg(f != NULL, "cannot read %s", file);
    char *text = calloc(1, 1 << 20);
    size_t len = fread(text, 1, (1 << 20) - 1, f);
    fclose(f);
    text[len] = '\0';
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(harness_replace_once(&text, edits[i][0], edits[i][1]),
                      "a mutation's anchor is not in cl/moe_align.cl: \"%s\"", edits[i][0]);
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(file, file_size, "%s/moe_align.cl", dir);
    f = fopen(file, "wb");
    ck_assert_ptr_nonnull(f);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
    free(text);
}

/* The CPU kernels' in-order walk (place_in_order: the scatter's, both
 * fused kernels'), and the same walk backwards. */
#define IN_ORDER_WALK "    for (uint s = from; s < to; s++) {\n"
#define IN_ORDER_WALK_REVERSED "    for (uint i = from; i < to; i++) {\n        const uint s = from + to - 1 - i;\n"
/* The GPU kernels' tiles (place_chunk: the scatter's, the parallel fused
 * kernel's), and each tile's slots in reverse. */
#define TILE_SLOT "const uint s = base + lid;"
#define TILE_SLOT_REVERSED "const uint s = base + n - 1 - lid;"

/* The mutant's differences from the reference on a routing of 512 tokens,
 * top 8 of 16 experts, block 16 (stream: its ids), on the device or the
 * host path; msg receives the first. */
static int mutant_differences(moecl_context *ctx, uint64_t stream, bool device_path, char *msg, size_t size)
{
    moecl_moe_align_desc d = moecl_moe_align_desc_init(512, 8, 16, 16);
    harness_rng rng = harness_rng_for(stream);
    int32_t *ids = make_ids(&rng, &d, LOAD_UNIFORM);
    result r;
    result_alloc(&d, &r);
    run_on(ctx, &d, ids, device_path, true, &r);
    int bad = ref_check_moe_align(&d, ids, r.counts, r.sorted, r.blocks, &r.post, r.slots, &r.invalid, msg, size);
    result_free(&r);
    free(ids);
    return bad;
}

/* A copy of cl/moe_align.cl whose CPU kernels walk their slots backwards
 * (the scatter's chunks, the fused kernels' slots), whose scatter and
 * parallel fused kernel take each tile's slots in reverse (GPU kernels:
 * place_chunk), whose one-group kernel takes
 * each tile's slots in reverse too (its NVIDIA warp path ranks equal ids
 * in reverse), and whose fused kernel ranks each tile in reverse (GPU
 * kernel), loaded through MOECL_KERNEL_DIR: still a grouping by expert,
 * but not stable. The suite's check must catch it. */
START_TEST(test_mutation_caught)
{
    static const char *const edits[][2] = {
        {IN_ORDER_WALK, IN_ORDER_WALK_REVERSED},
        {TILE_SLOT, TILE_SLOT_REVERSED},
        {"const uint slot = base + lid;", "const uint slot = base + ONE_WG - 1 - lid;"},
        {"const uint s = at + lid;", "const uint s = at + FUSED_WG - 1 - lid;"},
        {"slot_cols[slot] = (ushort)(tot[e] + popcount(same & lower));",
         "slot_cols[slot] = (ushort)(tot[e] + popcount(same) - 1 - popcount(same & lower));"},
    };
    char dir[] = "/tmp/moecl-mutant-XXXXXX", path[4096];
    write_mutant(edits, COUNT(edits), dir, path, sizeof(path));
    moecl_context *ctx = harness_context_with_kernel_dir(dir);
    char msg[256];
    int bad = mutant_differences(ctx, 6000, false, msg, sizeof(msg));
    ck_assert_msg(bad > 0, "the unstable mutant passed the check");
    fprintf(stderr, "moe_align: the unstable mutant was caught: %d elements differ; first: %s\n", bad, msg);
    moecl_context_destroy(ctx);
    remove(path);
    rmdir(dir);
}
END_TEST

/* ---- expert parallelism: a global-to-local expert map ---- */

/* Map kinds: a rank's contiguous block of experts (vLLM's EP), a
 * scattered subset in a shuffled order, every expert remote, and a
 * scattered map with bad entries (neither -1 nor a local expert). */
enum map_kind { MAP_BLOCK, MAP_SCATTERED, MAP_ALL_REMOTE, MAP_BAD, NUM_MAPS };

/* A map of d->num_global_experts entries onto d->num_experts local ones
 * (rank: which block, for MAP_BLOCK). */
static int32_t *make_map(harness_rng *rng, const moecl_moe_align_desc *d, enum map_kind kind, uint32_t rank)
{
    const uint32_t g = d->num_global_experts, e = d->num_experts;
    int32_t *map = malloc((size_t)g * 4);
    ck_assert_ptr_nonnull(map);
    for (uint32_t x = 0; x < g; x++)
        map[x] = kind == MAP_BLOCK && x / e == rank ? (int32_t)(x % e) : -1;
    if (kind == MAP_SCATTERED || kind == MAP_BAD) {
        /* Local expert l at a random global slot not yet taken. */
        for (uint32_t l = 0; l < e && l < g; l++) {
            uint32_t at;
            do
                at = harness_rand_u32(rng) % g;
            while (map[at] != -1);
            map[at] = (int32_t)l;
        }
    }
    if (kind == MAP_BAD) {
        static const int32_t bad[] = {-2, INT32_MIN, INT32_MAX, 0 /* E */, 1 /* E + 7 */};
        for (uint32_t x = 0; x < g; x++)
            if (harness_rand_u32(rng) % 5 == 0) {
                const int32_t b = bad[harness_rand_u32(rng) % COUNT(bad)];
                map[x] = b == 0 ? (int32_t)e : b == 1 ? (int32_t)e + 7 : b;
            }
    }
    return map;
}

/* Global ids: uniform in [0, G), with padding rows of -1 and some ids
 * outside [0, G). */
static int32_t *make_global_ids(harness_rng *rng, const moecl_moe_align_desc *d)
{
    const size_t slots = (size_t)d->num_tokens * d->top_k;
    const uint32_t g = d->num_global_experts;
    int32_t *ids = malloc(slots * 4 + 4);
    ck_assert_ptr_nonnull(ids);
    static const int32_t bad[] = {-1, -3, INT32_MIN, INT32_MAX};
    for (size_t t = 0; t < d->num_tokens; t++) {
        const bool padding_row = harness_rand_u32(rng) % 10 == 0;
        for (uint32_t j = 0; j < d->top_k; j++) {
            const uint32_t r = harness_rand_u32(rng);
            int32_t *id = &ids[t * d->top_k + j];
            if (padding_row)
                *id = -1;
            else if (r % 16 == 0)
                *id = r % 32 == 0 ? (int32_t)g : bad[(r / 32) % COUNT(bad)];
            else
                *id = (int32_t)(r % g);
        }
    }
    return ids;
}

/* Every map kind at several shapes, host and device, on each path forced
 * in turn (and the default choice), against the reference. */
START_TEST(test_expert_map)
{
    static const char *const paths[] = {NULL, "align=fused", "align=chunked", "align=one-group",
                                        "align=fused-parallel"};
    /* tokens, top_k, local experts, ranks, block */
    static const uint32_t shapes[][5] = {{0, 2, 8, 4, 16},     {1, 8, 32, 8, 16},   {37, 4, 16, 2, 4},
                                         {1000, 8, 32, 8, 64}, {513, 6, 160, 2, 16}, {4096, 8, 64, 4, 128},
                                         {3000, 2, 4096, 1, 1}};
    unsigned i = 0;
    for (size_t path = 0; path < COUNT(paths); path++) {
        harness_override_with(paths[path]);
        moecl_context *ctx = harness_context();
        for (size_t sh = 0; sh < COUNT(shapes); sh++) {
            if (harness_quick() && shapes[sh][0] >= 3000)
                continue;
            moecl_moe_align_desc d = moecl_moe_align_desc_init(shapes[sh][0], shapes[sh][1], shapes[sh][2],
                                                               shapes[sh][4]);
            d.num_global_experts = shapes[sh][2] * shapes[sh][3];
            result r;
            result_alloc(&d, &r);
            for (int kind = 0; kind < NUM_MAPS; kind++, i++) {
                harness_rng rng = harness_rng_for(9000 + i);
                int32_t *ids = make_global_ids(&rng, &d);
                int32_t *map = make_map(&rng, &d, (enum map_kind)kind, harness_rand_u32(&rng) % shapes[sh][3]);
                for (int device = 0; device < 2; device++) {
                    const bool optional = device || i % 2 == 0;
                    run_on_map(ctx, &d, ids, map, device, optional, &r);
                    char what[160];
                    describe(&d, device, what, sizeof(what));
                    check_result_map(&d, ids, map, device, optional, &r);
                    if (kind == MAP_ALL_REMOTE) {
                        /* Nothing aligned; only ids outside [0, G) counted. */
                        int32_t outside = 0;
                        for (size_t x = 0; x < r.slots_n; x++)
                            outside += ids[x] < 0 || ids[x] >= (int32_t)d.num_global_experts;
                        ck_assert_msg(r.post == 0, "%s, all remote: post %d", what, r.post);
                        if (optional)
                            ck_assert_msg(r.invalid == outside, "%s, all remote: num_invalid %d, want %d", what,
                                          r.invalid, outside);
                    }
                }
                free(ids);
                free(map);
            }
            result_free(&r);
        }
        moecl_context_destroy(ctx);
    }
    harness_override_with(NULL);
}
END_TEST

/* The map's validation: the status, a message naming the field, nothing
 * written. */
START_TEST(test_expert_map_bad_input)
{
    moecl_context *ctx = harness_context();
    moecl_moe_align_desc d = moecl_moe_align_desc_init(16, 2, 8, 4);
    d.num_global_experts = 32;
    const size_t slots = 32, mp = (size_t)moecl_moe_align_max_padded(&d), nb = mp / 4;
    harness_rng rng = harness_rng_for(9500);
    int32_t *ids = make_global_ids(&rng, &d), *map = make_map(&rng, &d, MAP_BLOCK, 1);
    moecl_buffer in = harness_buffer(ctx, slots * 4, 0, ids), c = harness_buffer(ctx, 8 * 4, 0, NULL);
    moecl_buffer s = harness_buffer(ctx, mp * 4, 0, NULL), b = harness_buffer(ctx, nb * 4, 0, NULL);
    moecl_buffer p = harness_buffer(ctx, 4, 0, NULL), l = harness_buffer(ctx, slots * 4, 0, NULL);
    moecl_buffer iv = harness_buffer(ctx, 4, 0, NULL), m = harness_buffer(ctx, 32 * 4, 0, map);
    /* Exactly one entry short (harness_buffer's slack would hide it). */
    cl_int err;
    moecl_buffer small = {clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 31 * 4, NULL, &err), 0};
    ck_assert_int_eq(err, CL_SUCCESS);
    moecl_buffer none = {NULL, 0};
    const moecl_moe_align_tensors good = {sizeof(good), in, c, s, b, p, l, iv, m};
    moecl_moe_align_desc no_map = d;
    no_map.num_global_experts = 0;
    struct {
        moecl_moe_align_tensors t;
        uint64_t later;
    } big = {good, 1};
    big.t.struct_size = sizeof(big);
    moecl_moe_align_tensors t;
    struct {
        const char *label, *field;
        const moecl_moe_align_desc *d;
        const moecl_moe_align_tensors *t;
        int edit; /* 0 none, 1 no map, 2 small map, 3 short struct */
    } cases[] = {
        {"map without num_global_experts", "num_global_experts", &no_map, &good, 0},
        {"num_global_experts without map", "expert_map", &d, &t, 1},
        {"map too small", "expert_map", &d, &t, 2},
        {"struct_size too small", "struct_size", &d, &t, 3},
        {"a struct_size this moecl does not know", "struct_size", &d, &big.t, 0},
        {"tensors NULL", "tensors", &d, NULL, 0},
    };
    for (size_t x = 0; x < COUNT(cases); x++) {
        t = good;
        if (cases[x].edit == 1)
            t.expert_map = none;
        else if (cases[x].edit == 2)
            t.expert_map = small;
        else if (cases[x].edit == 3)
            t.struct_size = sizeof(t) - 1;
        const moecl_status st = moecl_moe_align_ex(ctx, cases[x].d, cases[x].t, 0, NULL, NULL);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d", cases[x].label, (int)st);
        ck_assert_msg(strstr(moecl_context_error(ctx), cases[x].field) != NULL, "%s: \"%s\"", cases[x].label,
                      moecl_context_error(ctx));
    }
    /* The call without the _ex form takes no map. */
    ck_assert_int_eq(moecl_moe_align(ctx, &d, in, c, s, b, p, l, iv, 0, NULL, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "expert_map"));
    /* The host forms likewise, leaving the host outputs as they were. */
    int32_t counts[8], sorted[64], blocks[16], post = -7;
    memset(counts, HARNESS_POISON, sizeof(counts));
    ck_assert_int_eq(moecl_moe_align_host(ctx, &d, ids, counts, sorted, blocks, &post, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    moecl_moe_align_host_tensors h = {sizeof(h), ids, counts, sorted, blocks, &post, NULL, NULL, NULL};
    ck_assert_int_eq(moecl_moe_align_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "expert_map"));
    h.expert_map = map;
    h.struct_size = 8;
    ck_assert_int_eq(moecl_moe_align_ex_host(ctx, &d, &h), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "struct_size"));
    ck_assert_int_eq(moecl_moe_align_ex_host(ctx, &d, NULL), MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(post, -7);
    for (size_t x = 0; x < 8; x++)
        ck_assert_int_eq(counts[x], -1);
    /* After all that, the device outputs are untouched poison. */
    const moecl_buffer outs[] = {c, s, b, p, l, iv};
    const size_t sizes[] = {8 * 4, mp * 4, nb * 4, 4, slots * 4, 4};
    assert_poison(ctx, outs, sizes);
    /* prepare builds the map's kernels; then the good call works. */
    ck_assert_int_eq(moecl_moe_align_prepare(ctx, &d), MOECL_SUCCESS);
    cl_event done = NULL;
    ck_assert_int_eq(moecl_moe_align_ex(ctx, &d, &good, 0, NULL, &done), MOECL_SUCCESS);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    result r;
    result_alloc(&d, &r);
    harness_read(ctx, c, 8 * 4, r.counts);
    harness_read(ctx, s, mp * 4, r.sorted);
    harness_read(ctx, b, nb * 4, r.blocks);
    harness_read(ctx, p, 4, &r.post);
    harness_read(ctx, l, slots * 4, r.slots);
    harness_read(ctx, iv, 4, &r.invalid);
    check_result_map(&d, ids, map, true, true, &r);
    result_free(&r);
    moecl_buffer all[] = {in, c, s, b, p, l, iv, m, small};
    for (size_t x = 0; x < COUNT(all); x++)
        harness_release(all[x]);
    free(ids);
    free(map);
    moecl_context_destroy(ctx);
}
END_TEST

/* Copies of cl/moe_align.cl with the map's rule broken, loaded through
 * MOECL_KERNEL_DIR, each on every path: a remote expert's slot counted as
 * invalid; the map read at the wrong entry; invalid ids left uncounted
 * (COUNTED, which the GPU class's fused kernel needs only for remote
 * slots: it counts the invalid column with its tiles). The suite's check
 * must catch each. */
START_TEST(test_expert_map_mutation_caught)
{
    static const char *const mutants[][2] = {
        {"        return num_experts + 1;\n", "        return num_experts;\n"},
        {"    id = expert_map[id];\n", "    id = expert_map[num_global - 1 - id];\n"},
        {"#define COUNTED(e, num_experts) ((e) <= (num_experts))",
         "#define COUNTED(e, num_experts) ((e) < (num_experts))"},
    };
    static const char *const paths[] = {"align=fused", "align=chunked", "align=one-group", "align=fused-parallel"};
    for (size_t mu = 0; mu < COUNT(mutants); mu++) {
        char dir[] = "/tmp/moecl-mutant-XXXXXX", file[4096];
        write_mutant(&mutants[mu], 1, dir, file, sizeof(file));
        for (size_t pa = 0; pa < COUNT(paths); pa++) {
            if (mu == 2 && pa == 0 && strstr(harness_variant(), "class=gpu"))
                continue;
            harness_override_with(paths[pa]);
            moecl_context *ctx = harness_context_with_kernel_dir(dir);
            moecl_moe_align_desc d = moecl_moe_align_desc_init(300, 4, 16, 8);
            d.num_global_experts = 64;
            harness_rng rng = harness_rng_for(9700 + mu);
            int32_t *ids = make_global_ids(&rng, &d), *map = make_map(&rng, &d, MAP_SCATTERED, 0);
            result r;
            result_alloc(&d, &r);
            run_on_map(ctx, &d, ids, map, true, true, &r);
            char msg[256];
            int bad = ref_check_moe_align_map(&d, ids, map, r.counts, r.sorted, r.blocks, &r.post, r.slots,
                                              &r.invalid, msg, sizeof(msg));
            ck_assert_msg(bad > 0, "map mutant %zu passed the check on %s", mu, paths[pa]);
            fprintf(stderr, "moe_align: map mutant %zu caught on %s: %d elements differ; first: %s\n", mu, paths[pa],
                    bad, msg);
            result_free(&r);
            free(ids);
            free(map);
            moecl_context_destroy(ctx);
        }
        harness_override_with(NULL);
        remove(file);
        rmdir(dir);
    }
}
END_TEST

/* ---- the parallel fused kernel (align=fused-parallel) ---- */

static void assert_same_result(const result *x, const result *y, const char *what)
{
    ck_assert_msg(!memcmp(x->sorted, y->sorted, x->max_padded * 4), "%s: sorted_token_ids differ", what);
    ck_assert_msg(!memcmp(x->blocks, y->blocks, x->num_blocks * 4), "%s: block_expert_ids differ", what);
    ck_assert_msg(!memcmp(x->slots, y->slots, x->slots_n * 4), "%s: slot_positions differ", what);
    ck_assert_msg(x->post == y->post && x->invalid == y->invalid, "%s: num_tokens_post_padded or num_invalid differ",
                  what);
}

/* ids on the parallel kernel (par) against the reference, and bit for bit
 * against the fused kernel (fused), on the device or the host path. */
static void parallel_case(moecl_context *par, moecl_context *fused, const moecl_moe_align_desc *d,
                          const int32_t *ids, bool device_path)
{
    char what[128];
    describe(d, device_path, what, sizeof(what));
    result a, b;
    result_alloc(d, &a);
    result_alloc(d, &b);
    run_on(par, d, ids, device_path, true, &a);
    check_result(d, ids, device_path, true, &a);
    run_on(fused, d, ids, device_path, true, &b);
    ck_assert_msg(!memcmp(a.counts, b.counts, d->num_experts * 4), "%s: expert_counts differ", what);
    assert_same_result(&a, &b, what);
    result_free(&a);
    result_free(&b);
}

/* The decode sizes it is for, at and across its one-launch limit (8192
 * slots: 1024 tokens at top 8), 0 and 1 tokens, one expert, 4096 experts
 * and other block sizes, every load (random, distinct, all on one expert,
 * sparse, invalid ids); then every slot on the first, the last or no
 * expert at the limit. Forced, against the reference and the fused
 * kernel's bits. */
START_TEST(test_parallel)
{
    harness_override_with("align=fused-parallel");
    moecl_context *par = harness_context();
    harness_override_with("align=fused");
    moecl_context *fused = harness_context();
    harness_override_with(NULL);
    /* tokens, top_k, experts, block */
    static const uint32_t shapes[][4] = {{0, 8, 128, 64},    {1, 8, 128, 64},    {129, 8, 128, 64},
                                         {256, 8, 128, 64},  {520, 8, 128, 64},  {1019, 8, 128, 64},
                                         {1024, 8, 128, 64}, {1025, 8, 128, 64}, {1, 1, 1, 1},
                                         {37, 3, 4096, 16},  {300, 6, 60, 1},    {2048, 4, 256, 128}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int load = 0; load < NUM_LOADS; load++, i++) {
            if (harness_quick() && (size_t)load != s % NUM_LOADS)
                continue;
            const moecl_moe_align_desc d = moecl_moe_align_desc_init(shapes[s][0], shapes[s][1], shapes[s][2],
                                                                     shapes[s][3]);
            harness_rng rng = harness_rng_for(11000 + i);
            int32_t *ids = make_ids(&rng, &d, (enum load)load);
            parallel_case(par, fused, &d, ids, i % 2 == 0);
            free(ids);
        }
    const moecl_moe_align_desc d = moecl_moe_align_desc_init(1024, 8, 128, 64);
    const size_t slots = (size_t)d.num_tokens * d.top_k;
    int32_t *ids = malloc(slots * 4);
    static const int32_t targets[] = {0, 127, -1};
    for (size_t t = 0; t < COUNT(targets); t++) {
        for (size_t x = 0; x < slots; x++)
            ids[x] = targets[t];
        parallel_case(par, fused, &d, ids, true);
    }
    free(ids);
    moecl_context_destroy(par);
    moecl_context_destroy(fused);
}
END_TEST

/* Copies of cl/moe_align.cl with the parallel kernel broken, loaded
 * through MOECL_KERNEL_DIR, forced: its chunk placed unstably (CPUs: walked
 * backwards; GPUs: each tile's slots in reverse), still grouped by
 * expert; and a chunk's slots placed from their expert's start, as if no
 * earlier chunk had any (caught where there are several work-groups:
 * the GPU class, a CPU of more than one compute unit). The check must
 * catch each. */
START_TEST(test_parallel_mutation_caught)
{
    static const char *const mutants[][2][2] = {
        {{IN_ORDER_WALK, IN_ORDER_WALK_REVERSED}, {TILE_SLOT, TILE_SLOT_REVERSED}},
        {{"        run[e] += start[e];\n", "        run[e] = start[e];\n"}, {NULL, NULL}},
    };
    for (size_t mu = 0; mu < COUNT(mutants); mu++) {
        char dir[] = "/tmp/moecl-mutant-XXXXXX", file[4096];
        write_mutant(mutants[mu], mutants[mu][1][0] ? 2 : 1, dir, file, sizeof(file));
        harness_override_with("align=fused-parallel");
        moecl_context *ctx = harness_context_with_kernel_dir(dir);
        harness_override_with(NULL);
        if (mu == 1 && ctx->info.launch_class == MOECL_LAUNCH_CPU && ctx->info.compute_units < 2) {
            fprintf(stderr, "moe_align: one compute unit, one work-group: parallel mutant %zu not run\n", mu);
        } else {
            char msg[256];
            int bad = mutant_differences(ctx, 6100 + mu, true, msg, sizeof(msg));
            ck_assert_msg(bad > 0, "parallel mutant %zu passed the check", mu);
            fprintf(stderr, "moe_align: parallel mutant %zu caught: %d elements differ; first: %s\n", mu, bad, msg);
        }
        moecl_context_destroy(ctx);
        remove(file);
        rmdir(dir);
    }
}
END_TEST

/* Two threads calling on one context at once: they take turns with the
 * context's scratch (in-order queue), so both results are exact. */
typedef struct thread_job {
    moecl_context *ctx;
    moecl_moe_align_desc d;
    int32_t *ids;
    int failures;
    char msg[256];
} thread_job;

static void *thread_main(void *arg)
{
    thread_job *job = arg;
    const moecl_moe_align_desc *d = &job->d;
    const size_t slots = (size_t)d->num_tokens * d->top_k, mp = (size_t)moecl_moe_align_max_padded(d);
    int32_t *counts = malloc(d->num_experts * 4), *sorted = malloc(mp * 4), *blocks = malloc(mp / d->block_size * 4 + 4);
    int32_t *pos = malloc(slots * 4), post, invalid;
    for (int i = 0; i < 20 && !job->failures; i++) {
        moecl_status st = moecl_moe_align_host(job->ctx, d, job->ids, counts, sorted, blocks, &post, pos, &invalid);
        if (st != MOECL_SUCCESS) {
            snprintf(job->msg, sizeof(job->msg), "call %d: %s", i, moecl_status_string(st));
            job->failures++;
        } else if (ref_check_moe_align(d, job->ids, counts, sorted, blocks, &post, pos, &invalid, job->msg,
                                       sizeof(job->msg))) {
            job->failures++;
        }
    }
    free(counts);
    free(sorted);
    free(blocks);
    free(pos);
    return NULL;
}

START_TEST(test_threads)
{
    moecl_context *ctx = harness_context();
    thread_job jobs[2] = {{ctx, moecl_moe_align_desc_init(3000, 8, 128, 64), NULL, 0, ""},
                          {ctx, moecl_moe_align_desc_init(1500, 2, 4096, 16), NULL, 0, ""}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) {
        harness_rng rng = harness_rng_for(7000 + (uint64_t)i);
        jobs[i].ids = make_ids(&rng, &jobs[i].d, i ? LOAD_INVALID : LOAD_DISTINCT);
    }
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(pthread_create(&threads[i], NULL, thread_main, &jobs[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(threads[i], NULL);
    for (int i = 0; i < 2; i++) {
        ck_assert_msg(jobs[i].failures == 0, "thread %d: %s", i, jobs[i].msg);
        free(jobs[i].ids);
    }
    moecl_context_destroy(ctx);
}
END_TEST

/* Calls enqueued back to back before any is waited for, each larger than
 * the last (an in-order queue's shared scratch grows while the earlier
 * calls' kernels may still be queued), on ctx's own in-order queue and on
 * an adopted out-of-order queue where the device has one. */
static void back_to_back(moecl_context *ctx, const char *label)
{
    enum { CALLS = 4 };
    static const uint32_t shapes[CALLS][4] = {{500, 8, 64, 16}, {4096, 8, 256, 64}, {3000, 2, 4096, 8},
                                              {8192, 8, 128, 128}};
    moecl_moe_align_desc d[CALLS];
    int32_t *ids[CALLS];
    moecl_buffer bufs[CALLS][7];
    cl_event done[CALLS];
    for (int i = 0; i < CALLS; i++) {
        d[i] = moecl_moe_align_desc_init(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3]);
        harness_rng rng = harness_rng_for(8000 + (uint64_t)i);
        ids[i] = make_ids(&rng, &d[i], (enum load)(i % NUM_LOADS));
        const size_t slots = (size_t)d[i].num_tokens * d[i].top_k, mp = (size_t)moecl_moe_align_max_padded(&d[i]);
        const size_t sizes[7] = {slots * 4, d[i].num_experts * 4, mp * 4, mp / d[i].block_size * 4 + 4, 4, slots * 4, 4};
        for (int b = 0; b < 7; b++)
            bufs[i][b] = harness_buffer(ctx, sizes[b], 0, b == 0 ? ids[i] : NULL);
        moecl_status st = moecl_moe_align(ctx, &d[i], bufs[i][0], bufs[i][1], bufs[i][2], bufs[i][3], bufs[i][4],
                                          bufs[i][5], bufs[i][6], 0, NULL, &done[i]);
        ck_assert_msg(st == MOECL_SUCCESS, "%s, call %d: %s: %s", label, i, moecl_status_string(st),
                      moecl_context_error(ctx));
    }
    ck_assert_int_eq(clWaitForEvents(CALLS, done), CL_SUCCESS);
    for (int i = 0; i < CALLS; i++) {
        result r;
        result_alloc(&d[i], &r);
        harness_read(ctx, bufs[i][1], d[i].num_experts * 4, r.counts);
        harness_read(ctx, bufs[i][2], r.max_padded * 4, r.sorted);
        harness_read(ctx, bufs[i][3], r.num_blocks * 4, r.blocks);
        harness_read(ctx, bufs[i][4], 4, &r.post);
        harness_read(ctx, bufs[i][5], r.slots_n * 4, r.slots);
        harness_read(ctx, bufs[i][6], 4, &r.invalid);
        char msg[256];
        ck_assert_msg(ref_check_moe_align(&d[i], ids[i], r.counts, r.sorted, r.blocks, &r.post, r.slots, &r.invalid,
                                          msg, sizeof(msg)) == 0,
                      "%s, call %d: %s", label, i, msg);
        result_free(&r);
        clReleaseEvent(done[i]);
        for (int b = 0; b < 7; b++)
            harness_release(bufs[i][b]);
        free(ids[i]);
    }
}

START_TEST(test_queue_kinds)
{
    moecl_context *ctx = harness_context();
    back_to_back(ctx, "in-order queue");
    cl_device_id dev = moecl_context_device(ctx);
    cl_command_queue_properties props = 0;
    ck_assert_int_eq(clGetDeviceInfo(dev, CL_DEVICE_QUEUE_PROPERTIES, sizeof(props), &props, NULL), CL_SUCCESS);
    if (props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) {
        cl_int err;
        cl_command_queue ooo =
            clCreateCommandQueue(moecl_context_cl_context(ctx), dev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
        ck_assert_int_eq(err, CL_SUCCESS);
        moecl_context *adopted = NULL;
        ck_assert_int_eq(moecl_context_create_from_cl(moecl_context_cl_context(ctx), dev, ooo, &adopted),
                         MOECL_SUCCESS);
        back_to_back(adopted, "out-of-order queue");
        moecl_context_destroy(adopted);
        clReleaseCommandQueue(ooo);
    } else {
        fprintf(stderr, "moe_align: the device has no out-of-order queues; that half of test_queue_kinds is skipped\n");
    }
    moecl_context_destroy(ctx);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("moe_align");
    TCase *tc = tcase_create("reference");
    tcase_set_timeout(tc, 1200);
    tcase_add_test(tc, test_checker_rejects);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_empty);
    tcase_add_test(tc, test_skewed);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_prepare_and_chain);
    tcase_add_test(tc, test_mutation_caught);
    tcase_add_test(tc, test_threads);
    tcase_add_test(tc, test_queue_kinds);
    tcase_add_test(tc, test_loads);
    tcase_add_test(tc, test_grid);
    suite_add_tcase(s, tc);
    TCase *map = tcase_create("expert_map");
    tcase_set_timeout(map, 1200);
    tcase_add_test(map, test_expert_map_bad_input);
    /* Three mutated programs a path: the full runs check the checks. */
    if (!harness_quick())
        tcase_add_test(map, test_expert_map_mutation_caught);
    tcase_add_test(map, test_expert_map);
    suite_add_tcase(s, map);
    /* The parallel fused kernel, forced (--case parallel). */
    TCase *par = tcase_create("parallel");
    tcase_set_timeout(par, 1200);
    tcase_add_test(par, test_parallel);
    tcase_add_test(par, test_parallel_mutation_caught);
    suite_add_tcase(s, par);
    return harness_run(s);
}
