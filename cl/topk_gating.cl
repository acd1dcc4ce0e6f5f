/* Top-k gating (docs/routing.md, section 1), one function per step of the
 * spec. Specialised at build time:
 *   NUM_EXPERTS, TOPK          the shape
 *   SCORING                    0 softmax, 1 sigmoid
 *   HAS_BIAS                   correction bias steers selection only
 *   NUM_GROUPS, TOPK_GROUP     group-limited selection (NUM_GROUPS 0: none)
 *   GROUP_SCORE                0 max, 1 sum of the top two
 *   RENORMALIZE                divide the weights by their sum when > 0
 *   TEAM, ROWS                 launch shape (common.cl)
 * Two kernels: topk_gating_rows (TEAM == 1, for CPUs: one work-item per
 * row, plain loops over the row) and topk_gating_team (TEAM > 1, for GPUs:
 * the row lives in the registers of TEAM work-items, EPT elements each). */

#ifndef NUM_GROUPS
#define NUM_GROUPS 0
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

/* Step 5: the divisor of the weights. The sum is taken in index order so
 * every device and launch shape gives the same bits. A macro because the
 * weights sit in private memory in one kernel and local in the other. */
#if RENORMALIZE
#define WEIGHTS_DIVISOR(out, w, k)                                                                 \
    do {                                                                                           \
        float sum_ = 0.0f;                                                                         \
        for (uint j_ = 0; j_ < (k); j_++)                                                          \
            sum_ += (w)[j_];                                                                       \
        (out) = sum_ > 0.0f ? sum_ : 1.0f;                                                         \
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
#define BLOCK 8
#define BLOCKS ((NUM_EXPERTS + BLOCK - 1) / BLOCK)

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

__kernel void topk_gating_rows(__global const in_t *gating, ulong gating_off, __global const float *bias,
                               ulong bias_off, __global float *topk_weights, ulong weights_off,
                               __global int *topk_ids, ulong ids_off, uint num_tokens, float scaling_factor)
{
    const uint row = (uint)get_global_id(0);
    if (row >= num_tokens)
        return;
    __global const in_t *x = gating + gating_off + (size_t)row * NUM_EXPERTS;
#if HAS_BIAS
    bias += bias_off;
#endif
    const uint8 lane = (uint8)(0, 1, 2, 3, 4, 5, 6, 7);

    /* Step 1: scores. Softmax: the row's max (padding lanes -inf), then
     * exp(x - max) once per element, kept, and their sum (padding adds
     * nothing); the sum's order is fixed, so the bits are too. */
    float8 score[BLOCKS];
#if SCORING == 0
    float8 max8 = (float8)(-INFINITY);
    for (uint b = 0; b < BLOCKS; b++)
        max8 = fmax(max8, load_block(x, b * BLOCK, -INFINITY));
    const float row_max = fmax(fmax(fmax(max8.s0, max8.s1), fmax(max8.s2, max8.s3)),
                               fmax(fmax(max8.s4, max8.s5), fmax(max8.s6, max8.s7)));
    float8 sum8 = (float8)(0.0f);
    for (uint b = 0; b < BLOCKS; b++) {
        score[b] = exp(load_block(x, b * BLOCK, 0.0f) - row_max);
        sum8 += select(score[b], (float8)(0.0f), as_int8(lane + b * BLOCK >= (uint8)(NUM_EXPERTS)));
    }
    const float row_sum = ((sum8.s0 + sum8.s1) + (sum8.s2 + sum8.s3)) + ((sum8.s4 + sum8.s5) + (sum8.s6 + sum8.s7));
    for (uint b = 0; b < BLOCKS; b++)
        score[b] = score[b] / row_sum;
#else
    for (uint b = 0; b < BLOCKS; b++)
        score[b] = 1.0f / (1.0f + exp(-load_block(x, b * BLOCK, 0.0f)));
#endif

    /* Step 2: selection ranks (padding: RANK_NONE), and each block's
     * largest. */
    uint8 rank[BLOCKS];
    uint block_max[BLOCKS];
    for (uint b = 0; b < BLOCKS; b++) {
        rank[b] = select(select_rank8(score[b] + load_bias_block(bias, b * BLOCK)), (uint8)(RANK_NONE),
                         as_int8(lane + b * BLOCK >= (uint8)(NUM_EXPERTS)));
        const uint4 m4 = max(rank[b].lo, rank[b].hi);
        const uint2 m2 = max(m4.lo, m4.hi);
        block_max[b] = max(m2.x, m2.y);
    }

    uint floor_rank = RANK_NONE;
#if NUM_GROUPS > 0
    /* Step 3: keep the TOPK_GROUP groups of largest group score: find the
     * TOPK_GROUP-th largest group key; keys are unique, so a group is kept
     * exactly when its key is at least that. */
    group_acc accs[NUM_GROUPS];
    for (uint g = 0; g < NUM_GROUPS; g++)
        group_acc_init(&accs[g]);
    for (uint b = 0; b < BLOCKS; b++) {
        float sel[BLOCK];
        vstore8(score[b] + load_bias_block(bias, b * BLOCK), 0, sel);
        for (uint l = 0; l < BLOCK && b * BLOCK + l < NUM_EXPERTS; l++)
            group_acc_add(&accs[(b * BLOCK + l) / GROUP_SIZE], sel[l]);
    }
    ulong group_key[NUM_GROUPS];
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
#else
    /* A floor for the k-th largest rank: the k-th largest block maximum
     * (k different blocks hold a rank at least that large). Ranks below it
     * can never be chosen, so most blocks are skipped whole. */
    if (BLOCKS >= TOPK) {
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
        floor_rank = best[TOPK - 1];
    }
#endif

    /* Step 4: top-k by insertion into a descending list of keys (rank above
     * the complemented index). A block is looked at lane by lane only when
     * one of its ranks could still enter: experts come in index order, so
     * an equal rank never beats the list's last entry. */
    ulong keys[TOPK];
    float weights[TOPK];
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
#if NUM_GROUPS > 0
            if (group_key[e / GROUP_SIZE] < threshold)
                continue;
#endif
            const ulong key = ((ulong)r[l] << 32) | (ulong)(~e);
            TOPK_INSERT(keys, weights, TOPK, key, w[l]);
        }
    }

    float divisor;
    WEIGHTS_DIVISOR(divisor, weights, TOPK);
    __global float *w_out = topk_weights + weights_off + (size_t)row * TOPK;
    __global int *id_out = topk_ids + ids_off + (size_t)row * TOPK;
    for (uint j = 0; j < TOPK; j++) {
        w_out[j] = weights[j] / divisor * scaling_factor;
        id_out[j] = (int)key_index(keys[j]);
    }
}

#else
/* ---------------------------------------------------------------------- */
/* A team of TEAM work-items per row, ROWS rows per work-group (GPUs).      */
/* ---------------------------------------------------------------------- */

/* EPT, the elements per work-item (NUM_EXPERTS / TEAM rounded up), comes
 * from the host, so that common.cl's team_topk sees it. */

__kernel __attribute__((reqd_work_group_size(TEAM * ROWS, 1, 1))) void
topk_gating_team(__global const in_t *gating, ulong gating_off, __global const float *bias, ulong bias_off,
                 __global float *topk_weights, ulong weights_off, __global int *topk_ids, ulong ids_off,
                 uint num_tokens, float scaling_factor)
{
#if TEAM_SHUFFLE
#define FLOAT_SLOTS ((__local float *)0)
#else
    __local float float_slots[ROWS * TEAM];
#define FLOAT_SLOTS (float_slots + r * TEAM)
#endif
#if TOPK_COUNT
    __local uint topk_u32[ROWS * TOPK_COUNT_U32];
    __local ulong topk_keys[ROWS * TOPK_CAP];
    __local float topk_values[ROWS * TOPK_CAP];
#define TOPK_SCRATCH topk_u32 + r * TOPK_COUNT_U32, topk_keys + r * TOPK_CAP, topk_values + r * TOPK_CAP
#elif TEAM_SHUFFLE
#define TOPK_SCRATCH ((__local ulong *)0)
#else
    __local ulong key_slots[ROWS * TEAM];
#define TOPK_SCRATCH (key_slots + r * TEAM)
#endif
    __local float chosen_weights[ROWS * TOPK];
    __local uint chosen_ids[ROWS * TOPK];
#if NUM_GROUPS > 0
    __local float row_selection[ROWS * NUM_EXPERTS];
    __local ulong group_keys[ROWS * NUM_GROUPS];
    __local uchar group_kept[ROWS * NUM_GROUPS];
#endif
    const uint lane = get_local_id(0) % TEAM;
    const uint r = get_local_id(0) / TEAM;
    const uint row = get_group_id(0) * ROWS + r;
    const bool active = row < num_tokens;
    __global const in_t *x = gating + gating_off + (size_t)(active ? row : 0) * NUM_EXPERTS;
#if HAS_BIAS
    bias += bias_off;
#endif

    /* The row in registers: element e = i * TEAM + lane, so each load
     * instruction of the team reads consecutive addresses. */
    float value[EPT];
    UNROLL
    for (uint i = 0; i < EPT; i++) {
        uint e = i * TEAM + lane;
        value[i] = (active && e < NUM_EXPERTS) ? LOAD_IN(x, e) : 0.0f;
    }

    /* Step 1: scores. */
#if SCORING == 0
    float local_max = -INFINITY;
    UNROLL
    for (uint i = 0; i < EPT; i++)
        if (i * TEAM + lane < NUM_EXPERTS)
            local_max = fmax(local_max, value[i]);
    const float row_max = team_max_float(local_max, FLOAT_SLOTS, lane);
    /* exp once per element: kept for the scores after the sum. */
    float local_sum = 0.0f;
    UNROLL
    for (uint i = 0; i < EPT; i++) {
        value[i] = EXP(value[i] - row_max);
        if (i * TEAM + lane < NUM_EXPERTS)
            local_sum += value[i];
    }
    const float row_sum = team_sum_float(local_sum, FLOAT_SLOTS, lane);
#if NATIVE_MATH
    const float inv_sum = 1.0f / row_sum;
    UNROLL
    for (uint i = 0; i < EPT; i++)
        value[i] = value[i] * inv_sum;
#else
    UNROLL
    for (uint i = 0; i < EPT; i++)
        value[i] = value[i] / row_sum;
#endif
#else
    UNROLL
    for (uint i = 0; i < EPT; i++)
        value[i] = 1.0f / (1.0f + EXP(-value[i]));
#endif

    /* Step 2: selection ranks; padding and inactive rows get RANK_NONE. */
    uint rank[EPT];
    UNROLL
    for (uint i = 0; i < EPT; i++) {
        uint e = i * TEAM + lane;
        rank[i] = RANK_NONE;
        if (active && e < NUM_EXPERTS) {
            float s = selection_score(value[i], bias, e);
            rank[i] = select_rank(s);
#if NUM_GROUPS > 0
            row_selection[r * NUM_EXPERTS + e] = s;
#endif
        }
    }

#if NUM_GROUPS > 0
    /* Step 3: group scores from the row's selection scores in local memory,
     * then each group's rank among the row's groups. */
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint g = lane; g < NUM_GROUPS; g += TEAM) {
        group_acc acc;
        group_acc_init(&acc);
        for (uint e = g * GROUP_SIZE; e < (g + 1) * GROUP_SIZE; e++)
            group_acc_add(&acc, row_selection[r * NUM_EXPERTS + e]);
        group_keys[r * NUM_GROUPS + g] = rank_key(group_acc_score(&acc), g);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint g = lane; g < NUM_GROUPS; g += TEAM) {
        ulong mine = group_keys[r * NUM_GROUPS + g];
        uint above = 0;
        for (uint h = 0; h < NUM_GROUPS; h++)
            above += group_keys[r * NUM_GROUPS + h] > mine;
        group_kept[r * NUM_GROUPS + g] = above < TOPK_GROUP;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    UNROLL
    for (uint i = 0; i < EPT; i++) {
        uint e = i * TEAM + lane;
        if (e < NUM_EXPERTS && !group_kept[r * NUM_GROUPS + e / GROUP_SIZE])
            rank[i] = RANK_NONE;
    }
#endif

    /* Step 4: TOPK rounds of "largest key in the team". */
    team_topk(rank, value, TOPK_SCRATCH, lane, chosen_ids + r * TOPK, chosen_weights + r * TOPK);
    barrier(CLK_LOCAL_MEM_FENCE);

    /* Step 5: weights, and the ids from the chosen keys. */
    if (active) {
        float divisor;
        WEIGHTS_DIVISOR(divisor, chosen_weights + r * TOPK, TOPK);
        __global float *w_out = topk_weights + weights_off + (size_t)row * TOPK;
        __global int *id_out = topk_ids + ids_off + (size_t)row * TOPK;
        for (uint j = lane; j < TOPK; j += TEAM) {
            w_out[j] = chosen_weights[r * TOPK + j] / divisor * scaling_factor;
            id_out[j] = (int)chosen_ids[r * TOPK + j];
        }
    }
}
#endif
