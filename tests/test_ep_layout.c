/* moecl_ep_layout against the reference (tests/reference.c), compared
 * exactly: uniform, skewed and invalid ids; with and without replicas
 * (counts 1..max), tables and contiguous placement, out-of-range table
 * entries; 1, 2, 8 and 64 ranks, ranks that receive nothing, no tokens;
 * both paths (host; device buffers at offsets, poisoned, after a wait-list
 * event); a map changed between two calls of one prepared context; every
 * validation error, with the outputs left untouched. meson runs it once
 * per launch class (--variant class=cpu|gpu), so the CPU (one work-item per
 * chunk) and GPU (tiles of work-items) shapes are both checked. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "internal.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* The inputs of one case. */
typedef struct inputs {
    moecl_ep_layout_desc d;
    int32_t *ids, *l2p, *replicas, *p2r; /* the tables NULL when absent */
} inputs;

/* The outputs, one element past each, which must stay poison. */
typedef struct outputs {
    ref_ep_layout_out o;
    size_t slots, tir;
} outputs;

static void outputs_alloc(const moecl_ep_layout_desc *d, outputs *r, bool optional)
{
    r->slots = (size_t)d->num_tokens * d->top_k;
    r->tir = (size_t)d->num_tokens * d->num_ranks;
    r->o.physical_ids = harness_poisoned((r->slots + 1) * 4);
    r->o.rank_counts = harness_poisoned(((size_t)d->num_ranks + 1) * 4);
    r->o.rank_offsets = harness_poisoned(((size_t)d->num_ranks + 2) * 4);
    r->o.send_slots = harness_poisoned((r->slots + 1) * 4);
    r->o.token_in_rank = optional ? harness_poisoned(r->tir + 4) : NULL;
    r->o.tokens_per_rank = optional ? harness_poisoned(((size_t)d->num_ranks + 1) * 4) : NULL;
    r->o.expert_counts = optional ? harness_poisoned(((size_t)d->num_physical + 1) * 4) : NULL;
    ck_assert(r->o.physical_ids && r->o.rank_counts && r->o.rank_offsets && r->o.send_slots);
}

static void outputs_free(outputs *r)
{
    free(r->o.physical_ids);
    free(r->o.rank_counts);
    free(r->o.rank_offsets);
    free(r->o.send_slots);
    free(r->o.token_in_rank);
    free(r->o.tokens_per_rank);
    free(r->o.expert_counts);
}

static void describe(const inputs *in, bool device_path, char *buf, size_t size)
{
    const moecl_ep_layout_desc *d = &in->d;
    snprintf(buf, size, "T=%u k=%u E=%u P=%u R=%u replicas=%u %s %s, %s path", d->num_tokens, d->top_k,
             d->num_experts, d->num_physical, d->num_ranks, d->max_replicas, in->l2p ? "map" : "identity",
             in->p2r ? "table" : "contiguous", device_path ? "device" : "host");
}

/* A device buffer for a host table, or absent. */
static moecl_buffer table_buffer(moecl_context *ctx, const int32_t *table, size_t n, size_t offset)
{
    moecl_buffer none = {NULL, 0};
    return table ? harness_buffer(ctx, n * 4, offset, table) : none;
}

/* Copy an output back and check the element after it is still poison. */
static void read_checked(moecl_context *ctx, moecl_buffer b, size_t bytes, void *out, const char *what,
                         const char *name)
{
    if (!out)
        return;
    harness_read(ctx, b, bytes + 4, out);
    const unsigned char *tail = (const unsigned char *)out + bytes;
    for (int i = 0; i < 4; i++)
        ck_assert_msg(tail[i] == HARNESS_POISON, "%s: wrote past the end of %s", what, name);
}

static void run_on(moecl_context *ctx, const inputs *in, bool device_path, outputs *r)
{
    char what[160];
    describe(in, device_path, what, sizeof(what));
    const moecl_ep_layout_desc *d = &in->d;
    moecl_status st;
    if (!device_path) {
        st = moecl_ep_layout_host(ctx, d, in->ids, in->l2p, in->replicas, in->p2r, r->o.physical_ids,
                                  r->o.rank_counts, r->o.rank_offsets, r->o.send_slots, r->o.token_in_rank,
                                  r->o.tokens_per_rank, r->o.expert_counts);
        ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
        return;
    }
    const size_t ranks = d->num_ranks, phys = d->num_physical;
    moecl_buffer none = {NULL, 0};
    moecl_buffer ib = harness_buffer(ctx, r->slots * 4, 12, in->ids);
    moecl_buffer lb = table_buffer(ctx, in->l2p, (size_t)d->num_experts * d->max_replicas, 4);
    moecl_buffer cb = table_buffer(ctx, in->replicas, d->num_experts, 8);
    moecl_buffer tb = table_buffer(ctx, in->p2r, phys, 16);
    moecl_buffer pb = harness_buffer(ctx, r->slots * 4, 20, NULL);
    moecl_buffer rcb = harness_buffer(ctx, ranks * 4, 4, NULL);
    moecl_buffer rob = harness_buffer(ctx, (ranks + 1) * 4, 8, NULL);
    moecl_buffer sb = harness_buffer(ctx, r->slots * 4, 256 + 4, NULL);
    moecl_buffer tirb = r->o.token_in_rank ? harness_buffer(ctx, r->tir, 3, NULL) : none;
    moecl_buffer tprb = r->o.tokens_per_rank ? harness_buffer(ctx, ranks * 4, 4, NULL) : none;
    moecl_buffer ecb = r->o.expert_counts ? harness_buffer(ctx, phys * 4, 64, NULL) : none;
    cl_event before = NULL, done = NULL;
    ck_assert_int_eq(clEnqueueMarkerWithWaitList(moecl_context_queue(ctx), 0, NULL, &before), CL_SUCCESS);
    st = moecl_ep_layout(ctx, d, ib, lb, cb, tb, pb, rcb, rob, sb, tirb, tprb, ecb, 1, &before, &done);
    ck_assert_msg(st == MOECL_SUCCESS, "%s: %s: %s", what, moecl_status_string(st), moecl_context_error(ctx));
    ck_assert_ptr_nonnull(done);
    ck_assert_int_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    clReleaseEvent(before);
    read_checked(ctx, pb, r->slots * 4, r->o.physical_ids, what, "physical_ids");
    read_checked(ctx, rcb, ranks * 4, r->o.rank_counts, what, "rank_counts");
    read_checked(ctx, rob, (ranks + 1) * 4, r->o.rank_offsets, what, "rank_offsets");
    read_checked(ctx, sb, r->slots * 4, r->o.send_slots, what, "send_slots");
    read_checked(ctx, tirb, r->tir, r->o.token_in_rank, what, "token_in_rank");
    read_checked(ctx, tprb, ranks * 4, r->o.tokens_per_rank, what, "tokens_per_rank");
    read_checked(ctx, ecb, phys * 4, r->o.expert_counts, what, "expert_counts");
    moecl_buffer all[] = {ib, lb, cb, tb, pb, rcb, rob, sb, tirb, tprb, ecb};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(all[i]);
}

static void check_result(const inputs *in, bool device_path, const outputs *r)
{
    char msg[256], what[160];
    describe(in, device_path, what, sizeof(what));
    int bad = ref_check_ep_layout(&in->d, in->ids, in->l2p, in->replicas, in->p2r, &r->o, msg, sizeof(msg));
    ck_assert_msg(bad == 0, "%s: %d elements differ; first: %s", what, bad, msg);
}

/* Load kinds of the ids. */
enum load {
    LOAD_DISTINCT, /* each row top_k distinct ids (a routing result) */
    LOAD_SKEWED,   /* most slots to the first few experts (hot experts) */
    LOAD_INVALID,  /* distinct, with -1 rows and out-of-range ids */
    NUM_LOADS
};

static int32_t *make_ids(harness_rng *rng, const moecl_ep_layout_desc *d, enum load load)
{
    const size_t slots = (size_t)d->num_tokens * d->top_k;
    const uint32_t e = d->num_experts, k = d->top_k;
    int32_t *ids = malloc(slots * 4 + 4);
    ck_assert_ptr_nonnull(ids);
    for (size_t t = 0; t < d->num_tokens; t++) {
        const bool padding_row = load == LOAD_INVALID && harness_rand_u32(rng) % 8 == 0;
        for (uint32_t j = 0; j < k; j++) {
            int32_t *id = &ids[t * k + j];
            const uint32_t r = harness_rand_u32(rng);
            if (padding_row) {
                *id = -1;
            } else if (load == LOAD_INVALID && r % 10 == 0) {
                static const int32_t bad[] = {-1, -2, INT32_MIN, INT32_MAX, 4096, 1 << 20};
                *id = r % 20 == 0 ? (int32_t)e : bad[(r / 20) % COUNT(bad)];
            } else if (load == LOAD_SKEWED && r % 4 != 0) {
                *id = (int32_t)((r / 4) % (e < 4 ? e : 4));
            } else if (k <= e) {
                bool again;
                do {
                    *id = (int32_t)(harness_rand_u32(rng) % e);
                    again = false;
                    for (uint32_t i = 0; i < j; i++)
                        again |= ids[t * k + i] == *id;
                } while (again);
            } else {
                *id = (int32_t)(r % e);
            }
        }
    }
    return ids;
}

/* Placement kinds. */
enum placement {
    PLACE_IDENTITY_BLOCKS, /* no map, contiguous blocks */
    PLACE_IDENTITY_TABLE,  /* no map, a random table (some ranks may get nothing) */
    PLACE_MAP_BLOCKS,      /* replicas, contiguous blocks */
    PLACE_MAP_TABLE,       /* replicas, a table */
    PLACE_MAP_CORRUPT,     /* replicas and a table, with out-of-range entries in every table */
    NUM_PLACEMENTS
};

/* The physical experts: the logical ones, then each replica after the
 * first of the hot experts (the first `hot`), so that replica r of hot
 * expert e is num_experts + (r - 1) * hot + e; the replica counts 1..max
 * spread over the hot experts. */
static void make_map(harness_rng *rng, inputs *in, uint32_t max_replicas, bool corrupt)
{
    moecl_ep_layout_desc *d = &in->d;
    const uint32_t e = d->num_experts, hot = e < 32 ? e : 32;
    d->max_replicas = max_replicas;
    d->num_physical = e + hot * (max_replicas - 1);
    in->l2p = malloc((size_t)e * max_replicas * 4);
    in->replicas = malloc((size_t)e * 4);
    ck_assert(in->l2p && in->replicas);
    for (uint32_t x = 0; x < e; x++) {
        in->replicas[x] = x < hot ? 1 + (int32_t)(harness_rand_u32(rng) % max_replicas) : 1;
        for (uint32_t r = 0; r < max_replicas; r++)
            in->l2p[(size_t)x * max_replicas + r] =
                r == 0 ? (int32_t)x : x < hot ? (int32_t)(e + (r - 1) * hot + x) : -7; /* unused: never read */
    }
    if (corrupt) {
        in->replicas[0] = 0;
        if (e > 1)
            in->replicas[1] = (int32_t)max_replicas + 1;
        if (e > 2)
            in->replicas[2] = -3;
        if (e > 3) {
            in->replicas[3] = (int32_t)max_replicas;
            for (uint32_t r = 0; r < max_replicas; r++)
                in->l2p[3 * (size_t)max_replicas + r] = r % 2 ? (int32_t)d->num_physical : -1;
        }
    }
}

static void make_inputs(harness_rng *rng, inputs *in, uint32_t tokens, uint32_t top_k, uint32_t experts,
                        uint32_t ranks, enum load load, enum placement place, uint32_t max_replicas)
{
    memset(in, 0, sizeof(*in));
    in->d = moecl_ep_layout_desc_init(tokens, top_k, experts, ranks);
    if (place >= PLACE_MAP_BLOCKS)
        make_map(rng, in, max_replicas, place == PLACE_MAP_CORRUPT);
    moecl_ep_layout_desc *d = &in->d;
    /* Contiguous blocks need num_physical % num_ranks == 0: those cases
     * take a table instead where it does not divide. */
    const bool table = place == PLACE_IDENTITY_TABLE || place >= PLACE_MAP_TABLE || d->num_physical % ranks != 0;
    if (table) {
        in->p2r = malloc((size_t)d->num_physical * 4);
        ck_assert_ptr_nonnull(in->p2r);
        /* Half the ranks at most hold experts, so that others get nothing. */
        const uint32_t used = ranks > 1 ? (ranks + 1) / 2 : 1;
        for (uint32_t p = 0; p < d->num_physical; p++)
            in->p2r[p] = (int32_t)(harness_rand_u32(rng) % used * (ranks > 1 ? 2 : 1));
        if (place == PLACE_MAP_CORRUPT) {
            in->p2r[0] = -1;
            in->p2r[d->num_physical - 1] = (int32_t)ranks;
        }
    }
    in->ids = make_ids(rng, d, load);
}

static void inputs_free(inputs *in)
{
    free(in->ids);
    free(in->l2p);
    free(in->replicas);
    free(in->p2r);
}

static void random_case(moecl_context *ctx, const inputs *in, uint64_t stream, int paths)
{
    for (int path = 0; path < 2; path++) {
        if (!(paths & (1 << path)))
            continue;
        outputs r;
        outputs_alloc(&in->d, &r, path == 1 || stream % 2 == 0);
        run_on(ctx, in, path == 1, &r);
        check_result(in, path == 1, &r);
        outputs_free(&r);
    }
}

/* tokens x ranks x placement; the load, the map's columns (2 to 4, and 7)
 * and the path rotate. */
START_TEST(test_grid)
{
    moecl_context *ctx = harness_context();
    static const uint32_t tokens[] = {0, 1, 7, 129, 1019, 4083, 13526};
    static const uint32_t ranks[] = {1, 2, 8, 64};
    static const uint32_t replicas[] = {2, 3, 4, 7};
    unsigned i = 0;
    for (size_t t = 0; t < COUNT(tokens); t++)
        for (size_t r = 0; r < COUNT(ranks); r++)
            for (int place = 0; place < NUM_PLACEMENTS; place++, i++) {
                if (harness_quick() && tokens[t] > 4083)
                    continue;
                harness_rng rng = harness_rng_for(7000 + i);
                inputs in;
                make_inputs(&rng, &in, tokens[t], 8, 256, ranks[r], (enum load)(i % NUM_LOADS),
                            (enum placement)place, replicas[i % COUNT(replicas)]);
                random_case(ctx, &in, 7000 + i, 1 << (i % 2));
                inputs_free(&in);
            }
    moecl_context_destroy(ctx);
}
END_TEST

/* Other shapes: top_k 1 and 6, few experts, more ranks than experts
 * have, top_k above num_experts (repeated ids), both paths. */
START_TEST(test_shapes)
{
    moecl_context *ctx = harness_context();
    static const uint32_t shapes[][4] = {{333, 1, 8, 8},  {129, 6, 160, 64}, {64, 4, 2, 2},
                                         {50, 16, 4, 1},  {1000, 2, 64, 64}, {17, 64, 4096, 1024}};
    unsigned i = 0;
    for (size_t s = 0; s < COUNT(shapes); s++)
        for (int place = 0; place < NUM_PLACEMENTS; place++, i++) {
            harness_rng rng = harness_rng_for(8000 + i);
            inputs in;
            make_inputs(&rng, &in, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], (enum load)(i % NUM_LOADS),
                        (enum placement)place, 1 + i % 6);
            random_case(ctx, &in, 8000 + i, 3);
            inputs_free(&in);
        }
    moecl_context_destroy(ctx);
}
END_TEST

/* No tokens: counts and offsets 0, nothing else written. */
START_TEST(test_empty)
{
    moecl_context *ctx = harness_context();
    inputs in;
    harness_rng rng = harness_rng_for(9000);
    make_inputs(&rng, &in, 0, 8, 256, 8, LOAD_DISTINCT, PLACE_MAP_TABLE, 2);
    for (int path = 0; path < 2; path++) {
        outputs r;
        outputs_alloc(&in.d, &r, true);
        run_on(ctx, &in, path == 1, &r);
        for (uint32_t x = 0; x < 8; x++) {
            ck_assert_int_eq(r.o.rank_counts[x], 0);
            ck_assert_int_eq(r.o.tokens_per_rank[x], 0);
        }
        for (uint32_t x = 0; x <= 8; x++)
            ck_assert_int_eq(r.o.rank_offsets[x], 0);
        for (uint32_t p = 0; p < in.d.num_physical; p++)
            ck_assert_int_eq(r.o.expert_counts[p], 0);
        ck_assert_uint_eq(harness_first_unpoisoned(r.o.physical_ids, 4), 4);
        ck_assert_uint_eq(harness_first_unpoisoned(r.o.send_slots, 4), 4);
        ck_assert_uint_eq(harness_first_unpoisoned(r.o.token_in_rank, 1), 1);
        outputs_free(&r);
    }
    inputs_free(&in);
    moecl_context_destroy(ctx);
}
END_TEST

/* The facts directly, on a hand-made case: 4 experts, expert 0 with
 * replicas 4 and 5 on ranks 0 and 2 (counts 2), rank 3 holds nothing. */
START_TEST(test_hand_case)
{
    moecl_context *ctx = harness_context();
    moecl_ep_layout_desc d = moecl_ep_layout_desc_init(4, 2, 4, 4);
    d.num_physical = 6;
    d.max_replicas = 2;
    const int32_t ids[] = {0, 1, 0, 3, 2, -1, 0, 2};
    const int32_t l2p[] = {4, 5, 1, -1, 2, -1, 3, -1};
    const int32_t replicas[] = {2, 1, 1, 1};
    const int32_t p2r[] = {0, 1, 1, 2, 0, 2};
    int32_t phys[8], counts[4], offsets[5], send[8], tpr[4], ec[6];
    uint8_t tir[16];
    ck_assert_int_eq(moecl_ep_layout_host(ctx, &d, ids, l2p, replicas, p2r, phys, counts, offsets, send, tir, tpr, ec),
                     MOECL_SUCCESS);
    /* Replica of token t: (t * 2654435761) mod 2^32 mod 2 = t mod 2. */
    const int32_t want_phys[] = {4, 1, 5, 3, 2, -1, 5, 2};
    const int32_t want_counts[] = {1, 3, 3, 0}, want_offsets[] = {0, 1, 4, 7, 7};
    const int32_t want_send[] = {0, 1, 4, 7, 2, 3, 6, -1};
    const uint8_t want_tir[] = {1, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0};
    const int32_t want_tpr[] = {1, 3, 2, 0}, want_ec[] = {0, 1, 2, 1, 1, 2};
    ck_assert_mem_eq(phys, want_phys, sizeof(phys));
    ck_assert_mem_eq(counts, want_counts, sizeof(counts));
    ck_assert_mem_eq(offsets, want_offsets, sizeof(offsets));
    ck_assert_mem_eq(send, want_send, sizeof(send));
    ck_assert_mem_eq(tir, want_tir, sizeof(tir));
    ck_assert_mem_eq(tpr, want_tpr, sizeof(tpr));
    ck_assert_mem_eq(ec, want_ec, sizeof(ec));
    moecl_context_destroy(ctx);
}
END_TEST

/* The map is data: one prepared context, two calls, the second with the
 * replicas of the first reversed and the placement table changed; each
 * result is the reference's for its own map, and they differ. */
START_TEST(test_map_changes)
{
    moecl_context *ctx = harness_context();
    harness_rng rng = harness_rng_for(9100);
    inputs in;
    make_inputs(&rng, &in, 1019, 8, 256, 8, LOAD_SKEWED, PLACE_MAP_TABLE, 3);
    ck_assert_int_eq(moecl_ep_layout_prepare(ctx, &in.d), MOECL_SUCCESS);
    outputs first, second;
    outputs_alloc(&in.d, &first, true);
    outputs_alloc(&in.d, &second, true);
    run_on(ctx, &in, true, &first);
    check_result(&in, true, &first);
    for (uint32_t e = 0; e < in.d.num_experts; e++) {
        int32_t *row = &in.l2p[(size_t)e * in.d.max_replicas];
        const int32_t c = in.replicas[e];
        for (int32_t a = 0, b = c - 1; a < b; a++, b--) {
            const int32_t x = row[a];
            row[a] = row[b];
            row[b] = x;
        }
    }
    for (uint32_t p = 0; p < in.d.num_physical; p++)
        in.p2r[p] = (in.p2r[p] + 1) % 8;
    run_on(ctx, &in, true, &second);
    check_result(&in, true, &second);
    ck_assert_msg(memcmp(first.o.physical_ids, second.o.physical_ids, first.slots * 4) != 0 &&
                      memcmp(first.o.rank_counts, second.o.rank_counts, 8 * 4) != 0,
                  "the changed map gave the same layout");
    outputs_free(&first);
    outputs_free(&second);
    inputs_free(&in);
    moecl_context_destroy(ctx);
}
END_TEST

/* Every validation error: MOECL_ERROR_INVALID_ARGUMENT, a message naming
 * the field, no event, and no output byte changed. */
START_TEST(test_bad_input)
{
    moecl_context *ctx = harness_context();
    moecl_context *other = harness_context();
    moecl_ep_layout_desc good = moecl_ep_layout_desc_init(16, 2, 8, 4);
    good.num_physical = 10;
    good.max_replicas = 2;
    int32_t ids[32], l2p[16], replicas[8], p2r[10];
    for (int s = 0; s < 32; s++)
        ids[s] = s % 8;
    for (int e = 0; e < 8; e++) {
        replicas[e] = e < 2 ? 2 : 1;
        l2p[2 * e] = e;
        l2p[2 * e + 1] = e < 2 ? 8 + e : 0;
    }
    for (int p = 0; p < 10; p++)
        p2r[p] = p % 4;
    moecl_buffer in = harness_buffer(ctx, sizeof(ids), 0, ids), lb = harness_buffer(ctx, sizeof(l2p), 0, l2p);
    moecl_buffer cb = harness_buffer(ctx, sizeof(replicas), 0, replicas), tb = harness_buffer(ctx, sizeof(p2r), 0, p2r);
    moecl_buffer pb = harness_buffer(ctx, 32 * 4, 0, NULL), rcb = harness_buffer(ctx, 4 * 4, 0, NULL);
    moecl_buffer rob = harness_buffer(ctx, 5 * 4, 0, NULL), sb = harness_buffer(ctx, 32 * 4, 0, NULL);
    moecl_buffer tirb = harness_buffer(ctx, 64, 0, NULL), tprb = harness_buffer(ctx, 4 * 4, 0, NULL);
    moecl_buffer ecb = harness_buffer(ctx, 10 * 4, 0, NULL);
    moecl_buffer foreign = harness_buffer(other, 4096, 0, NULL);
    moecl_buffer none = {NULL, 0};
    cl_mem small = clCreateBuffer(moecl_context_cl_context(ctx), CL_MEM_READ_WRITE, 8, NULL, NULL);
    moecl_buffer tiny = {small, 0};
#define D(t, k, e, p, r, m) ((moecl_ep_layout_desc){t, k, e, p, r, m})
    struct {
        const char *label, *field;
        moecl_ep_layout_desc d;
        int which; /* buffer to replace: 0 none, 1 ids .. 11 expert_counts */
        moecl_buffer with;
        int wait;
    } cases[] = {
        {"top_k 0", "top_k", D(16, 0, 8, 10, 4, 2), 0, {0}, 0},
        {"top_k 65", "top_k", D(16, 65, 8, 10, 4, 2), 0, {0}, 0},
        {"experts 0", "num_experts", D(16, 2, 0, 10, 4, 2), 0, {0}, 0},
        {"experts 4097", "num_experts", D(16, 2, 4097, 5000, 4, 2), 0, {0}, 0},
        {"physical below experts", "num_physical", D(16, 2, 8, 7, 4, 2), 0, {0}, 0},
        {"physical 16385", "num_physical", D(16, 2, 8, 16385, 4, 2), 0, {0}, 0},
        {"ranks 0", "num_ranks", D(16, 2, 8, 10, 0, 2), 0, {0}, 0},
        {"ranks 1025", "num_ranks", D(16, 2, 8, 10, 1025, 2), 0, {0}, 0},
        {"replicas 0", "max_replicas", D(16, 2, 8, 10, 4, 0), 0, {0}, 0},
        {"replicas 65", "max_replicas", D(16, 2, 8, 10, 4, 65), 0, {0}, 0},
        {"too many slots", "num_tokens", D(UINT32_MAX / 64, 64, 8, 10, 4, 2), 0, {0}, 0},
        {"map without counts", "replica_counts", good, 3, none, 0},
        {"counts without map", "logical_to_physical", good, 2, none, 0},
        {"ids absent", "topk_ids", good, 1, none, 0},
        {"ids small", "topk_ids", good, 1, tiny, 0},
        {"ids unaligned", "topk_ids", good, 1, {in.mem, 2}, 0},
        {"ids foreign", "topk_ids", good, 1, foreign, 0},
        {"map small", "logical_to_physical", good, 2, tiny, 0},
        {"counts small", "replica_counts", good, 3, tiny, 0},
        {"table small", "physical_to_rank", good, 4, tiny, 0},
        {"physical_ids absent", "physical_ids", good, 5, none, 0},
        {"rank_counts absent", "rank_counts", good, 6, none, 0},
        {"rank_offsets past the end", "rank_offsets", good, 7, {rob.mem, 68}, 0},
        {"send_slots absent", "send_slots", good, 8, none, 0},
        {"token_in_rank small", "token_in_rank", good, 9, tiny, 0},
        {"tokens_per_rank foreign", "tokens_per_rank", good, 10, foreign, 0},
        {"expert_counts small", "expert_counts", good, 11, tiny, 0},
        {"wait NULL", "wait", good, 0, {0}, 1},
    };
#undef D
    for (size_t i = 0; i < COUNT(cases); i++) {
        moecl_buffer a[12] = {none, in, lb, cb, tb, pb, rcb, rob, sb, tirb, tprb, ecb};
        if (cases[i].which)
            a[cases[i].which] = cases[i].with;
        cl_event done = NULL;
        moecl_status st = moecl_ep_layout(ctx, &cases[i].d, a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                                          a[10], a[11], cases[i].wait ? 1 : 0, NULL, &done);
        ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s: status %d (%s)", cases[i].label, (int)st,
                      moecl_status_string(st));
        ck_assert_msg(done == NULL, "%s: an event was returned", cases[i].label);
        ck_assert_msg(strstr(moecl_context_error(ctx), cases[i].field) != NULL, "%s: message \"%s\" does not name %s",
                      cases[i].label, moecl_context_error(ctx), cases[i].field);
        if (cases[i].which == 0 && !cases[i].wait) {
            int32_t phys[32], counts[4], offsets[5] = {-7, -7, -7, -7, -7}, send[32];
            st = moecl_ep_layout_host(ctx, &cases[i].d, ids, l2p, replicas, p2r, phys, counts, offsets, send, NULL,
                                      NULL, NULL);
            ck_assert_msg(st == MOECL_ERROR_INVALID_ARGUMENT, "%s (host): status %d", cases[i].label, (int)st);
            ck_assert_msg(strstr(moecl_context_error(ctx), cases[i].field) != NULL, "%s (host): \"%s\"",
                          cases[i].label, moecl_context_error(ctx));
            for (int x = 0; x < 5; x++)
                ck_assert_int_eq(offsets[x], -7);
            ck_assert_int_eq(moecl_ep_layout_prepare(ctx, &cases[i].d), MOECL_ERROR_INVALID_ARGUMENT);
        }
    }
    /* The identity map with replicas declared, and contiguous placement
     * that does not divide. */
    int32_t phys[32], counts[4], offsets[5], send[32];
    ck_assert_int_eq(moecl_ep_layout_host(ctx, &good, ids, NULL, NULL, p2r, phys, counts, offsets, send, NULL, NULL,
                                          NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "num_physical"));
    ck_assert_int_eq(moecl_ep_layout_host(ctx, &good, ids, l2p, replicas, NULL, phys, counts, offsets, send, NULL,
                                          NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "multiple of num_ranks"));
    ck_assert_int_eq(moecl_ep_layout(ctx, &good, in, none, none, tb, pb, rcb, rob, sb, none, none, none, 0, NULL,
                                     NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_ep_layout_host(ctx, &good, NULL, l2p, replicas, p2r, phys, counts, offsets, send, NULL,
                                          NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "topk_ids"));
    ck_assert_int_eq(moecl_ep_layout_host(ctx, &good, ids, l2p, replicas, p2r, phys, counts, NULL, send, NULL, NULL,
                                          NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(moecl_context_error(ctx), "rank_offsets"));
    ck_assert_int_eq(moecl_ep_layout_host(ctx, NULL, ids, l2p, replicas, p2r, phys, counts, offsets, send, NULL, NULL,
                                          NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_ep_layout_host(NULL, &good, ids, l2p, replicas, p2r, phys, counts, offsets, send, NULL,
                                          NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_ep_layout(NULL, &good, in, lb, cb, tb, pb, rcb, rob, sb, none, none, none, 0, NULL, NULL),
                     MOECL_ERROR_INVALID_ARGUMENT);
    ck_assert_int_eq(moecl_ep_layout_prepare(NULL, &good), MOECL_ERROR_INVALID_ARGUMENT);
    /* After all that, the device outputs are untouched poison. */
    clFinish(moecl_context_queue(ctx));
    moecl_buffer outs[] = {pb, rcb, rob, sb, tirb, tprb, ecb};
    const size_t sizes[] = {32 * 4, 4 * 4, 5 * 4, 32 * 4, 64, 4 * 4, 10 * 4};
    for (size_t i = 0; i < COUNT(outs); i++) {
        unsigned char buf[512];
        harness_read(ctx, outs[i], sizes[i], buf);
        for (size_t x = 0; x < sizes[i]; x++)
            ck_assert_msg(buf[x] == HARNESS_POISON, "output %zu byte %zu changed by a rejected call", i, x);
    }
    /* And the good request runs. */
    ck_assert_int_eq(moecl_ep_layout_host(ctx, &good, ids, l2p, replicas, p2r, phys, counts, offsets, send, NULL,
                                          NULL, NULL),
                     MOECL_SUCCESS);
    moecl_buffer all[] = {in, lb, cb, tb, pb, rcb, rob, sb, tirb, tprb, ecb, foreign, tiny};
    for (size_t i = 0; i < COUNT(all); i++)
        harness_release(all[i]);
    moecl_context_destroy(other);
    moecl_context_destroy(ctx);
}
END_TEST

/* The checker itself: a reference result passes, and one changed element
 * of any output fails it. */
START_TEST(test_checker_rejects)
{
    harness_rng rng = harness_rng_for(9200);
    inputs in;
    make_inputs(&rng, &in, 64, 4, 16, 4, LOAD_DISTINCT, PLACE_MAP_TABLE, 2);
    outputs r;
    outputs_alloc(&in.d, &r, true);
    ref_ep_layout(&in.d, in.ids, in.l2p, in.replicas, in.p2r, &r.o);
    char msg[256];
    ck_assert_int_eq(ref_check_ep_layout(&in.d, in.ids, in.l2p, in.replicas, in.p2r, &r.o, msg, sizeof(msg)), 0);
    int32_t *words[] = {&r.o.physical_ids[5], &r.o.rank_counts[1], &r.o.rank_offsets[2], &r.o.send_slots[7],
                        &r.o.tokens_per_rank[3], &r.o.expert_counts[4]};
    for (size_t i = 0; i < COUNT(words); i++) {
        *words[i] += 1;
        ck_assert_msg(ref_check_ep_layout(&in.d, in.ids, in.l2p, in.replicas, in.p2r, &r.o, msg, sizeof(msg)) > 0,
                      "a changed element %zu passed the check", i);
        *words[i] -= 1;
    }
    r.o.token_in_rank[9] ^= 1;
    ck_assert_int_gt(ref_check_ep_layout(&in.d, in.ids, in.l2p, in.replicas, in.p2r, &r.o, msg, sizeof(msg)), 0);
    outputs_free(&r);
    inputs_free(&in);
}
END_TEST

static char *read_text(const char *dir, const char *name)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot read %s", path);
    char *text = calloc(1, 1 << 20);
    const size_t n = fread(text, 1, (1 << 20) - 1, f);
    fclose(f);
    text[n] = '\0';
    return text;
}

static void write_text(const char *dir, const char *name, const char *text)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
}

/* A kernel that places each chunk's slots in reverse (unstable within a
 * rank) must fail the check: the suite can see a wrong order. */
START_TEST(test_mutation_caught)
{
    const char *cl_dir = getenv("MOECL_TEST_CL_DIR");
    ck_assert_msg(cl_dir && *cl_dir, "MOECL_TEST_CL_DIR is not set (meson sets it to the source cl/ folder)");
    char *align = read_text(cl_dir, "moe_align.cl"), *text = read_text(cl_dir, "ep_layout.cl");
    /* Every placement: the three kernels' tiles of work-items (GPUs) and
     * one work-item's walk (CPUs); the fused kernel's ranks within a
     * sub-tile (its WAIT mode; a loop, or match.any.sync with WARP_MATCH)
     * and its last work-group's walk (LAST). */
    ck_assert_msg(harness_replace_once(&text, "        const uint s = base + lid;\n",
                               "        const uint i = base - begin + lid, s = i < end - begin ? end - 1 - i : end;\n") &&
                      harness_replace_once(&text, "    for (uint s = begin; s < end; s++) {\n        const uint key = keys[s];",
                                   "    for (uint i = begin; i < end; i++) {\n        const uint s = begin + end - 1 - i;\n"
                                   "        const uint key = keys[s];") &&
                      harness_replace_once(&text, "        b += i < lid ? same : 0u;\n        a += i > lid ? same : 0u;",
                                   "        b += i > lid ? same : 0u;\n        a += i < lid ? same : 0u;") &&
                      harness_replace_once(&text, "    *before = popcount(same & lower);\n    *after = popcount(same & higher);",
                                   "    *before = popcount(same & higher);\n    *after = popcount(same & lower);") &&
                      harness_replace_once(&text, "                const uint s = t * in.top_k + j;\n",
                                   "                const uint s = (in.num_tokens - 1 - t) * in.top_k + j;\n"),
                  "the mutation's anchors are not in cl/ep_layout.cl once: update test_mutation_caught");
    const char *out = text;
    char dir[] = "/tmp/moecl-ep-mutant-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    write_text(dir, "moe_align.cl", align);
    write_text(dir, "ep_layout.cl", out);
    free(align);
    free(text);
    moecl_context *ctx = harness_context_with_kernel_dir(dir);
    harness_rng rng = harness_rng_for(9300);
    inputs in;
    make_inputs(&rng, &in, 512, 8, 64, 4, LOAD_DISTINCT, PLACE_IDENTITY_BLOCKS, 1);
    outputs r;
    outputs_alloc(&in.d, &r, false);
    run_on(ctx, &in, false, &r);
    char msg[256];
    const int bad = ref_check_ep_layout(&in.d, in.ids, in.l2p, in.replicas, in.p2r, &r.o, msg, sizeof(msg));
    ck_assert_msg(bad > 0, "the unstable mutant passed the check");
    fprintf(stderr, "ep_layout: the unstable mutant was caught: %d elements differ; first: %s\n", bad, msg);
    outputs_free(&r);
    inputs_free(&in);
    moecl_context_destroy(ctx);
    char path[4096];
    snprintf(path, sizeof(path), "%s/moe_align.cl", dir);
    remove(path);
    snprintf(path, sizeof(path), "%s/ep_layout.cl", dir);
    remove(path);
    rmdir(dir);
}
END_TEST

int main(int argc, char **argv)
{
    harness_args(argc, argv, moecl_override_set);
    Suite *s = suite_create("ep_layout");
    TCase *tc = tcase_create("reference");
    tcase_set_timeout(tc, 900);
    tcase_add_test(tc, test_checker_rejects);
    tcase_add_test(tc, test_hand_case);
    tcase_add_test(tc, test_mutation_caught);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_empty);
    tcase_add_test(tc, test_map_changes);
    tcase_add_test(tc, test_shapes);
    tcase_add_test(tc, test_grid);
    suite_add_tcase(s, tc);
    return harness_run(s);
}
