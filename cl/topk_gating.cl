/* Top-k gating (docs/routing.md, section 1), one function per step of the
 * spec. Specialised at build time:
 *   NUM_EXPERTS, TOPK          the shape
 *   SCORING                    0 softmax, 1 sigmoid
 *   HAS_BIAS                   correction bias steers selection only
 *   NUM_GROUPS, TOPK_GROUP     group-limited selection (NUM_GROUPS 0: none)
 *   GROUP_SCORE                0 max, 1 sum of the top two
 *   RENORMALIZE                divide the weights by their sum when > 0
 *   RENORM_FLOOR               (absent: none) divide by max(sum, floor)
 *   GROUP_FILL                 0 (absent): dropped groups never selected;
 *                              1: their selection score is 0.0 (below)
 *   HAS_COUNTS                 also count the chosen ids per expert (below)
 *   TEAM, ROWS                 launch shape (common.cl)
 * Two kernels: topk_gating_rows (TEAM == 1, for CPUs: one work-item per
 * row, plain loops over the row) and topk_gating_team (TEAM > 1, for GPUs:
 * the row lives in the registers of TEAM work-items, EPT elements each). */

#ifndef NUM_GROUPS
#define NUM_GROUPS 0
#endif
#ifndef GROUP_FILL
#define GROUP_FILL 0
#endif

/* HAS_COUNTS (moecl_topk_gating_with_counts; absent, i.e. 0, for the plain
 * entry points, whose defines and kernels stay as they were): both kernels
 * take two more arguments, an int histogram and its offset in elements,
 * which the host has zeroed, and add one to counts[id] for each id they
 * write. Integer sums: the result is the same in any order. */
#ifndef HAS_COUNTS
#define HAS_COUNTS 0
#endif
#if HAS_COUNTS
#define COUNTS_PARAM __global int *counts,
#define COUNTS_AT(args) (counts + (args).counts_off)
#define COUNTS_PARAMS , __global int *counts
#define COUNTS_ARGS , counts
#define COUNT_ID(id)                                                                               \
    do {                                                                                           \
        const uint id_ = (uint)(id);                                                               \
        if (id_ < NUM_EXPERTS)                                                                     \
            atomic_inc(counts + id_);                                                 \
    } while (0)
#else
#define COUNTS_PARAM
#define COUNTS_AT(args) ((__global int *)0)
#define COUNTS_PARAMS
#define COUNTS_ARGS
#define COUNT_ID(id) ((void)0)
#endif
/* The bias is an argument only where there is one (as the counts are):
 * every argument costs an enqueue (cl/layout.h, layout_topk_args). */
#if HAS_BIAS
#define BIAS_PARAM __global const float *bias,
#define BIAS_AT(args) (bias + (args).bias_off)
#else
#define BIAS_PARAM
#define BIAS_AT(args) ((__global const float *)0)
#endif
#define GROUP_SIZE (NUM_GROUPS > 0 ? NUM_EXPERTS / NUM_GROUPS : NUM_EXPERTS)

/* Step 1, the score: softmax takes the row's max over the non-NaN logits
 * and the sum of exp(x - max); NaN and inf propagate as IEEE arithmetic
 * makes them (any NaN or +inf logit makes the whole row NaN). Sigmoid is
 * 1 / (1 + exp(-x)). Each kernel computes it in its own layout below. */

/* Step 2: selection score. */
static inline float selection_score(float score, __global const float *bias, uint e)
{
#if HAS_BIAS
    return score + bias[e];
#else
    return score;
#endif
}

/* Step 3: group score, accumulated over a group's selection scores. NaN is
 * passed over; a group of only NaN scores NaN (which ranks lowest); with
 * TOP2_SUM a repeated maximum counts twice and a group with one number
 * scores that number. */
typedef struct group_acc {
    float first, second;
    uint count;
} group_acc;

static inline void group_acc_init(group_acc *a)
{
    a->first = a->second = 0.0f;
    a->count = 0;
}

static inline void group_acc_add(group_acc *a, float s)
{
    if (isnan(s))
        return;
    if (a->count == 0 || s > a->first) {
        a->second = a->first;
        a->first = s;
    } else if (a->count == 1 || s > a->second) {
        a->second = s;
    }
    a->count++;
}

static inline float group_acc_score(const group_acc *a)
{
    if (a->count == 0)
        return NAN;
#if GROUP_SCORE == 1
    return a->count == 1 ? a->first : a->first + a->second;
#else
    return a->first;
#endif
}

/* Step 3, the fill of dropped groups (GROUP_FILL): their experts' rank is
 * RANK_NONE (never selected), or with the zero fill that of 0.0, which
 * ranks above every negative score and NaN and ties the kept 0s. Inactive
 * and padding entries (RANK_NONE) stay out. */
#define DROPPED_RANK(rank) (GROUP_FILL == 1 && (rank) != RANK_NONE ? select_rank(0.0f) : RANK_NONE)
/* The plain fill skips a dropped group's experts; the zero fill without a
 * bias zeroes their weights (the fill replaced the score). One name each,
 * so that constant conditions read as one operand. */
#define SKIPS_DROPPED (NUM_GROUPS > 0 && GROUP_FILL == 0)
#define ZERO_FILLED_WEIGHTS (NUM_GROUPS > 0 && GROUP_FILL == 1 && !HAS_BIAS)

/* Step 5: the divisor of the weights. The sum is taken in index order so
 * every device and launch shape gives the same bits. A macro because the
 * weights sit in private memory in one kernel and local in the other.
 * moecl's rule divides by a sum > 0 only; with RENORM_FLOOR (llama.cpp's
 * clamp) a sum below the floor divides by the floor. A NaN sum divides
 * by 1 either way. */
#ifdef RENORM_FLOOR
#define RENORM_DIVISOR(s) ((s) >= RENORM_FLOOR ? (s) : isnan(s) ? 1.0f : RENORM_FLOOR)
#else
#define RENORM_DIVISOR(s) ((s) > 0.0f ? (s) : 1.0f)
#endif
#if RENORMALIZE
#define WEIGHTS_DIVISOR(out, w, k)                                                                 \
    do {                                                                                           \
        float sum_ = 0.0f;                                                                         \
        for (uint j_ = 0; j_ < (k); j_++)                                                          \
            sum_ += (w)[j_];                                                                       \
        (out) = RENORM_DIVISOR(sum_);                                                              \
    } while (0)
#else
#define WEIGHTS_DIVISOR(out, w, k) ((out) = 1.0f)
#endif

#if TEAM == 1
/* ---------------------------------------------------------------------- */
/* One work-item per row (CPU devices).                                    */
/* ---------------------------------------------------------------------- */

/* The row is processed in blocks of eight experts as float8 vectors, so a
 * CPU driver runs exp and the comparisons in SIMD registers. The last,
 * partial block goes through the same vector code (padded), so equal inputs
 * give equal scores wherever they sit in the row. */
#define BLOCK LAYOUT_ROWS_BLOCK
#define BLOCKS LAYOUT_ROWS_BLOCKS(NUM_EXPERTS)

/* Elements e0..e0+7 of x as floats; lanes past the row get pad. */
static inline float8 load_block(__global const in_t *x, uint e0, float pad)
{
    if (e0 + BLOCK <= NUM_EXPERTS)
        return load_in8(x, e0);
    float t[BLOCK];
    for (uint l = 0; l < BLOCK; l++)
        t[l] = e0 + l < NUM_EXPERTS ? LOAD_IN(x, e0 + l) : pad;
    return vload8(0, t);
}

static inline float8 load_bias_block(__global const float *bias, uint e0)
{
#if HAS_BIAS
    if (e0 + BLOCK <= NUM_EXPERTS)
        return vload8(0, bias + e0);
    float t[BLOCK];
    for (uint l = 0; l < BLOCK; l++)
        t[l] = e0 + l < NUM_EXPERTS ? bias[e0 + l] : 0.0f;
    return vload8(0, t);
#else
    (void)bias;
    (void)e0;
    return (float8)(0.0f);
#endif
}

/* select_rank of eight selection scores. */
static inline uint8 select_rank8(float8 s)
{
    const uint8 u = as_uint8(s);
    uint8 r = select(u | 0x80000000u, ~u, as_int8(u) < 0);
    r = select(r, (uint8)(0x80000000u), s == 0.0f);
    return select(r, (uint8)(1u), isnan(s));
}

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
 * Intel's CPU runtime; the H200 gives wrong ids with it (bench/RESULTS.md,
 * "Correctness fixes"), so other devices take the generic loop below. */
#ifndef CPU_DEVICE
#define CPU_DEVICE 0
#endif
#if SCORING == 0 && !HAS_BIAS && NUM_GROUPS == 0 && CPU_DEVICE
#define ROWS_FAST 1
#define V16 16
#define BLOCKS16 ((NUM_EXPERTS + V16 - 1) / V16)
#define TOPK16 ((TOPK + V16 - 1) / V16 * V16)
#define PAIRS16 ((BLOCKS16 + 1) / 2)

/* exp(x) for x <= 0 (or NaN), within about 1 ulp: Cody-Waite reduction by
 * ln 2 and Cephes' degree-6 polynomial, the power of two built in the
 * exponent bits. Below -88 it returns 0 (the true value is under 2^-126);
 * -inf gives 0 and NaN gives NaN. One definition for the lanes and for
 * one value, so both give the same bits. */
#define DEFINE_EXP_NONPOS(name, F, I, AS_F, AS_I)                                                  \
    static inline F name(F x)                                                                      \
    {                                                                                              \
        const F xc = x < -88.0f ? (F)(-88.0f) : x; /* NaN stays */                                 \
        const F t = xc * 1.44269504088896341f + 12582912.0f; /* round to an integer n */           \
        const F n = t - 12582912.0f;                                                               \
        const I ni = AS_I(t) - 0x4B400000;                                                         \
        F r = fma(n, (F)(-0.693359375f), xc);                                                      \
        r = fma(n, (F)(2.12194440e-4f), r);                                                        \
        F p = (F)(1.9875691500e-4f);                                                               \
        p = fma(p, r, (F)(1.3981999507e-3f));                                                      \
        p = fma(p, r, (F)(8.3334519073e-3f));                                                      \
        p = fma(p, r, (F)(4.1665795894e-2f));                                                      \
        p = fma(p, r, (F)(1.6666665459e-1f));                                                      \
        p = fma(p, r, (F)(5.0000001201e-1f));                                                      \
        const F y = fma(p, r * r, r) + 1.0f;                                                       \
        return y * AS_F((ni + 127) << 23); /* n = -127: times 0 */                                 \
    }
DEFINE_EXP_NONPOS(exp_nonpos16, float16, int16, as_float16, as_int16)
DEFINE_EXP_NONPOS(exp_nonpos, float, int, as_float, as_int)

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

/* Elements e0..e0+15 of x; lanes past the row get pad. */
static inline float16 load_block16(__global const in_t *x, uint e0, float pad)
{
    if (e0 + V16 <= NUM_EXPERTS)
        return (float16)(load_in8(x, e0), load_in8(x, e0 + 8));
    float t[V16];
    for (uint l = 0; l < V16; l++)
        t[l] = e0 + l < NUM_EXPERTS ? LOAD_IN(x, e0 + l) : pad;
    return vload16(0, t);
}

static inline float hmax16(float16 v)
{
    float8 a = v.lo > v.hi ? v.lo : v.hi;
    float4 b = a.lo > a.hi ? a.lo : a.hi;
    float2 c = b.lo > b.hi ? b.lo : b.hi;
    return c.x > c.y ? c.x : c.y;
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

static inline void topk_rows_softmax(__global const in_t *x, __global float *w_out, __global int *id_out,
                              float scaling_factor COUNTS_PARAMS)
{
    const uint16 lane_bits = vload16(0, lane_bit16);
    const uint16 lane = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

    /* Pass 1: each lane's largest logit (padding -inf), the row's max. */
    float16 lane_max = (float16)(-INFINITY);
    for (uint b = 0; b < BLOCKS16; b++) {
        const float16 v = load_block16(x, b * V16, -INFINITY);
        lane_max = v > lane_max ? v : lane_max;
    }
    const float row_max = hmax16(lane_max);

    /* A floor for the k-th largest logit: the k-th largest lane maximum
     * (k lanes each hold a logit at least that large). Only logits at least
     * the floor can be chosen. */
    float floor_x = -INFINITY;
#if TOPK <= V16
    {
        int16 above = (int16)(0);
#define COUNT_ABOVE(sw, unused) above -= lane_max.sw > lane_max;
        ROTATIONS16(COUNT_ABOVE)
#undef COUNT_ABOVE
        floor_x = hmin16(above < TOPK ? lane_max : (float16)(INFINITY));
    }
#endif
    floor_x = rank_logit(floor_x, row_max);

    /* Pass 2, two blocks at a time: the sum of exp(x - max), and a bit for
     * each candidate (a logit at least the floor). */
    float16 acc = (float16)(0.0f);
    uint pair_bits[PAIRS16 + 1];
    for (uint p = 0; p < PAIRS16; p++) {
        const uint e0 = 2 * p * V16, e1 = e0 + V16;
        const float16 v0 = load_block16(x, e0, -INFINITY);
        const float16 v1 = load_block16(x, e1, -INFINITY);
        const float16 p0 = exp_nonpos16(v0 - row_max), p1 = exp_nonpos16(v1 - row_max);
        acc += p0;
        acc += p1;
        int16 hit0 = rank_logit16(v0, p0) >= floor_x, hit1 = rank_logit16(v1, p1) >= floor_x;
        if (e1 + V16 > NUM_EXPERTS) {
            hit0 &= as_int16(lane + e0 < (uint16)(NUM_EXPERTS));
            hit1 &= as_int16(lane + e1 < (uint16)(NUM_EXPERTS));
        }
        pair_bits[p] = hor16((as_uint16(hit0) & lane_bits) | (as_uint16(hit1) & (lane_bits << 16)));
    }
    pair_bits[PAIRS16] = 0;

    /* The candidates in index order, 64 experts at a time (one loop exit
     * per 64: the branches are few); the first 16 kept, the rest counted
     * into slot 16. */
    float cand_x[V16 + 1];
    uint cand_e[V16 + 1];
    uint count = 0;
    for (uint p = 0; p < PAIRS16; p += 2) {
        ulong bits = (ulong)pair_bits[p] | ((ulong)pair_bits[p + 1] << 32);
        while (bits) {
            const uint e = p * 2 * V16 + 63 - (uint)clz(bits & (0ul - bits));
            bits &= bits - 1;
            const uint slot = min(count, (uint)V16);
            cand_x[slot] = LOAD_IN(x, e);
            cand_e[slot] = e;
            count++;
        }
    }
    rank_candidates(cand_x, min(count, (uint)V16), floor_x, row_max);
    const float8 s8 = acc.lo + acc.hi;
    const float4 s4 = s8.lo + s8.hi;
    const float row_sum = (s4.s0 + s4.s1) + (s4.s2 + s4.s3);

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
        /* Many candidates (ties at the floor) or k > 16: insertion of every
         * candidate's key. Fewer candidates than k cannot happen (k lanes
         * hold a logit at least the floor); should a driver's vector
         * compares say otherwise, every expert is a candidate. */
        ulong keys[TOPK];
        float unused[TOPK];
        const float floor_all = count >= TOPK ? floor_x : -INFINITY;
        for (uint j = 0; j < TOPK; j++)
            keys[j] = KEY_NONE;
        for (uint e = 0; e < NUM_EXPERTS; e++) {
            const float v = rank_logit(LOAD_IN(x, e), row_max);
            if (v >= floor_all) {
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
    for (uint j = 0; j < TOPK16; j += V16)
        vstore16(exp_nonpos16(vload16(0, chosen_x + j) - row_max) / row_sum, 0, weights + j);
    float divisor;
    WEIGHTS_DIVISOR(divisor, weights, TOPK);
    for (uint j = 0; j < TOPK; j++) {
        w_out[j] = weights[j] / divisor * scaling_factor;
        id_out[j] = (int)chosen_e[j];
        COUNT_ID(chosen_e[j]);
    }
}
#endif

#if !ROWS_FAST
/* ---- The generic loop: every scoring, bias and grouping. ------------- */

/* The lanes of block b past the row's end. */
static inline int8 past_end(uint b)
{
    return as_int8((uint8)(0, 1, 2, 3, 4, 5, 6, 7) + b * BLOCK >= (uint8)(NUM_EXPERTS));
}

/* The largest of a block's eight ranks. */
static inline uint block_max_of(uint8 rank)
{
    const uint4 m4 = max(rank.lo, rank.hi);
    const uint2 m2 = max(m4.lo, m4.hi);
    return max(m2.x, m2.y);
}

/* Step 1: the row's scores. Softmax: the row's max (padding lanes -inf),
 * then exp(x - max) once per element, kept, and their sum (padding adds
 * nothing); the sum's order is fixed, so the bits are too. */
static inline void rows_scores(__global const in_t *x, float8 *score)
{
#if SCORING == 0
    float8 max8 = (float8)(-INFINITY);
    for (uint b = 0; b < BLOCKS; b++)
        max8 = fmax(max8, load_block(x, b * BLOCK, -INFINITY));
    const float row_max = fmax(fmax(fmax(max8.s0, max8.s1), fmax(max8.s2, max8.s3)),
                               fmax(fmax(max8.s4, max8.s5), fmax(max8.s6, max8.s7)));
    float8 sum8 = (float8)(0.0f);
    for (uint b = 0; b < BLOCKS; b++) {
        score[b] = exp(load_block(x, b * BLOCK, 0.0f) - row_max);
        sum8 += select(score[b], (float8)(0.0f), past_end(b));
    }
    const float row_sum = ((sum8.s0 + sum8.s1) + (sum8.s2 + sum8.s3)) + ((sum8.s4 + sum8.s5) + (sum8.s6 + sum8.s7));
    for (uint b = 0; b < BLOCKS; b++)
        score[b] = score[b] / row_sum;
#else
    for (uint b = 0; b < BLOCKS; b++)
        score[b] = 1.0f / (1.0f + exp(-load_block(x, b * BLOCK, 0.0f)));
#endif
}

/* Step 2: selection ranks (padding: RANK_NONE), and each block's largest. */
static inline void rows_selection_ranks(const float8 *score, __global const float *bias, uint8 *rank,
                                        uint *block_max)
{
    for (uint b = 0; b < BLOCKS; b++) {
        rank[b] = select(select_rank8(score[b] + load_bias_block(bias, b * BLOCK)), (uint8)(RANK_NONE), past_end(b));
        block_max[b] = block_max_of(rank[b]);
    }
}

#if NUM_GROUPS > 0
/* Step 3: keep the TOPK_GROUP groups of largest group score. Each group's
 * key goes to group_key[g]; the result is the TOPK_GROUP-th largest key:
 * keys are unique, so a group is kept exactly when its key is at least
 * that. */
static inline ulong rows_group_limit(const float8 *score, __global const float *bias, ulong *group_key)
{
    group_acc accs[NUM_GROUPS];
    for (uint g = 0; g < NUM_GROUPS; g++)
        group_acc_init(&accs[g]);
    for (uint b = 0; b < BLOCKS; b++) {
        float sel[BLOCK];
        vstore8(score[b] + load_bias_block(bias, b * BLOCK), 0, sel);
        for (uint l = 0; l < BLOCK && b * BLOCK + l < NUM_EXPERTS; l++)
            group_acc_add(&accs[(b * BLOCK + l) / GROUP_SIZE], sel[l]);
    }
    for (uint g = 0; g < NUM_GROUPS; g++)
        group_key[g] = rank_key(group_acc_score(&accs[g]), g);
    ulong threshold = ~0ul;
    for (uint r = 0; r < TOPK_GROUP; r++) {
        ulong next = KEY_NONE;
        for (uint g = 0; g < NUM_GROUPS; g++)
            if (group_key[g] < threshold && group_key[g] > next)
                next = group_key[g];
        threshold = next;
    }
    return threshold;
}

#if GROUP_FILL == 1
/* Step 3, zero fill: dropped experts take the rank of 0.0, and without a
 * bias the score 0.0 (the fill replaces the score, which is then the
 * selection score); each block's largest rank is taken again. */
static inline void rows_zero_fill(const ulong *group_key, ulong threshold, float8 *score, uint8 *rank,
                                  uint *block_max)
{
    for (uint b = 0; b < BLOCKS; b++) {
        uint r[BLOCK];
        float w[BLOCK];
        vstore8(rank[b], 0, r);
        vstore8(score[b], 0, w);
        for (uint l = 0; l < BLOCK && b * BLOCK + l < NUM_EXPERTS; l++) {
            if (group_key[(b * BLOCK + l) / GROUP_SIZE] >= threshold)
                continue;
            r[l] = DROPPED_RANK(r[l]);
            w[l] = HAS_BIAS ? w[l] : 0.0f;
        }
        rank[b] = vload8(0, r);
        score[b] = vload8(0, w);
        block_max[b] = block_max_of(rank[b]);
    }
}
#endif
#else
/* A floor for the k-th largest rank: the k-th largest block maximum (k
 * different blocks hold a rank at least that large). Ranks below it can
 * never be chosen, so most blocks are skipped whole. */
static inline uint rows_floor(const uint *block_max)
{
    if (BLOCKS < TOPK)
        return RANK_NONE;
    uint best[TOPK];
    for (uint j = 0; j < TOPK; j++)
        best[j] = RANK_NONE;
    for (uint b = 0; b < BLOCKS; b++) {
        uint v = block_max[b];
        for (uint j = 0; j < TOPK; j++) {
            const uint hi = max(best[j], v);
            v = min(best[j], v);
            best[j] = hi;
        }
    }
    return best[TOPK - 1];
}
#endif

/* Step 4: top-k by insertion into a descending list of keys (rank above
 * the complemented index), with each chosen expert's score as its weight.
 * A block is looked at lane by lane only when one of its ranks could
 * still enter: experts come in index order, so an equal rank never beats
 * the list's last entry. dropped(e): expert e's group is dropped (the
 * plain fill: never selected). */
static inline void rows_topk(const float8 *score, const uint8 *rank, const uint *block_max, uint floor_rank,
                             const ulong *group_key, ulong threshold, ulong *keys, float *weights)
{
    for (uint j = 0; j < TOPK; j++) {
        keys[j] = KEY_NONE;
        weights[j] = 0.0f;
    }
    for (uint b = 0; b < BLOCKS; b++) {
        const bool full = keys[TOPK - 1] != KEY_NONE;
        if (block_max[b] < floor_rank || (full && block_max[b] <= (uint)(keys[TOPK - 1] >> 32)))
            continue;
        uint r[BLOCK];
        float w[BLOCK];
        vstore8(rank[b], 0, r);
        vstore8(score[b], 0, w);
        for (uint l = 0; l < BLOCK; l++) {
            const uint e = b * BLOCK + l;
            if (r[l] == RANK_NONE || r[l] < floor_rank)
                continue;
            if (SKIPS_DROPPED && group_key[e / GROUP_SIZE] < threshold)
                continue;
            const ulong key = ((ulong)r[l] << 32) | (ulong)(~e);
            TOPK_INSERT(keys, weights, TOPK, key, w[l]);
        }
    }
}

/* Step 5: renormalise, scale and write the row. */
static inline void rows_write(const ulong *keys, const float *weights, __global float *w_out, __global int *id_out,
                              float scaling_factor COUNTS_PARAMS)
{
    float divisor;
    WEIGHTS_DIVISOR(divisor, weights, TOPK);
    for (uint j = 0; j < TOPK; j++) {
        w_out[j] = weights[j] / divisor * scaling_factor;
        id_out[j] = (int)key_index(keys[j]);
        COUNT_ID(key_index(keys[j]));
    }
}

static inline void topk_rows_generic(__global const in_t *x, __global const float *bias, __global float *w_out,
                                     __global int *id_out, float scaling_factor COUNTS_PARAMS)
{
    float8 score[BLOCKS];
    rows_scores(x, score);
    uint8 rank[BLOCKS];
    uint block_max[BLOCKS];
    rows_selection_ranks(score, bias, rank, block_max);
#if NUM_GROUPS > 0
    ulong group_key[NUM_GROUPS];
    const ulong threshold = rows_group_limit(score, bias, group_key);
    const uint floor_rank = RANK_NONE;
#if GROUP_FILL == 1
    rows_zero_fill(group_key, threshold, score, rank, block_max);
#endif
#else
    const ulong *group_key = 0;
    const ulong threshold = 0;
    const uint floor_rank = rows_floor(block_max);
#endif
    ulong keys[TOPK];
    float weights[TOPK];
    rows_topk(score, rank, block_max, floor_rank, group_key, threshold, keys, weights);
    rows_write(keys, weights, w_out, id_out, scaling_factor COUNTS_ARGS);
}
#endif

__kernel void topk_gating_rows(__global const in_t *gating, BIAS_PARAM __global float *topk_weights,
                               __global int *topk_ids, COUNTS_PARAM layout_topk_args args)
{
    const uint row = (uint)get_global_id(0);
    if (row >= args.num_tokens)
        return;
    __global const in_t *x = gating + args.gating_off + (size_t)row * NUM_EXPERTS;
    __global float *w_out = topk_weights + args.weights_off + (size_t)row * TOPK;
    /* The fast path counts the ids from its registers: topk_ids may be
     * write-only to kernels (the _host paths create it CL_MEM_WRITE_ONLY). */
    __global int *id_out = topk_ids + args.ids_off + (size_t)row * TOPK;
#if HAS_COUNTS
    counts = COUNTS_AT(args);
#endif
#if ROWS_FAST
    topk_rows_softmax(x, w_out, id_out, args.scaling_factor COUNTS_ARGS);
#else
    topk_rows_generic(x, BIAS_AT(args), w_out, id_out, args.scaling_factor COUNTS_ARGS);
#endif
}

#else
/* ---------------------------------------------------------------------- */
/* A team of TEAM work-items per row, ROWS rows per work-group (GPUs).      */
/* ---------------------------------------------------------------------- */

/* GROUP_PARTS: lanes that score one group together (a power of two, so
 * that a group's parts are neighbouring lanes). */
#define GROUP_PARTS LAYOUT_GROUP_PARTS(TEAM, NUM_GROUPS)

/* A softmax score exp(x - max) / sum; under NATIVE_MATH sum_term is
 * 1 / sum and the score e * (1 / sum). */
static inline float team_softmax_score(float x, float row_max, float sum_term)
{
#if NATIVE_MATH
    return EXP(x - row_max) * sum_term;
#else
    return EXP(x - row_max) / sum_term;
#endif
}

/* The score of a logit (step 1); for softmax from the row's terms. */
static inline float team_score(float x, float row_max, float sum_term)
{
    return SCORING == 0 ? team_softmax_score(x, row_max, sum_term) : 1.0f / (1.0f + EXP(-x));
}

/* The row in registers: element e = i * TEAM + lane, so each load
 * instruction of the team reads consecutive addresses. EPT, the elements
 * per work-item (NUM_EXPERTS / TEAM rounded up), comes from the host, so
 * that common.cl's team_topk sees it. */
static inline void team_load_row(__global const in_t *x, bool active, uint lane, float *value)
{
    UNROLL
    for (uint i = 0; i < EPT; i++) {
        const uint e = i * TEAM + lane;
        value[i] = (active && e < NUM_EXPERTS) ? LOAD_IN(x, e) : 0.0f;
    }
}

/* Step 1: what the scores need from the whole row, softmax's max and sum
 * (sum_term is 1 / sum under NATIVE_MATH); sigmoid needs nothing. The
 * scores themselves are computed where they are used, from the logits in
 * value[], which survive every barrier: Intel's CPU runtime (2026.2) loses
 * a work-item's exp() result held in private memory across a barrier and
 * hands every work-item the last one's (tests/test_drivers.c,
 * exp_across_barrier), so no score is kept across one. Every work-item
 * of the work-group calls (the reductions use barriers). */
static inline void team_score_terms(const float *value, uint lane, __local float *slots, float *row_max,
                                    float *sum_term)
{
    if (SCORING != 0) {
        *row_max = 0.0f;
        *sum_term = 1.0f;
        return;
    }
    float local_max = -INFINITY;
    UNROLL
    for (uint i = 0; i < EPT; i++)
        if (i * TEAM + lane < NUM_EXPERTS)
            local_max = fmax(local_max, value[i]);
    const float m = team_max_float(local_max, slots, lane);
    float local_sum = 0.0f;
    UNROLL
    for (uint i = 0; i < EPT; i++)
        if (i * TEAM + lane < NUM_EXPERTS)
            local_sum += EXP(value[i] - m);
    const float row_sum = team_sum_float(local_sum, slots, lane);
    *row_max = m;
    *sum_term = NATIVE_MATH ? 1.0f / row_sum : row_sum;
}

/* Step 2: selection ranks; padding and inactive rows get RANK_NONE. With
 * groups the selection scores also go to the row's local copy for step 3;
 * inactive rows store NaN (no score) there, so that step 3, which every
 * row runs for its barriers, reads no unwritten local memory. */
static inline void team_selection_ranks(const float *value, bool active, uint lane, __global const float *bias,
                                        float row_max, float sum_term, uint *rank, __local float *selection)
{
    UNROLL
    for (uint i = 0; i < EPT; i++) {
        const uint e = i * TEAM + lane;
        rank[i] = RANK_NONE;
        float s = NAN;
        if (active && e < NUM_EXPERTS) {
            s = selection_score(team_score(value[i], row_max, sum_term), bias, e);
            rank[i] = select_rank(s);
        }
        if (NUM_GROUPS > 0 && e < NUM_EXPERTS)
            selection[e] = s;
    }
}

#if NUM_GROUPS > 0
/* Step 3, the group scores into keys[g] from the row's selection scores.
 * With GROUP_PARTS > 1, GROUP_PARTS lanes per group each take every
 * GROUP_PARTS-th element (neighbouring lanes read neighbouring words) and
 * the group's first lane merges the parts (first/second/count: TEAM
 * slots); the top two of a group do not depend on the order they are met
 * in, so this scores as the plain loop does. */
static inline void team_group_scores(uint lane, __local const float *selection, __local ulong *keys,
                                     __local float *first, __local float *second, __local uint *count)
{
#if GROUP_PARTS > 1
    const uint g = lane / GROUP_PARTS, part = lane % GROUP_PARTS;
    group_acc acc;
    group_acc_init(&acc);
    if (g < NUM_GROUPS)
        for (uint e = g * GROUP_SIZE + part; e < (g + 1) * GROUP_SIZE; e += GROUP_PARTS)
            group_acc_add(&acc, selection[e]);
    first[lane] = acc.first;
    second[lane] = acc.second;
    count[lane] = min(acc.count, 2u);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (part == 0 && g < NUM_GROUPS) {
        for (uint q = 1; q < GROUP_PARTS; q++) {
            const uint n = count[lane + q];
            if (n >= 1)
                group_acc_add(&acc, first[lane + q]);
            if (n >= 2)
                group_acc_add(&acc, second[lane + q]);
        }
        keys[g] = rank_key(group_acc_score(&acc), g);
    }
#else
    (void)first;
    (void)second;
    (void)count;
    for (uint g = lane; g < NUM_GROUPS; g += TEAM) {
        group_acc acc;
        group_acc_init(&acc);
        for (uint e = g * GROUP_SIZE; e < (g + 1) * GROUP_SIZE; e++)
            group_acc_add(&acc, selection[e]);
        keys[g] = rank_key(group_acc_score(&acc), g);
    }
#endif
}

/* Step 3: keep the TOPK_GROUP groups of largest score (kept[g]) and give
 * the experts of the others DROPPED_RANK. Every work-item of the
 * work-group calls (barriers). */
static inline void team_group_limit(uint *rank, uint lane, __local const float *selection, __local ulong *keys,
                                    __local uchar *kept, __local float *first, __local float *second,
                                    __local uint *count)
{
    barrier(CLK_LOCAL_MEM_FENCE);
    team_group_scores(lane, selection, keys, first, second, count);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint g = lane; g < NUM_GROUPS; g += TEAM) {
        const ulong mine = keys[g];
        uint above = 0;
        for (uint h = 0; h < NUM_GROUPS; h++)
            above += keys[h] > mine;
        kept[g] = above < TOPK_GROUP;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    UNROLL
    for (uint i = 0; i < EPT; i++) {
        const uint e = i * TEAM + lane;
        if (e < NUM_EXPERTS && !kept[e / GROUP_SIZE])
            rank[i] = DROPPED_RANK(rank[i]);
    }
}
#endif

/* Step 5: the chosen logits' scores, which are the weights (scored again
 * here rather than kept across the barriers, see step 1). A slot no
 * candidate filled (fewer valid experts than TOPK cannot happen; kept 0
 * all the same) stays 0. */
static inline void team_chosen_weights(uint lane, float row_max, float sum_term, __local const uint *ids,
                                       __local float *weights, __local const uchar *kept)
{
    for (uint j = lane; j < TOPK; j += TEAM) {
        const uint id = ids[j];
        if (id != 0xffffffffu)
            weights[j] = team_score(weights[j], row_max, sum_term);
        /* Zero fill without a bias: the fill replaced a dropped expert's
         * score, which is its weight. */
        if (ZERO_FILLED_WEIGHTS && id != 0xffffffffu && !kept[id / GROUP_SIZE])
            weights[j] = 0.0f;
    }
}

/* Step 5, the rest: renormalise, scale and write the row. */
static inline void team_write_row(uint lane, __local const uint *ids, __local const float *weights,
                                  __global float *w_out, __global int *id_out, float scaling_factor COUNTS_PARAMS)
{
    float divisor;
    WEIGHTS_DIVISOR(divisor, weights, TOPK);
    for (uint j = lane; j < TOPK; j += TEAM) {
        w_out[j] = weights[j] / divisor * scaling_factor;
        id_out[j] = (int)ids[j];
        COUNT_ID(ids[j]);
    }
}

__kernel __attribute__((reqd_work_group_size(TEAM * ROWS, 1, 1))) void
topk_gating_team(__global const in_t *gating, BIAS_PARAM __global float *topk_weights, __global int *topk_ids,
                 COUNTS_PARAM layout_topk_args args DISPATCH_PARAMS)
{
    DISPATCH_LOCALS;
    /* Local memory (cl/layout.h, LAYOUT_TOPK_TEAM_ROW_BYTES), ROWS rows;
     * each macro below is row r's share. The softmax's slots for the max
     * and sum: none with shuffles, none for sigmoid (nothing to reduce). */
#if TEAM_SHUFFLE || SCORING != 0
#define FLOAT_SLOTS ((__local float *)0)
#else
    __local float float_slots[ROWS * TEAM];
#define FLOAT_SLOTS (float_slots + r * TEAM)
#endif
    TEAM_TOPK_LOCALS;
    __local float chosen_weights[ROWS * TOPK];
    __local uint chosen_ids[ROWS * TOPK];
#if NUM_GROUPS > 0
    __local float row_selection[ROWS * NUM_EXPERTS];
    __local ulong group_keys[ROWS * NUM_GROUPS];
    __local uchar group_kept[ROWS * NUM_GROUPS];
#define SELECTION (row_selection + r * NUM_EXPERTS)
#define KEPT (group_kept + r * NUM_GROUPS)
#if GROUP_PARTS > 1
    __local float part_first[ROWS * TEAM];
    __local float part_second[ROWS * TEAM];
    __local uint part_count[ROWS * TEAM];
#define PARTS part_first + r * TEAM, part_second + r * TEAM, part_count + r * TEAM
#else
#define PARTS (__local float *)0, (__local float *)0, (__local uint *)0
#endif
#else
#define SELECTION ((__local float *)0)
#define KEPT ((__local uchar *)0)
#endif
    const uint lane = get_local_id(0) % TEAM;
    const uint r = get_local_id(0) / TEAM;
    const uint row = get_group_id(0) * ROWS + r;
    const bool active = row < args.num_tokens;
    __global const in_t *x = gating + args.gating_off + (size_t)(active ? row : 0) * NUM_EXPERTS;
#if HAS_COUNTS
    counts = COUNTS_AT(args);
#endif

    float value[EPT];
    team_load_row(x, active, lane, value);
    float row_max, sum_term;
    team_score_terms(value, lane, FLOAT_SLOTS, &row_max, &sum_term);
    uint rank[EPT];
    team_selection_ranks(value, active, lane, BIAS_AT(args), row_max, sum_term, rank, SELECTION);
#if NUM_GROUPS > 0
    team_group_limit(rank, lane, SELECTION, group_keys + r * NUM_GROUPS, KEPT, PARTS);
#endif
    /* Step 4: the top-k of the ranks; chosen_weights gets the chosen logits. */
    team_topk(rank, value, TEAM_TOPK_SCRATCH(r), lane, chosen_ids + r * TOPK, chosen_weights + r * TOPK);
    barrier(CLK_LOCAL_MEM_FENCE);
    team_chosen_weights(lane, row_max, sum_term, chosen_ids + r * TOPK, chosen_weights + r * TOPK, KEPT);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (active)
        team_write_row(lane, chosen_ids + r * TOPK, chosen_weights + r * TOPK,
                       topk_weights + args.weights_off + (size_t)row * TOPK,
                       topk_ids + args.ids_off + (size_t)row * TOPK, args.scaling_factor COUNTS_ARGS);
    DISPATCH_AFTER_ROWS(topk_ids + args.ids_off, args.num_tokens);
}
#endif
