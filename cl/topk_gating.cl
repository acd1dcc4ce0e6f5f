/* Top-k gating (docs/routing.md, section 1): the gating pipeline of
 * cl/gating.cl over rows of logits read from global memory, with its
 * defines (the shape, SCORING, WEIGHTING, HAS_BIAS, groups,
 * renormalisation) and these:
 *   HAS_COUNTS                 also count the chosen ids per expert (below)
 *   HAS_LOAD                   also add them to a load counter (below)
 *   LOAD_MAP                   the load counter is by local expert (below)
 *   HAS_VALID                  rows at or past a count read from memory
 *                              are padding (below)
 *   CAPTURE                    also write the ids to a capture buffer
 *                              (below)
 *   HAS_SCALE                  multiply each weight by its expert's
 *                              scale (below)
 *   SHARED, SHARED_WEIGHT      shared slots after the routed ones
 *                              (cl/gating.cl)
 *   TEAM, ROWS                 launch shape (common.cl)
 * Two kernels: topk_gating_rows (TEAM == 1, for CPUs: one work-item per
 * row, plain loops over the row) and topk_gating_team (TEAM > 1, for GPUs:
 * the row lives in the registers of TEAM work-items, EPT elements each). */

/* HAS_COUNTS, HAS_LOAD (cl/gating.cl; absent, i.e. 0, for the plain entry
 * points, whose defines and kernels do not depend on them): both kernels
 * take an int histogram (and the offsets in args) for each, and add one to
 * counts[id] and load[id] for each id they write. */
#if HAS_COUNTS
#define COUNTS_PARAM __global int *counts,
#define COUNTS_AT(args) (counts + (args).counts_off)
#define COUNTS_PARAMS_ , __global int *counts
#define COUNTS_ARGS_ , counts
#else
#define COUNTS_PARAM
#define COUNTS_AT(args) ((__global int *)0)
#define COUNTS_PARAMS_
#define COUNTS_ARGS_
#endif
/* LOAD_MAP (moecl_route_dispatch_ex's expert_load with expert_map): the
 * number of local experts L; absent, 0, the load is by expert id. With it
 * the kernels take the global-to-local map (int[NUM_EXPERTS]) and its
 * offset in elements after the load, and add each id to load[map[id]]
 * where that is in [0, L): a rank's counts of its own experts, as
 * moe_align's with the map counts them. */
#if HAS_LOAD && LOAD_MAP
#define LOAD_PARAM __global int *load, __global const int *load_map, ulong load_map_off,
#define LOAD_PARAMS_ , __global int *load, __global const int *load_map
#define LOAD_ARGS_ , load, load_map
#elif HAS_LOAD
#define LOAD_PARAM __global int *load,
#define LOAD_PARAMS_ , __global int *load
#define LOAD_ARGS_ , load
#else
#define LOAD_PARAM
#define LOAD_PARAMS_
#define LOAD_ARGS_
#endif
/* CAPTURE (moecl_topk_gating_ex's captured_ids; absent, i.e. 0: none):
 * the ids written a second time, as 1 int32, 2 int64 or 3 int16 (1 + the
 * moecl_index_dtype), padding rows -1; the kernels move the pointer to
 * their row, and the helpers below take the row's. */
#ifndef CAPTURE
#define CAPTURE 0
#endif
#if CAPTURE
#if CAPTURE == 1
typedef int capture_t;
#elif CAPTURE == 2
typedef long capture_t;
#elif CAPTURE == 3
typedef short capture_t;
#else
#error "CAPTURE must be 0 (none), 1 (int32), 2 (int64) or 3 (int16)"
#endif
#define CAPTURE_PARAM __global capture_t *captured,
#define CAPTURE_PARAMS_ , __global capture_t *captured
#define CAPTURE_ARGS_ , captured
#define CAPTURE_ROW(args, row) (captured = captured + (args).captured_off + (size_t)(row) * TOPK)
#define CAPTURE_ID(j, id) (captured[j] = (capture_t)(id))
#else
#define CAPTURE_PARAM
#define CAPTURE_PARAMS_
#define CAPTURE_ARGS_
#define CAPTURE_ROW(args, row) ((void)0)
#define CAPTURE_ID(j, id) ((void)0)
#endif
/* HAS_SCALE (moecl_topk_gating_ex's expert_scale; absent: none): a chosen
 * expert's final weight, after the renormalisation and the scaling factor,
 * times its float scale (Gemma 4's per_expert_scale), before the store's
 * rounding. */
#ifndef HAS_SCALE
#define HAS_SCALE 0
#endif
#if HAS_SCALE
#define SCALE_PARAM __global const float *expert_scale,
#define SCALE_PARAMS_ , __global const float *expert_scale
#define SCALE_ARGS_ , expert_scale
#define SCALE_SET(args) (expert_scale = expert_scale + (args).scale_off)
#define SCALED(w, id) ((uint)(id) < NUM_EXPERTS ? (w) * expert_scale[(uint)(id)] : (w))
#else
#define SCALE_PARAM
#define SCALE_PARAMS_
#define SCALE_ARGS_
#define SCALE_SET(args) ((void)0)
#define SCALED(w, id) (w)
#endif
#define COUNTS_PARAMS COUNTS_PARAMS_ LOAD_PARAMS_ CAPTURE_PARAMS_ SCALE_PARAMS_
#define COUNTS_ARGS COUNTS_ARGS_ LOAD_ARGS_ CAPTURE_ARGS_ SCALE_ARGS_
/* The histograms' pointers at their offsets, in a kernel. */
#define COUNTS_AT_OFFSETS(args)                                                                    \
    do {                                                                                           \
        if (HAS_COUNTS)                                                                            \
            COUNTS_SET(args);                                                                      \
        if (HAS_LOAD)                                                                              \
            LOAD_SET(args);                                                                        \
    } while (0)
#if HAS_COUNTS
#define COUNTS_SET(args) (counts = COUNTS_AT(args))
#else
#define COUNTS_SET(args) ((void)0)
#endif
#if HAS_LOAD && LOAD_MAP
#define LOAD_SET(args) (load = load + (args).load_off, load_map = load_map + load_map_off)
#elif HAS_LOAD
#define LOAD_SET(args) (load = load + (args).load_off)
#else
#define LOAD_SET(args) ((void)0)
#endif

/* HAS_VALID (moecl_topk_gating_ex's num_valid_tokens; cl/gating.cl). */
#if HAS_VALID
#define VALID_PARAM __global const int *num_valid,
#define VALID_ROWS(args) valid_rows(num_valid, (args).valid_off, (args).num_tokens)
#else
#define VALID_PARAM
#define VALID_ROWS(args) ((args).num_tokens)
#endif

/* A padding row's outputs, slots j0, j0 + step, ... (captured: the row's). */
static inline void write_padding(__global weight_t *w_out, __global ids_t *id_out, uint j0,
                                 uint step CAPTURE_PARAMS_)
{
    for (uint j = j0; j < ROW_SLOTS; j += step) {
        STORE_WEIGHT(w_out, j, 0.0f);
        STORE_ID(id_out, j, -1);
        if (j < TOPK) /* the capture holds the routed slots only */
            CAPTURE_ID(j, -1);
    }
}

/* A token row's shared slots, j0, j0 + step, ... of them (cl/gating.cl). */
static inline void write_shared(__global weight_t *w_out, __global ids_t *id_out, uint j0, uint step,
                                float scaling_factor COUNTS_PARAMS)
{
    for (uint j = j0; j < SHARED; j += step) {
        STORE_WEIGHT(w_out, TOPK + j, SHARED_WEIGHT * scaling_factor);
        STORE_ID(id_out, TOPK + j, NUM_EXPERTS + j);
        COUNT_ID(NUM_EXPERTS + j);
    }
}
/* The bias is an argument only where there is one (as the counts are):
 * every argument costs an enqueue (cl/layout.h, layout_topk_args). */
#if HAS_BIAS
#define BIAS_PARAM __global const bias_t *bias,
#define BIAS_AT(args) (bias + (args).bias_off)
#else
#define BIAS_PARAM
#define BIAS_AT(args) ((__global const bias_t *)0)
#endif
#if TEAM == 1
/* ---------------------------------------------------------------------- */
/* One work-item per row (CPU devices).                                    */
/* ---------------------------------------------------------------------- */

/* ---- Fast path: softmax, no bias, no groups (the seed's routing). ------ */
/* The order of exp(x - max) / sum is the order of the logits (exp is
 * monotonic, and a rounded tie of two distinct scores is a near-tie the
 * spec lets go either way), so the top-k is taken on the logits and exp
 * runs once per element only for the sum; the chosen weights get their own
 * exp. One exception keeps the exact-tie rule: logits whose exp(x - max)
 * underflows to 0 all score exactly 0, so they rank as one value (-inf,
 * rank_logit16) and go by index. Rows with a NaN or +inf logit, or only
 * -inf, have every score NaN (the sum is NaN): those rows are all ties and
 * give ids 0..k-1. Blocks of 16 floats (one AVX-512 register); every loop
 * below is over the row's blocks. CPU_DEVICE (set by the host for CPU
 * devices): the path is only taken where it is known right, pocl and
 * Intel's CPU runtime; the H200 gives wrong ids with it (f32, f16 and
 * bf16 rows of 60 and 64 experts; cause not found), so other devices
 * take the generic loop below. */
#if ROWS_FAST
/* The value a logit ranks by: itself, or -inf where its score is 0 (p, its
 * exp(x - max), underflowed). Monotone, so the floors below carry over. */
static inline float16 rank_logit16(float16 v, float16 p)
{
    return p == 0.0f ? (float16)(-INFINITY) : v;
}

static inline float rank_logit(float v, float row_max)
{
    return exp_nonpos(v - row_max) == 0.0f ? -INFINITY : v;
}

static inline float hmin16(float16 v)
{
    float8 a = v.lo < v.hi ? v.lo : v.hi;
    float4 b = a.lo < a.hi ? a.lo : a.hi;
    float2 c = b.lo < b.hi ? b.lo : b.hi;
    return c.x < c.y ? c.x : c.y;
}

static inline uint hor16(uint16 v)
{
    uint8 a = v.lo | v.hi;
    uint4 b = a.lo | a.hi;
    uint2 c = b.lo | b.hi;
    return c.x | c.y;
}

/* The 15 rotations of a 16-lane vector, as swizzles (constant shuffles). */
#define ROTATIONS16(X)                                                                             \
    X(s123456789abcdef0, 0x8000) X(s23456789abcdef01, 0xc000) X(s3456789abcdef012, 0xe000)         \
    X(s456789abcdef0123, 0xf000) X(s56789abcdef01234, 0xf800) X(s6789abcdef012345, 0xfc00)         \
    X(s789abcdef0123456, 0xfe00) X(s89abcdef01234567, 0xff00) X(s9abcdef012345678, 0xff80)         \
    X(sabcdef0123456789, 0xffc0) X(sbcdef0123456789a, 0xffe0) X(scdef0123456789ab, 0xfff0)         \
    X(sdef0123456789abc, 0xfff8) X(sef0123456789abcd, 0xfffc) X(sf0123456789abcde, 0xfffe)

/* Each lane's two largest logits (padding -inf; NaN is neither, its
 * compares being false): the largest returned, the second in *second. */
static inline float16 lane_top2(__global const in_t *x, float16 *second)
{
    float16 m1 = (float16)(-INFINITY), m2 = (float16)(-INFINITY);
    for (uint b = 0; b < BLOCKS16; b++) {
        const float16 v = load_block16(x, b * V16, -INFINITY);
        const float16 lo = v > m1 ? m1 : v;
        m1 = v > m1 ? v : m1;
        m2 = lo > m2 ? lo : m2;
    }
    *second = m2;
    return m1;
}

/* The k-th largest of the 16 values m, counting repeats: the least value
 * with fewer than k values above it. */
static inline float kth_of_16(float16 m)
{
    int16 above = (int16)(0);
#define COUNT_ABOVE(sw, unused) above -= m.sw > m;
    ROTATIONS16(COUNT_ABOVE)
#undef COUNT_ABOVE
    return hmin16(above < TOPK ? m : (float16)(INFINITY));
}

/* The same over the 32 values m1 and m2 (m2 <= m1 lane by lane). */
static inline float kth_of_32(float16 m1, float16 m2)
{
    int16 above1 = (int16)(0), above2 = (int16)(0) - (m1 > m2);
#define COUNT_ABOVE(sw, unused)                                                                    \
    {                                                                                              \
        const float16 r1 = m1.sw, r2 = m2.sw;                                                      \
        above1 -= (r1 > m1) + (r2 > m1);                                                           \
        above2 -= (r1 > m2) + (r2 > m2);                                                           \
    }
    ROTATIONS16(COUNT_ABOVE)
#undef COUNT_ABOVE
    const float16 k1 = above1 < TOPK ? m1 : (float16)(INFINITY);
    const float16 k2 = above2 < TOPK ? m2 : (float16)(INFINITY);
    return hmin16(k1 < k2 ? k1 : k2);
}

/* The candidates (the set bits of pair_bits) in index order, 64 experts at
 * a time (one loop exit per 64: the branches are few): the first 16 kept,
 * the rest counted into slot 16; returns their count. With cap, of the
 * logits equal to the floor only the first k count: where fewer than k
 * logits are above the floor it is the k-th largest and the first of its
 * ties are chosen; otherwise none of them is. (Without cap the loop is
 * shorter: the rows of the first floor are most rows.) */
static inline uint gather_candidates(__global const in_t *x, const uint *pair_bits, float floor_x, bool cap,
                                     float *cand_x, uint *cand_e)
{
    uint count = 0, ties = 0;
    for (uint p = 0; p < PAIRS16; p += 2) {
        ulong bits = (ulong)pair_bits[p] | ((ulong)pair_bits[p + 1] << 32);
        while (bits) {
            const uint e = p * 2 * V16 + 63 - (uint)clz(bits & (0ul - bits));
            bits &= bits - 1;
            const uint slot = min(count, (uint)V16);
            const float v = LOAD_IN(x, e);
            const uint tie = v == floor_x;
            cand_x[slot] = v;
            cand_e[slot] = e;
            count += !cap || ties < TOPK || !tie; /* a tie past k: its slot is reused */
            ties += tie;
        }
    }
    return count;
}

/* A bit for each logit at least floor_x (finite), two blocks a pair. */
static inline void candidate_bits(__global const in_t *x, float floor_x, uint16 lane_bits, uint *pair_bits)
{
    for (uint p = 0; p < PAIRS16; p++) {
        const float16 v0 = load_block16(x, 2 * p * V16, -INFINITY);
        const float16 v1 = load_block16(x, (2 * p + 1) * V16, -INFINITY);
        pair_bits[p] = hor16((as_uint16(v0 >= floor_x) & lane_bits) | (as_uint16(v1 >= floor_x) & (lane_bits << 16)));
    }
}

/* The candidates' logits as they rank. Above a finite floor that is the
 * logit itself (a candidate ranks at least the floor, so not as -inf): the
 * scalar exp per candidate is paid only where the floor is -inf (fewer
 * than k nonzero scores in the row). */
static inline void rank_candidates(float *cand_x, uint n, float floor_x, float row_max)
{
    if (floor_x == -INFINITY)
        for (uint i = 0; i < n; i++)
            cand_x[i] = rank_logit(cand_x[i], row_max);
}

__constant uint lane_bit16[16] = {1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,
                                  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10, 1u << 11,
                                  1u << 12, 1u << 13, 1u << 14, 1u << 15};

static inline void topk_rows_softmax(__global const in_t *x, __global weight_t *w_out, __global ids_t *id_out,
                              float scaling_factor COUNTS_PARAMS)
{
    const uint16 lane_bits = vload16(0, lane_bit16);
    const uint16 lane = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

    /* Pass 1: each lane's largest logit (padding -inf), the row's max. */
    const float16 lane_max = fast_lane_max(x);
    const float row_max = hmax16(lane_max);

    /* A floor for the k-th largest logit: the k-th largest lane maximum
     * (k lanes each hold a logit at least that large). Only logits at least
     * the floor can be chosen. */
    float floor_x = -INFINITY;
#if TOPK <= V16
    floor_x = kth_of_16(lane_max);
#endif
    floor_x = rank_logit(floor_x, row_max);

    /* Pass 2, two blocks at a time: the sum of exp(x - max), and a bit for
     * each candidate (a logit at least the floor). */
    float16 acc = (float16)(0.0f);
    uint pair_bits[PAIRS16 + 1];
    for (uint p = 0; p < PAIRS16; p++) {
        const uint e0 = 2 * p * V16, e1 = e0 + V16;
        float16 v0, v1, p0, p1;
        fast_sum_pair(x, p, row_max, &acc, &v0, &v1, &p0, &p1);
        int16 hit0 = rank_logit16(v0, p0) >= floor_x, hit1 = rank_logit16(v1, p1) >= floor_x;
        if (e1 + V16 > NUM_EXPERTS) {
            hit0 &= as_int16(lane + e0 < (uint16)(NUM_EXPERTS));
            hit1 &= as_int16(lane + e1 < (uint16)(NUM_EXPERTS));
        }
        pair_bits[p] = hor16((as_uint16(hit0) & lane_bits) | (as_uint16(hit1) & (lane_bits << 16)));
    }
    pair_bits[PAIRS16] = 0;

    float cand_x[V16 + 1];
    uint cand_e[V16 + 1];
    uint count = gather_candidates(x, pair_bits, floor_x, false, cand_x, cand_e);
#if TOPK <= V16
    if (count > V16 && floor_x != -INFINITY) {
        /* Over 16 candidates: a lane holds several of the largest logits
         * (hot experts 16 apart, many ties), and its maximum alone stood
         * for them. A tighter floor from each lane's two largest, and the
         * candidates again; only where they are still over 16 does the
         * loop below take every expert. It is at least the first floor,
         * so finite and above every logit whose score is 0: the logits
         * rank as loaded. */
        float16 second;
        const float16 first = lane_top2(x, &second);
        floor_x = kth_of_32(first, second);
        candidate_bits(x, floor_x, lane_bits, pair_bits);
        count = gather_candidates(x, pair_bits, floor_x, true, cand_x, cand_e);
    }
#endif
    rank_candidates(cand_x, min(count, (uint)V16), floor_x, row_max);
    const float row_sum = fast_row_sum(acc);

    /* The chosen logits and experts, in output order. */
    float chosen_x[TOPK16 + 1]; /* slot TOPK (or TOPK16) takes the places past k */
    uint chosen_e[TOPK + 1];
    if (isnan(row_sum)) {
        for (uint j = 0; j < TOPK; j++) {
            chosen_x[j] = NAN;
            chosen_e[j] = j;
        }
    } else if (TOPK == 1) {
        /* The floor is the max: the first candidate is the first max. */
        chosen_x[0] = cand_x[0];
        chosen_e[0] = cand_e[0];
    } else if (TOPK <= V16 && count <= V16 && count >= TOPK) {
        /* Each candidate's place: the candidates above it (larger logit, or
         * equal and earlier; rotation s wraps lanes >= 16 - s onto earlier
         * candidates). Empty slots hold NaN, which is above nothing. Each
         * candidate goes straight to its place; those past k to slot k. */
        const float16 c = as_int16(lane) < (int)count ? vload16(0, cand_x) : (float16)(NAN);
        int16 place = (int16)(0);
#define COUNT_PLACE(sw, wrapped)                                                                   \
    {                                                                                              \
        const float16 o = c.sw;                                                                    \
        const int16 w = as_int16((lane_bits & (uint16)(wrapped)) != (uint16)(0));                  \
        place -= (o > c) | ((o == c) & w);                                                         \
    }
        ROTATIONS16(COUNT_PLACE)
#undef COUNT_PLACE
        int pl[V16];
        vstore16(place, 0, pl);
        for (uint i = 0; i < count; i++) {
            const uint j = min((uint)pl[i], (uint)TOPK);
            chosen_x[j] = cand_x[i];
            chosen_e[j] = cand_e[i];
        }
    } else {
        /* Over 16 candidates at the tighter floor too (many large logits
         * in few lanes), or k > 16: insertion of every candidate's key.
         * Fewer candidates than k cannot happen (k of the lane values a
         * floor is taken over are at least it); should a driver's vector
         * compares say otherwise, every expert is a candidate. */
        ulong keys[TOPK];
        float unused[TOPK];
        const float floor_all = count >= TOPK ? floor_x : -INFINITY;
        for (uint j = 0; j < TOPK; j++)
            keys[j] = KEY_NONE;
        for (uint e = 0; e < NUM_EXPERTS; e++) {
            /* Compared as loaded: above a finite floor a logit ranks as
             * itself (rank_candidates), so the scalar exp of rank_logit,
             * which made such rows several times slower than the rest
             * (hot experts sharing a lane, many ties), runs only where
             * the floor is -inf. */
            const float raw = LOAD_IN(x, e);
            if (raw >= floor_all) {
                const float v = floor_all == -INFINITY ? rank_logit(raw, row_max) : raw;
                const ulong key = rank_key(v, e);
                TOPK_INSERT(keys, unused, TOPK, key, 0.0f);
            }
        }
        for (uint j = 0; j < TOPK; j++) {
            chosen_e[j] = key_index(keys[j]);
            chosen_x[j] = rank_logit(LOAD_IN(x, chosen_e[j]), row_max);
        }
    }
    for (uint j = TOPK; j < TOPK16; j++)
        chosen_x[j] = -INFINITY;

    /* Step 5: weights exp(x - max) / sum of the chosen. */
    float weights[TOPK16];
    fast_chosen_scores(chosen_x, row_max, row_sum, weights);
    float divisor;
    WEIGHTS_DIVISOR(divisor, weights, TOPK);
    for (uint j = 0; j < TOPK; j++) {
        STORE_WEIGHT(w_out, j, SCALED(weights[j] / divisor * scaling_factor, chosen_e[j]));
        STORE_ID(id_out, j, chosen_e[j]);
        CAPTURE_ID(j, chosen_e[j]);
        COUNT_ID(chosen_e[j]);
    }
}
#endif

/* A token row's routed slots from the per-row paths' final weights and ids. */
static inline void write_routed(__global weight_t *w_out, __global ids_t *id_out, const float *weights,
                                const uint *ids COUNTS_PARAMS)
{
    for (uint j = 0; j < TOPK; j++) {
        STORE_WEIGHT(w_out, j, SCALED(weights[j], ids[j]));
        STORE_ID(id_out, j, ids[j]);
        CAPTURE_ID(j, ids[j]);
        COUNT_ID(ids[j]);
    }
}

/* ---- Fast path: grouped top-k with an elementwise scoring (DeepSeek-V3:
 * sigmoid, bias, top-2 sums of groups of 32). The generic loop scores the
 * groups expert by expert and inserts every expert of the kept groups;
 * here the groups' top two come from 8-lane maxima, and only experts at
 * least a floor are inserted. Groups of whole blocks of eight, the plain
 * fill (dropped experts never chosen); CPUs only, as the softmax path.
 * 8-lane vectors, not 16: oclgrind --uninitialized misreads 16-lane
 * shuffles (tests/oclgrind/tool_bugs, shuffle16_uninitialized). */
#if CPU_DEVICE && NUM_GROUPS > 0 && SCORING != 0 && GROUP_FILL == 0 && GROUP_SIZE % BLOCK == 0
#define ROWS_GROUPED 1
#define GROUP_BLOCKS (GROUP_SIZE / BLOCK)

/* A bit for each lane of hit that is set. */
static inline uint grouped_lane_bits(int8 hit)
{
    const uint8 m = as_uint8(hit) & (uint8)(1u, 2u, 4u, 8u, 16u, 32u, 64u, 128u);
    const uint4 a = m.lo | m.hi;
    const uint2 b = a.lo | a.hi;
    return b.x | b.y;
}

/* The two largest of (a1 >= a2) and (b1 >= b2), into (a1 >= a2); no NaN
 * (plain compares: fmax's NaN rule costs instructions). */
#define TOP2_MERGE(T, a1, a2, b1, b2)                                                              \
    do {                                                                                           \
        const T lo_ = a1 < b1 ? a1 : b1;                                                           \
        const T hi2_ = a2 > b2 ? a2 : b2;                                                          \
        a1 = a1 > b1 ? a1 : b1;                                                                    \
        a2 = lo_ > hi2_ ? lo_ : hi2_;                                                              \
    } while (0)

/* Step 3 for one group (its selection scores in sel): the two largest
 * non-NaN scores, a repeated maximum twice (-inf where there are fewer),
 * and their count. group_acc's rule, lane by lane. */
static inline uint grouped_top2(const float *sel, float *first, float *second)
{
    float8 m1 = (float8)(-INFINITY), m2 = (float8)(-INFINITY);
    int8 n = (int8)(0);
    for (uint b = 0; b < GROUP_BLOCKS; b++) {
        const float8 v = vload8(b, sel);
        const int8 nan = isnan(v);
        n += nan + 1; /* isnan is -1 where true */
        TOP2_MERGE(float8, m1, m2, select(v, (float8)(-INFINITY), nan), (float8)(-INFINITY));
    }
    float4 a1 = m1.lo, a2 = m2.lo;
    TOP2_MERGE(float4, a1, a2, m1.hi, m2.hi);
    float2 b1 = a1.lo, b2 = a2.lo;
    TOP2_MERGE(float2, b1, b2, a1.hi, a2.hi);
    float c1 = b1.x, c2 = b2.x;
    TOP2_MERGE(float, c1, c2, b1.y, b2.y);
    *first = c1;
    *second = c2;
    const int4 n4 = n.lo + n.hi;
    return (uint)(n4.x + n4.y + n4.z + n4.w);
}

/* Step 3: the group score from grouped_top2 (group_acc_score's). */
static inline float grouped_score(float first, float second, uint count)
{
    if (count == 0)
        return NAN;
    return GROUP_SCORE == 1 && count > 1 ? first + second : first;
}

/* A floor for the k-th largest selection score of the kept groups: the
 * k-th largest of their top twos (k experts reach it; with exactly k of
 * them, DeepSeek-V3's 4 x 2 of 8, the least second), -inf where they hold
 * fewer than k. */
static inline float grouped_floor(const float *first, const float *second, const ulong *group_key, ulong threshold)
{
    if (2 * TOPK_GROUP < TOPK)
        return -INFINITY;
    if (2 * TOPK_GROUP == TOPK) {
        float least = INFINITY;
        for (uint g = 0; g < NUM_GROUPS; g++)
            least = group_key[g] >= threshold && second[g] < least ? second[g] : least;
        return least;
    }
    float best[TOPK];
    for (uint j = 0; j < TOPK; j++)
        best[j] = -INFINITY;
    for (uint g = 0; g < NUM_GROUPS; g++) {
        if (group_key[g] < threshold)
            continue;
        for (uint t = 0; t < 2; t++) {
            float v = t ? second[g] : first[g];
            for (uint j = 0; j < TOPK; j++) {
                const float hi = best[j] > v ? best[j] : v;
                v = best[j] > v ? v : best[j];
                best[j] = hi;
            }
        }
    }
    return best[TOPK - 1];
}

/* What a chosen expert e weighs before step 5: its score, or its logit
 * (WEIGHTING 1 and 2). */
#define GROUPED_VALUE(e) (WEIGHTING == 0 ? score[e] : LOAD_IN(x, e))
/* The candidates the counting placement takes (16 keys: two ulong8). */
#define GROUPED_CANDS 16

/* A kept expert's key: its selection rank above the complemented index. */
static inline ulong grouped_key(const float *sel, uint e)
{
    return ((ulong)select_rank(sel[e]) << 32) | (ulong)(~e);
}

/* Step 4, gathering: the keys of the kept experts at least floor_s, in
 * index order, into cand[0..GROUPED_CANDS) (the rest KEY_NONE); returns
 * how many there are, those past GROUPED_CANDS counted only. A mask
 * covers up to eight blocks, so the loop over its bits exits rarely. */
static inline uint grouped_candidates(const float *sel, const ulong *group_key, ulong threshold, float floor_s,
                                      ulong *cand)
{
    for (uint i = 0; i <= GROUPED_CANDS; i++)
        cand[i] = KEY_NONE;
    uint count = 0;
    for (uint g = 0; g < NUM_GROUPS; g++) {
        if (group_key[g] < threshold)
            continue;
        for (uint b0 = g * GROUP_BLOCKS; b0 < (g + 1) * GROUP_BLOCKS; b0 += 8) {
            ulong bits = 0;
            for (uint i = 0; i < 8 && b0 + i < (g + 1) * GROUP_BLOCKS; i++)
                bits |= (ulong)grouped_lane_bits(vload8(b0 + i, sel) >= floor_s) << (8 * i);
            while (bits) {
                const uint e = b0 * BLOCK + 63 - (uint)clz(bits & (0ul - bits));
                bits &= bits - 1;
                cand[min(count, (uint)GROUPED_CANDS)] = grouped_key(sel, e);
                count++;
            }
        }
    }
    return count;
}

/* Step 4, placing: each of the count (k..GROUPED_CANDS) candidates goes
 * to its place, the number of larger keys (keys are unique); those past
 * k are dropped. */
static inline void grouped_place(const ulong *cand, uint count, ulong *keys)
{
    const ulong8 c0 = vload8(0, cand), c1 = vload8(1, cand);
    for (uint i = 0; i < count; i++) {
        const long8 above = (c0 > cand[i]) + (c1 > cand[i]); /* -1 for each larger key */
        const long4 a4 = above.lo + above.hi;
        const long2 a2 = a4.lo + a4.hi;
        const uint place = (uint)(-(a2.x + a2.y));
        if (place < TOPK)
            keys[place] = cand[i];
    }
}

/* Step 4, otherwise: insertion of every kept expert at least floor_s (NaN:
 * every kept expert, NaN scores included). */
static inline void grouped_insert_all(__global const in_t *x, const float *score, const float *sel,
                                      const ulong *group_key, ulong threshold, float floor_s, ulong *keys,
                                      float *weights)
{
    for (uint j = 0; j < TOPK; j++) {
        keys[j] = KEY_NONE;
        weights[j] = 0.0f;
    }
    for (uint e = 0; e < NUM_EXPERTS; e++)
        if (group_key[e / GROUP_SIZE] >= threshold && (isnan(floor_s) || sel[e] >= floor_s))
            TOPK_INSERT(keys, weights, TOPK, grouped_key(sel, e), GROUPED_VALUE(e));
}

static inline void topk_rows_grouped(__global const in_t *x, __global const bias_t *bias, __global weight_t *w_out,
                                     __global ids_t *id_out, float scaling_factor COUNTS_PARAMS)
{
    /* Steps 1-2: scores and selection scores, in blocks of eight as the
     * generic loop's (the replay recomputes a chosen block: the same bits). */
    float score[NUM_EXPERTS], sel[NUM_EXPERTS];
    for (uint b = 0; b < NUM_EXPERTS / BLOCK; b++) {
        const float8 s = rows_elementwise_scores(load_in8(x, b * BLOCK));
        vstore8(s, b, score);
        vstore8(s + load_bias_block(bias, b * BLOCK), b, sel);
    }
    /* Step 3: the kept groups. */
    float first[NUM_GROUPS], second[NUM_GROUPS];
    ulong group_key[NUM_GROUPS];
    for (uint g = 0; g < NUM_GROUPS; g++) {
        const uint n = grouped_top2(sel + g * GROUP_SIZE, &first[g], &second[g]);
        group_key[g] = rank_key(grouped_score(first[g], second[g], n), g);
    }
    const ulong threshold = group_threshold(group_key);
    /* Step 4: top-k of the kept experts at least the floor, placed by
     * counting where they are few (the common case: about 11 for
     * DeepSeek-V3's random rows), else inserted; fewer than k (the
     * floor was a missing second): every kept expert. */
    const float floor_s = grouped_floor(first, second, group_key, threshold);
    ulong cand[GROUPED_CANDS + 1], keys[TOPK];
    float weights[TOPK];
    const uint count = grouped_candidates(sel, group_key, threshold, floor_s, cand);
    if (count >= TOPK && count <= GROUPED_CANDS) {
        grouped_place(cand, count, keys);
        for (uint j = 0; j < TOPK; j++)
            weights[j] = GROUPED_VALUE(key_index(keys[j]));
    } else {
        grouped_insert_all(x, score, sel, group_key, threshold, count < TOPK ? NAN : floor_s, keys, weights);
    }
    /* Step 5. */
    uint ids[TOPK];
    rows_final(keys, weights, scaling_factor, ids);
    write_routed(w_out, id_out, weights, ids COUNTS_ARGS);
}
#endif

#if !ROWS_FAST
/* The generic loop, cl/gating.cl's rows_pipeline: every scoring,
 * weighting, bias and grouping. */
static inline void topk_rows_generic(__global const in_t *x, __global const bias_t *bias, __global weight_t *w_out,
                                     __global ids_t *id_out, float scaling_factor COUNTS_PARAMS)
{
    float8 logit[BLOCKS];
    for (uint b = 0; b < BLOCKS; b++)
        logit[b] = load_block(x, b * BLOCK, 0.0f);
    float weights[TOPK];
    uint ids[TOPK];
    rows_pipeline(logit, bias, scaling_factor, weights, ids);
    write_routed(w_out, id_out, weights, ids COUNTS_ARGS);
}
#endif

__kernel void topk_gating_rows(__global const in_t *gating, BIAS_PARAM __global weight_t *topk_weights,
                               __global ids_t *topk_ids, COUNTS_PARAM LOAD_PARAM VALID_PARAM CAPTURE_PARAM
                                   SCALE_PARAM layout_topk_args args)
{
    const uint row = (uint)get_global_id(0);
    if (row >= args.num_tokens)
        return;
    __global const in_t *x = gating + args.gating_off + (size_t)row * NUM_EXPERTS;
    __global weight_t *w_out = topk_weights + args.weights_off + (size_t)row * ROW_SLOTS;
    /* The fast path counts the ids from its registers: topk_ids may be
     * write-only to kernels (the _host paths create it CL_MEM_WRITE_ONLY). */
    __global ids_t *id_out = topk_ids + args.ids_off + (size_t)row * ROW_SLOTS;
    CAPTURE_ROW(args, row);
    if (HAS_VALID && row >= VALID_ROWS(args)) {
        write_padding(w_out, id_out, 0, 1 CAPTURE_ARGS_);
        return;
    }
    COUNTS_AT_OFFSETS(args);
    SCALE_SET(args);
#if ROWS_FAST
    topk_rows_softmax(x, w_out, id_out, args.scaling_factor COUNTS_ARGS);
#elif ROWS_GROUPED
    topk_rows_grouped(x, BIAS_AT(args), w_out, id_out, args.scaling_factor COUNTS_ARGS);
#else
    topk_rows_generic(x, BIAS_AT(args), w_out, id_out, args.scaling_factor COUNTS_ARGS);
#endif
    if (SHARED)
        write_shared(w_out, id_out, 0, 1, args.scaling_factor COUNTS_ARGS);
}

#else
/* ---------------------------------------------------------------------- */
/* A team of TEAM work-items per row, ROWS rows per work-group (GPUs).      */
/* ---------------------------------------------------------------------- */

__kernel __attribute__((reqd_work_group_size(TEAM * ROWS, 1, 1))) void
topk_gating_team(__global const in_t *gating, BIAS_PARAM __global weight_t *topk_weights, __global ids_t *topk_ids,
                 COUNTS_PARAM LOAD_PARAM VALID_PARAM CAPTURE_PARAM SCALE_PARAM layout_topk_args args
                     DISPATCH_PARAMS)
{
    DISPATCH_LOCALS;
    TEAM_GATING_LOCALS;
    const uint lane = get_local_id(0) % TEAM;
    const uint r = get_local_id(0) / TEAM;
    const uint row = get_group_id(0) * ROWS + r;
    const bool active = row < args.num_tokens;
    /* A padding row is routed as an absent one (every lane takes part in
     * the pipeline's barriers) and written apart. */
    const bool token = active && (!HAS_VALID || row < VALID_ROWS(args));
    __global const in_t *x = gating + args.gating_off + (size_t)(token ? row : 0) * NUM_EXPERTS;
    COUNTS_AT_OFFSETS(args);
    SCALE_SET(args);
    CAPTURE_ROW(args, row);

    float value[EPT];
    team_load_row(x, token, lane, value);
    float weights[TOPK];
    TEAM_GATING(value, token, lane, r, BIAS_AT(args), args.scaling_factor, weights);
    if (active && !token)
        write_padding(topk_weights + args.weights_off + (size_t)row * ROW_SLOTS,
                      topk_ids + args.ids_off + (size_t)row * ROW_SLOTS, lane, TEAM CAPTURE_ARGS_);
    if (token) {
        __global weight_t *w_out = topk_weights + args.weights_off + (size_t)row * ROW_SLOTS;
        __global ids_t *id_out = topk_ids + args.ids_off + (size_t)row * ROW_SLOTS;
        for (uint j = lane; j < TOPK; j += TEAM) {
            STORE_WEIGHT(w_out, j, SCALED(weights[j], GATE_IDS(r)[j]));
            STORE_ID(id_out, j, GATE_IDS(r)[j]);
            CAPTURE_ID(j, GATE_IDS(r)[j]);
            COUNT_ID(GATE_IDS(r)[j]);
        }
        if (SHARED)
            write_shared(w_out, id_out, lane, TEAM, args.scaling_factor COUNTS_ARGS);
    }
    DISPATCH_AFTER_ROWS(topk_ids + args.ids_off, args.num_tokens);
}
#endif
