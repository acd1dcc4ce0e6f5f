/* Grounded router (docs/routing.md, section 3):
 *   g[e] = router_logits[e] + alpha * dot(token_hidden, expert_ground[e])
 * with fp32 accumulation, and g the row of logits of the gating pipeline
 * (cl/gating.cl, its defines: SCORING, WEIGHTING, HAS_BIAS, groups,
 * renormalisation); the seed's defaults select the TOPK largest g
 * (descending, ties to the lower index, NaN lowest) and weigh them by a
 * softmax over the chosen g.
 * Specialised at build time:
 *   HIDDEN_DIM, NUM_EXPERTS, TOPK       the shape
 *   IN_DTYPE                            dtype of token_hidden and expert_ground
 *   HAS_LOGITS                          (absent: 1) router_logits is read;
 *                                       0: g = alpha * dot (moecl_router)
 *   LOGITS_ROW                          (absent: 0) router_logits is one
 *                                       row for every token (a gate bias)
 *   LOGIT_ROUND, SOFTCAP                g as the model has it (cl/gating.cl,
 *                                       logit_of)
 *   HAS_PAIRS, HAS_WEIGHTS, HAS_IDS     which outputs to write (the weights
 *                                       and ids of WEIGHTS_DTYPE and
 *                                       IDS_DTYPE, cl/gating.cl; the pairs
 *                                       f32)
 *   HAS_COUNTS, HAS_LOAD, HAS_VALID     (absent: 0) the histograms and the
 *                                       valid count (cl/gating.cl)
 *   CAPTURE, HAS_SCALE                  (absent: 0) a copy of the ids and a
 *                                       per-expert weight scale (below)
 *   SHARED, SHARED_WEIGHT, SHARED_GATE  (absent: 0) shared slots after the
 *                                       routed ones (cl/gating.cl; below)
 *   KERNEL                              0 rows, 1 team, 2 tiled, 4 split-K
 *                                       (below; 3 is cl/router_mma.cl)
 *   TM, TN, TK                          tile of the tiled kernel (tokens,
 *                                       experts, hidden step); of the
 *                                       split-K kernel (tokens, experts,
 *                                       hidden chunk)
 *   SPLIT_WG                            the split-K kernel's work-group
 *   MT, NT, VEC, DB                     its register block, vector width
 *                                       and double buffering
 *   TEAM, ROWS, EPT                     shape of the team kernel (common.cl)
 *   ROUTE_DISPATCH, FUSED_WG            the team kernel with moe_align's
 *                                       fused steps after its rows
 *                                       (moecl_grounded_route_dispatch;
 *                                       common.cl, DISPATCH_AFTER_ROWS)
 * Three kernels:
 *  - grounded_router_rows (CPUs): one work-item per token, plain loops;
 *  - grounded_router_team (GPUs, small expert tables such as the seed's):
 *    TEAM work-items per token, each owning EPT experts; the ground table
 *    and the tokens' hidden states sit in local memory; top-k as in top-k
 *    gating's team kernel;
 *  - grounded_router_tiled (GPUs, large shapes): a work-group computes a
 *    TM x TN tile of g at a time, streaming the hidden dimension through
 *    local memory in steps of TK, each work-item an MT x NT block in
 *    registers; the top-k of each token is merged tile by tile;
 *  - grounded_router_splitk (GPUs, few tokens): the hidden dimension split
 *    across work-groups, partial dot products through a scratch buffer,
 *    the last work-group of a token block adding them in a fixed order and
 *    gating the block, a team of 32 work-items a token above 32 experts. */

#ifndef KERNEL
#define KERNEL 0
#endif
#ifndef HAS_LOGITS
#define HAS_LOGITS 1
#endif
#ifndef LOGITS_ROW
#define LOGITS_ROW 0
#endif
/* g from the dot product: the router logit plus alpha times it, or alpha
 * times it alone. */
#if HAS_LOGITS
#define G_OF(logit, dot) logit_of((logit) + alpha * (dot))
#if LOGITS_ROW
#define LOGIT_AT(t, e) logits[(e)]
#else
#define LOGIT_AT(t, e) logits[(size_t)(t)*NUM_EXPERTS + (e)]
#endif
#else
#define G_OF(logit, dot) logit_of(alpha * (dot))
#define LOGIT_AT(t, e) 0.0f
#endif
/* The tiled kernel's running top-k is right only where the selection is
 * on g itself, with no bias and no groups (any weighting: the chosen g
 * come back from their keys). */
#define MERGEABLE (SCORING == 3 && !HAS_BIAS && NUM_GROUPS == 0)

/* The float a rank_of_float value came from (-0 comes back as +0 and every
 * NaN as one NaN, neither of which changes a weight). */
static inline float float_of_rank(uint r)
{
    if (r == 0u)
        return NAN;
    return (r & 0x80000000u) ? as_float(r & 0x7fffffffu) : as_float(~r);
}

/* moecl_router_ex's outputs beyond the weights and ids, each a kernel
 * argument (and its offset in elements) only where its define is set:
 *   CAPTURE    0 (absent): none; else a copy of the ids written (-1 for a
 *              padding row) as 1 int, 2 long, 3 short (1 + moecl_index_dtype)
 *   HAS_SCALE  a float per expert, by which a chosen expert's final weight
 *              is multiplied after the renormalisation and the scaling
 *              factor (Gemma 4's per_expert_scale)
 * and the histograms and the valid count of cl/gating.cl. */
#ifndef CAPTURE
#define CAPTURE 0
#endif
#ifndef HAS_SCALE
#define HAS_SCALE 0
#endif
/* SHARED_GATE (with SHARED): shared slot j weighs sigmoid(dot(hidden row,
 * shared_gate row j)) (Qwen2-MoE's shared_expert_gate), an argument [SHARED]
 * [HIDDEN_DIM] of in_t; else the constant SHARED_WEIGHT * scaling factor. */
#ifndef SHARED_GATE
#define SHARED_GATE 0
#endif
#if CAPTURE == 0 || CAPTURE == 1
typedef int capture_t;
#elif CAPTURE == 2
typedef long capture_t;
#elif CAPTURE == 3
typedef short capture_t;
#else
#error "CAPTURE must be 0 (none), 1 (int32), 2 (int64) or 3 (int16)"
#endif
#if HAS_COUNTS
#define COUNTS_KPARAM , __global int *counts, ulong counts_off
#define COUNTS_AT counts + counts_off
#else
#define COUNTS_KPARAM
#define COUNTS_AT 0
#endif
#if HAS_LOAD
#define LOAD_KPARAM , __global int *load, ulong load_off
#define LOAD_AT load + load_off
#else
#define LOAD_KPARAM
#define LOAD_AT 0
#endif
#if HAS_VALID
#define VALID_KPARAM , __global const int *num_valid, ulong valid_off
#define VALID_COUNT valid_rows(num_valid, valid_off, num_tokens)
#else
#define VALID_KPARAM
#define VALID_COUNT num_tokens
#endif
#if CAPTURE
#define CAPTURE_KPARAM , __global capture_t *captured, ulong captured_off
#define CAPTURE_AT captured + captured_off
#else
#define CAPTURE_KPARAM
#define CAPTURE_AT 0
#endif
#if HAS_SCALE
#define SCALE_KPARAM , __global const float *scale, ulong scale_off
#define SCALE_AT scale + scale_off
#else
#define SCALE_KPARAM
#define SCALE_AT 0
#endif
#if SHARED_GATE
#define GATE_KPARAM , __global const in_t *shared_gate, ulong gate_off
#define GATE_AT shared_gate + gate_off
#else
#define GATE_KPARAM
#define GATE_AT 0
#endif

/* Those outputs at their offsets, and the rows that are tokens. */
typedef struct route_extras {
    __global int *counts, *load;
    __global capture_t *captured;
    __global const float *scale;
    __global const in_t *gate;
    uint valid;
} route_extras;
#define ROUTE_EXTRAS(x)                                                                            \
    route_extras x;                                                                                \
    x.counts = COUNTS_AT;                                                                          \
    x.load = LOAD_AT;                                                                              \
    x.captured = CAPTURE_AT;                                                                       \
    x.scale = SCALE_AT;                                                                            \
    x.gate = GATE_AT;                                                                              \
    x.valid = VALID_COUNT

/* Slot `at` of the outputs (a row is ROW_SLOTS wide: the routed slots,
 * then the shared ones): its id and weight. */
static inline void store_slot(size_t at, int id, float w, __global float *pairs, __global weight_t *weights,
                              __global ids_t *ids)
{
#if HAS_PAIRS
    pairs[2 * at] = (float)id;
    pairs[2 * at + 1] = w;
#endif
#if HAS_WEIGHTS
    STORE_WEIGHT(weights, at, w);
#endif
#if HAS_IDS
    STORE_ID(ids, at, id);
#endif
}

/* Output slot j of a row: its id and final weight (private values); a
 * padding row's slot (HAS_VALID) id -1 and weight 0, counted nowhere. The
 * capture holds the routed slots only, TOPK a row. */
static inline void write_output(uint j, uint id, float w, uint row, __global float *pairs,
                                __global weight_t *weights, __global ids_t *ids, const route_extras *x)
{
    int out_id = (int)id;
    if (HAS_VALID && row >= x->valid) {
        out_id = -1;
        w = 0.0f;
    } else {
        __global int *counts = x->counts, *load = x->load;
        COUNT_ID(id);
#if HAS_SCALE
        w *= x->scale[id];
#endif
    }
#if CAPTURE
    x->captured[(size_t)row * TOPK + j] = (capture_t)out_id;
#endif
    store_slot((size_t)row * ROW_SLOTS + j, out_id, w, pairs, weights, ids);
}

#if SHARED_GATE
/* Shared slot j's gate: sigmoid(dot(h, gate row j)), the dot product one
 * fma chain in f32 by ascending hidden index (docs/routing.md, §3), the
 * same in every kernel. */
static inline float shared_gate_weight(__global const in_t *h, __global const in_t *gate, uint j)
{
    __global const in_t *w = gate + (size_t)j * HIDDEN_DIM;
    float dot = 0.0f;
    for (uint i = 0; i < HIDDEN_DIM; i++)
        dot = fma(LOAD_IN(h, i), LOAD_IN(w, i), dot);
    return 1.0f / (1.0f + exp(-dot));
}
#endif

/* A row's shared slots j0, j0 + step, ... (SHARED > 0): id NUM_EXPERTS + j
 * and the constant weight SHARED_WEIGHT * scaling_factor, or the gate's;
 * no expert_scale, no capture; a padding row's -1 / 0, counted nowhere.
 * hidden: the token rows (the gate reads row `row`). */
static inline void write_shared(uint j0, uint step, uint row, __global const in_t *hidden, float scaling_factor,
                                __global float *pairs, __global weight_t *weights, __global ids_t *ids,
                                const route_extras *x)
{
    const bool padding = HAS_VALID && row >= x->valid;
    for (uint j = j0; j < SHARED; j += step) {
        const int id = padding ? -1 : (int)(NUM_EXPERTS + j);
#if SHARED_GATE
        const float w = padding ? 0.0f : shared_gate_weight(hidden + (size_t)row * HIDDEN_DIM, x->gate, j);
#else
        const float w = padding ? 0.0f : SHARED_WEIGHT * scaling_factor;
#endif
        if (!padding) {
            __global int *counts = x->counts, *load = x->load;
            COUNT_ID(id);
        }
        store_slot((size_t)row * ROW_SLOTS + TOPK + j, id, w, pairs, weights, ids);
    }
}

#define OUTPUT_PARAMS                                                                              \
    __global const bias_t *bias, ulong bias_off, __global float *pairs, ulong pairs_off,                            \
        __global weight_t *weights, ulong weights_off, __global ids_t *ids, ulong ids_off, uint num_tokens,       \
        float alpha, float scaling_factor COUNTS_KPARAM LOAD_KPARAM VALID_KPARAM CAPTURE_KPARAM SCALE_KPARAM GATE_KPARAM

#define OFFSET_OUTPUTS()                                                                           \
    do {                                                                                           \
        hidden += hidden_off;                                                                      \
        if (HAS_LOGITS)                                                                            \
            logits += logits_off;                                                                  \
        ground += ground_off;                                                                      \
        if (HAS_BIAS)                                                                              \
            bias += bias_off;                                                                      \
        if (HAS_PAIRS)                                                                             \
            pairs += pairs_off;                                                                    \
        if (HAS_WEIGHTS)                                                                           \
            weights += weights_off;                                                                \
        if (HAS_IDS)                                                                               \
            ids += ids_off;                                                                        \
    } while (0)

#if TEAM == 1
/* Rows of g whole in local memory (row m at g_rows + m * stride, its
 * experts from 0), `count` tokens from row0: the gating pipeline of
 * cl/gating.cl (steps 1-5, every gating, the bias where there is one) on
 * each, one work-item a token, and its outputs. The epilogue of the
 * tensor-core and split-K kernels. */
static inline void gate_local_rows(__local const float *g_rows, uint stride, uint count, uint row0, uint num_tokens,
                                   uint lid, __global const in_t *hidden, __global const bias_t *bias,
                                   float scaling_factor, __global float *pairs, __global weight_t *weights,
                                   __global ids_t *ids, const route_extras *extras)
{
    if (lid >= count || row0 + lid >= num_tokens)
        return;
    float8 logit[BLOCKS];
    for (uint b = 0; b < BLOCKS; b++) {
        float v[8];
        for (uint q = 0; q < 8; q++) {
            const uint e = b * 8 + q;
            v[q] = e < NUM_EXPERTS ? g_rows[lid * stride + e] : 0.0f;
        }
        logit[b] = vload8(0, v);
    }
    float w[TOPK];
    uint id[TOPK];
    rows_pipeline(logit, bias, scaling_factor, w, id);
    for (uint j = 0; j < TOPK; j++)
        write_output(j, id[j], w[j], row0 + lid, pairs, weights, ids, extras);
    if (SHARED)
        write_shared(0, 1, row0 + lid, hidden, scaling_factor, pairs, weights, ids, extras);
}
#endif

#if KERNEL == 0
/* ---------------------------------------------------------------------- */
/* TM tokens per work-item (CPU devices).                                  */
/* ---------------------------------------------------------------------- */

/* Register blocking: a work-item takes TM tokens, MB at a time, and goes
 * through the experts RN at a time, keeping MB x RN dot products as float16
 * partial sums (16 hidden indices per step, SIMD on CPUs). Each ground row
 * read serves MB tokens and each hidden vector RN experts, so the ground
 * table is streamed once per MB tokens, not once per token; a chunk of HC
 * hidden indices of the block's ground rows serves all TM tokens before the
 * next chunk. The partial sums of a block are reduced together
 * (sum16_of_16), not one by one. Every token's dot products are computed
 * the same way whatever its place in the block, so a row's result does not
 * depend on the others: a block past the last token repeats the last token
 * and writes nothing for it, and the last expert block repeats the last
 * expert. */
#if !defined(TM) || TM < 1
#undef TM
#define TM 1
#endif
#ifndef MB
#define MB LAYOUT_GROUNDED_MB(TM) /* tokens of a register block */
#endif
#if TM % MB != 0
#error "TM must be a multiple of MB"
#endif
#ifndef RN
#define RN LAYOUT_GROUNDED_RN
#endif
#define H16 (HIDDEN_DIM / 16 * 16)
#define EB LAYOUT_GROUNDED_EB(NUM_EXPERTS) /* expert block */
#ifndef HC
#define HC LAYOUT_GROUNDED_HC /* hidden chunk (a multiple of 16) */
#endif

static inline float16 load_hidden16(__global const in_t *p, uint i)
{
    return (float16)(load_in8(p, i), load_in8(p, i + 8));
}

static inline float sum16(float16 v)
{
    const float8 a = v.lo + v.hi;
    const float4 b = a.lo + a.hi;
    return (b.s0 + b.s1) + (b.s2 + b.s3);
}

#if MB * RN == 16
/* sum16 of each of sixteen vectors at once, lane q holding sum16(v[q]) bit
 * for bit: the same pairs of lanes added in the same order, but each add
 * serves several vectors (15 adds and 30 shuffles instead of some 160
 * instructions of sixteen separate sum16 calls). v is one array of 16: C
 * leaves reading past the first row of a 2-D array through &a[0][0]
 * undefined, and Mesa's rusticl 22.3 reads zeros there. */
static inline float16 sum16_of_16(const float16 *v)
{
    float16 t[8], u[4], w[2];
#pragma unroll
    for (uint j = 0; j < 8; j++) /* lanes i + (i + 8): two vectors a result */
        t[j] = (float16)(v[2 * j].lo, v[2 * j + 1].lo) + (float16)(v[2 * j].hi, v[2 * j + 1].hi);
#pragma unroll
    for (uint j = 0; j < 4; j++) /* i + (i + 4): four vectors a result */
        u[j] = (float16)(t[2 * j].s0123, t[2 * j].s89ab, t[2 * j + 1].s0123, t[2 * j + 1].s89ab) +
               (float16)(t[2 * j].s4567, t[2 * j].scdef, t[2 * j + 1].s4567, t[2 * j + 1].scdef);
#pragma unroll
    for (uint j = 0; j < 2; j++) /* (0 + 1), (2 + 3): eight vectors a result */
        w[j] = (float16)(u[2 * j].even, u[2 * j + 1].even) + (float16)(u[2 * j].odd, u[2 * j + 1].odd);
    return (float16)(w[0].even, w[1].even) + (float16)(w[0].odd, w[1].odd);
}
#endif

/* The dot products of MB tokens (rows tok[0..MB)) with RN experts from e0
 * over the hidden indices [c0, c1), added to dots[m][e0 - eb + n] (set
 * where c0 is 0); expert columns past the block are left alone. */
static inline void dot_block(__global const in_t *hidden, __global const in_t *ground, const uint *tok, uint e0,
                             uint eb, uint c0, uint c1, float (*dots)[EB])
{
    __global const in_t *h_row[MB];
    __global const in_t *w_row[RN];
#pragma unroll
    for (uint m = 0; m < MB; m++)
        h_row[m] = hidden + (size_t)tok[m] * HIDDEN_DIM;
#pragma unroll
    for (uint n = 0; n < RN; n++)
        w_row[n] = ground + (size_t)min(e0 + n, (uint)(NUM_EXPERTS - 1)) * HIDDEN_DIM;
    /* acc[m * RN + n]: token m, expert e0 + n (one array, for sum16_of_16). */
    float16 acc[MB * RN];
#pragma unroll
    for (uint m = 0; m < MB; m++)
#pragma unroll
        for (uint n = 0; n < RN; n++)
            acc[m * RN + n] = (float16)(0.0f);
    for (uint i = c0; i < c1; i += 16) {
        float16 w[RN];
#pragma unroll
        for (uint n = 0; n < RN; n++)
            w[n] = load_hidden16(w_row[n], i);
#pragma unroll
        for (uint m = 0; m < MB; m++) {
            const float16 h = load_hidden16(h_row[m], i);
#pragma unroll
            for (uint n = 0; n < RN; n++)
                acc[m * RN + n] = fma(h, w[n], acc[m * RN + n]);
        }
    }
#if MB * RN == 16
    float sums[16];
    vstore16(sum16_of_16(acc), 0, sums);
#define SUM_OF(m, n) sums[(m) * RN + (n)]
#else
#define SUM_OF(m, n) sum16(acc[(m) * RN + (n)])
#endif
#pragma unroll
    for (uint m = 0; m < MB; m++)
#pragma unroll
        for (uint n = 0; n < RN; n++)
            if (e0 + n < eb + EB)
                dots[m][e0 + n - eb] = (c0 == 0 ? 0.0f : dots[m][e0 + n - eb]) + SUM_OF(m, n);
#undef SUM_OF
}

__kernel void grounded_router_rows(__global const in_t *hidden, ulong hidden_off, __global const float *logits,
                                   ulong logits_off, __global const in_t *ground, ulong ground_off, OUTPUT_PARAMS)
{
    const uint t0 = (uint)get_global_id(0) * TM;
    if (t0 >= num_tokens)
        return;
    OFFSET_OUTPUTS();
    ROUTE_EXTRAS(extras);
    uint tok[TM];
    for (uint m = 0; m < TM; m++)
        tok[m] = min(t0 + m, num_tokens - 1);

    /* Each token's row of g, for the gating pipeline after the GEMM
     * (cl/gating.cl, rows_pipeline); padding lanes 0. Where one block of
     * dots is the whole row, g replaces the dot products in place
     * (cl/layout.h, LAYOUT_GROUNDED_G_IN_DOTS). */
#if LAYOUT_GROUNDED_G_IN_DOTS(NUM_EXPERTS)
#define GROW dots
#else
#define GROW grow
    float grow[TM][BLOCKS * BLOCK];
    for (uint m = 0; m < TM; m++)
        for (uint e = NUM_EXPERTS; e < BLOCKS * BLOCK; e++)
            grow[m][e] = 0.0f;
#endif
    /* Experts in blocks of EB, the hidden dimension in chunks of HC, so that
     * a register block's MB hidden chunks (32 KiB) stay in L1 while the
     * block's ground rows stream by, and the chunk of ground rows (EB x HC,
     * 512 KiB for 128 experts) stays in L2 for the TM tokens; the dot
     * products of a block wait in dots[][]. Register blocks wholly past the
     * last token are skipped (a small batch costs MB tokens, not TM); their
     * dots hold zeros. */
    float dots[TM][EB];
    const uint used = (min(num_tokens - t0, (uint)TM) + MB - 1) / MB * MB;
    for (uint m = used; m < TM; m++)
        for (uint e = 0; e < EB; e++)
            dots[m][e] = 0.0f;
    for (uint eb = 0; eb < NUM_EXPERTS; eb += EB) {
        for (uint c0 = 0; c0 < H16; c0 += HC) {
            const uint c1 = min(c0 + HC, (uint)H16);
            for (uint m0 = 0; m0 < used; m0 += MB)
                for (uint e0 = eb; e0 < min(eb + EB, (uint)NUM_EXPERTS); e0 += RN)
                    dot_block(hidden, ground, tok + m0, e0, eb, c0, c1, dots + m0);
        }
        for (uint m = 0; m < TM; m++) {
            for (uint e = eb; e < min(eb + EB, (uint)NUM_EXPERTS); e++) {
                float dot = H16 > 0 ? dots[m][e - eb] : 0.0f;
                for (uint i = H16; i < HIDDEN_DIM; i++)
                    dot = fma(LOAD_IN(hidden, (size_t)tok[m] * HIDDEN_DIM + i),
                              LOAD_IN(ground, (size_t)e * HIDDEN_DIM + i), dot);
                GROW[m][e] = G_OF(LOGIT_AT(tok[m], e), dot);
            }
        }
    }
    for (uint m = 0; m < TM && t0 + m < num_tokens; m++) {
        float8 logit[BLOCKS];
        for (uint b = 0; b < BLOCKS; b++)
            logit[b] = vload8(b, GROW[m]);
        float w[TOPK];
        uint id[TOPK];
        rows_pipeline(logit, bias, scaling_factor, w, id);
        for (uint j = 0; j < TOPK; j++)
            write_output(j, id[j], w[j], t0 + m, pairs, weights, ids, &extras);
        if (SHARED)
            write_shared(0, 1, t0 + m, hidden, scaling_factor, pairs, weights, ids, &extras);
    }
#undef GROW
}

#elif KERNEL == 1
/* ---------------------------------------------------------------------- */
/* A team of TEAM work-items per token, ROWS tokens per work-group.        */
/* ---------------------------------------------------------------------- */

#define GROUND_STRIDE LAYOUT_GROUND_STRIDE(TEAM, EPT)

__kernel __attribute__((reqd_work_group_size(TEAM * ROWS, 1, 1))) void
grounded_router_team(__global const in_t *hidden, ulong hidden_off, __global const float *logits, ulong logits_off,
                     __global const in_t *ground, ulong ground_off, OUTPUT_PARAMS DISPATCH_PARAMS)
{
    DISPATCH_LOCALS;
    /* ground_local[i][e]: k-major, so the lanes of a team read consecutive
     * experts of one hidden index; columns past NUM_EXPERTS hold zeros. */
    __local float ground_local[HIDDEN_DIM * GROUND_STRIDE];
    __local float hidden_local[ROWS * HIDDEN_DIM];
    TEAM_GATING_LOCALS;
    const uint lid = get_local_id(0);
    const uint lane = lid % TEAM;
    const uint r = lid / TEAM;
    const uint row0 = get_group_id(0) * ROWS;
    const uint row = row0 + r;
    const bool active = row < num_tokens;
    OFFSET_OUTPUTS();
    ROUTE_EXTRAS(extras);

    for (uint idx = lid; idx < HIDDEN_DIM * EPT * TEAM; idx += TEAM * ROWS) {
        const uint e = idx / HIDDEN_DIM, i = idx % HIDDEN_DIM;
        ground_local[i * GROUND_STRIDE + e] = e < NUM_EXPERTS ? LOAD_IN(ground, (size_t)e * HIDDEN_DIM + i) : 0.0f;
    }
    for (uint idx = lid; idx < ROWS * HIDDEN_DIM; idx += TEAM * ROWS) {
        const uint m = idx / HIDDEN_DIM, i = idx % HIDDEN_DIM;
        hidden_local[idx] = row0 + m < num_tokens ? LOAD_IN(hidden, (size_t)(row0 + m) * HIDDEN_DIM + i) : 0.0f;
    }
    /* The row's logits, loaded while the tables above are in flight. */
    float logit[EPT];
    UNROLL
    for (uint j = 0; j < EPT; j++) {
        const uint e = j * TEAM + lane;
        logit[j] = (active && e < NUM_EXPERTS) ? LOGIT_AT(row, e) : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    /* Four partial sums per expert (hidden index mod 4), so that four
     * independent multiply-add chains hide the local-memory latency. */
    float acc[EPT][4];
    UNROLL
    for (uint j = 0; j < EPT; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (uint i = 0; i < HIDDEN_DIM / 4 * 4; i += 4) {
        const float4 h = vload4(0, hidden_local + r * HIDDEN_DIM + i);
        UNROLL
        for (uint j = 0; j < EPT; j++) {
            const uint col = j * TEAM + lane;
            acc[j][0] = fma(h.s0, ground_local[(i + 0) * GROUND_STRIDE + col], acc[j][0]);
            acc[j][1] = fma(h.s1, ground_local[(i + 1) * GROUND_STRIDE + col], acc[j][1]);
            acc[j][2] = fma(h.s2, ground_local[(i + 2) * GROUND_STRIDE + col], acc[j][2]);
            acc[j][3] = fma(h.s3, ground_local[(i + 3) * GROUND_STRIDE + col], acc[j][3]);
        }
    }
    for (uint i = HIDDEN_DIM / 4 * 4; i < HIDDEN_DIM; i++) {
        const float h = hidden_local[r * HIDDEN_DIM + i];
        UNROLL
        for (uint j = 0; j < EPT; j++)
            acc[j][0] = fma(h, ground_local[i * GROUND_STRIDE + j * TEAM + lane], acc[j][0]);
    }
    /* g is the pipeline's row of logits (cl/gating.cl, TEAM_GATING). */
    float g[EPT];
    UNROLL
    for (uint j = 0; j < EPT; j++) {
        const uint e = j * TEAM + lane;
        g[j] = (active && e < NUM_EXPERTS) ? G_OF(logit[j], (acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3])) : 0.0f;
    }
    float w[TOPK];
    TEAM_GATING(g, active, lane, r, bias, scaling_factor, w);
    if (active) {
        for (uint j = lane; j < TOPK; j += TEAM)
            write_output(j, GATE_IDS(r)[j], w[j], row, pairs, weights, ids, &extras);
        if (SHARED)
            write_shared(lane, TEAM, row, hidden, scaling_factor, pairs, weights, ids, &extras);
    }
    DISPATCH_AFTER_ROWS(ids, num_tokens);
}

#elif KERNEL == 2
/* ---------------------------------------------------------------------- */
/* Tiled: TM tokens x TN experts per step, hidden streamed by TK (GPUs).    */
/* ---------------------------------------------------------------------- */

/* The GEMM tile, one parameterised source whose parameters moecl-tune
 * sweeps per device (src/grounded_router.c keeps the table):
 *   MT x NT   a work-item's register block: rows row_group + i * ROW_GROUPS,
 *             columns col_group + j * COL_GROUPS, so that neighbouring
 *             work-items read neighbouring experts of local memory;
 *   VEC       1, 2 or 4: the width of the global loads and of the local
 *             reads (the tiles are k-contiguous, one token's or one
 *             expert's TK values a row, so a vector is VEC hidden indices);
 *   DB        1: double buffered, the next k-step loaded from global memory
 *             into registers while the current one is multiplied from
 *             local memory, two local stages and one barrier a step;
 *             0: one stage, load, barrier, multiply, barrier.
 *   WC        work-items side by side along the experts (a divisor of
 *             TN / NT, which is the default): the work-group is cut into
 *             panels WC block columns wide, consecutive work-items going
 *             across a panel, then down it. A warp of 32 then reads
 *             32 / WC tokens' vectors and WC experts' a local read, not one
 *             token's and 32 experts': with WC 8 and float4 reads both fit
 *             one 128-byte local-memory transaction instead of one and four.
 * Each dot product is still one fma chain in ascending hidden order, so
 * every configuration gives the same bits. */
#ifndef MT
#define MT 4 /* rows of a work-item's register block */
#endif
#ifndef NT
#define NT 4 /* columns of a work-item's register block */
#endif
#ifndef VEC
#define VEC 1
#endif
#ifndef DB
#define DB 0
#endif
#ifndef WC
#define WC (TN / NT)
#endif
#ifndef TILE_PTR_READS
#define TILE_PTR_READS 1 /* multiply_step */
#endif
#if TM % MT || TN % NT || TK % VEC || (VEC != 1 && VEC != 2 && VEC != 4) || (TN / NT) % WC
#error "tiled kernel: MT must divide TM, NT divide TN, VEC (1, 2 or 4) divide TK, WC divide TN / NT"
#endif
#define ROW_GROUPS (TM / MT)
#define COL_GROUPS (TN / NT)
#define WG_SIZE (ROW_GROUPS * COL_GROUPS)
#define EXPERT_TILES ((NUM_EXPERTS + TN - 1) / TN)
#define K_STEPS ((HIDDEN_DIM + TK - 1) / TK)
#define ROW_VECS (LAYOUT_TILE_ROW(TK, VEC) / VEC) /* a tile row in vectors, padding included */
#define STEP_VECS (LAYOUT_TILE_STAGE(TM, TN, TK, VEC) / VEC)
#define HIDDEN_LOADS ((TM * (TK / VEC) + WG_SIZE - 1) / WG_SIZE) /* vectors a work-item loads a step */
#define GROUND_LOADS ((TN * (TK / VEC) + WG_SIZE - 1) / WG_SIZE)

#if VEC == 4
typedef float4 vec_t;
#define VLOAD vload4
#define DOT_FMA(a, b, c) fma((a).s3, (b).s3, fma((a).s2, (b).s2, fma((a).s1, (b).s1, fma((a).s0, (b).s0, c))))
#elif VEC == 2
typedef float2 vec_t;
#define VLOAD vload2
#define DOT_FMA(a, b, c) fma((a).s1, (b).s1, fma((a).s0, (b).s0, c))
#else
typedef float vec_t;
#define VLOAD(o, p) (*(p))
#define DOT_FMA(a, b, c) fma(a, b, c)
#endif

/* VEC hidden values of row `row` from index k, zeros past HIDDEN_DIM. f32
 * rows whose offset and length are multiples of VEC take one aligned
 * vector load (vloadn promises only element alignment, and some compilers
 * then split it); the rest go element by element. Where TK divides
 * HIDDEN_DIM every step is whole, and the bound needs no test (under the
 * pointer reads of multiply_step, TILE_PTR_READS). */
static inline vec_t load_vec(__global const in_t *p, size_t row, uint k, bool aligned)
{
    __global const in_t *at = p + row * HIDDEN_DIM + k;
#if IN_DTYPE == 0
    if (HIDDEN_DIM % VEC == 0 && ((TILE_PTR_READS && HIDDEN_DIM % TK == 0) || k + VEC <= HIDDEN_DIM))
        return aligned ? *(__global const vec_t *)at : VLOAD(0, at);
#endif
    float v[VEC];
    UNROLL
    for (uint i = 0; i < VEC; i++)
        v[i] = k + i < HIDDEN_DIM ? LOAD_IN(at, i) : 0.0f;
#if VEC == 4
    return (float4)(v[0], v[1], v[2], v[3]);
#elif VEC == 2
    return (float2)(v[0], v[1]);
#else
    return v[0];
#endif
}

/* One k-step of both tiles from global memory into registers: vector idx
 * of a tile is row idx / (TK / VEC), hidden index k0 + its rest times VEC;
 * consecutive work-items take consecutive vectors of a row (contiguous in
 * memory). Rows past the tokens or the experts repeat the last one (their
 * sums are never written). */
static inline void load_step(__global const in_t *hidden, __global const in_t *ground, uint row0, uint expert0,
                             uint num_tokens, uint k0, uint lid, bool aligned, vec_t *h, vec_t *w)
{
    UNROLL
    for (uint l = 0; l < HIDDEN_LOADS; l++) {
        const uint idx = lid + l * WG_SIZE;
        const uint m = idx / (TK / VEC), kv = idx % (TK / VEC);
        if (idx < TM * (TK / VEC))
            h[l] = load_vec(hidden, min(row0 + m, num_tokens - 1), k0 + kv * VEC, aligned);
    }
    UNROLL
    for (uint l = 0; l < GROUND_LOADS; l++) {
        const uint idx = lid + l * WG_SIZE;
        const uint n = idx / (TK / VEC), kv = idx % (TK / VEC);
        if (idx < TN * (TK / VEC))
            w[l] = load_vec(ground, min(expert0 + n, (uint)NUM_EXPERTS - 1), k0 + kv * VEC, aligned);
    }
}

/* The registers of load_step into one local stage: tokens' rows first,
 * then the experts'. */
static inline void store_step(__local vec_t *stage, uint lid, const vec_t *h, const vec_t *w)
{
    UNROLL
    for (uint l = 0; l < HIDDEN_LOADS; l++) {
        const uint idx = lid + l * WG_SIZE;
        if (idx < TM * (TK / VEC))
            stage[idx / (TK / VEC) * ROW_VECS + idx % (TK / VEC)] = h[l];
    }
    UNROLL
    for (uint l = 0; l < GROUND_LOADS; l++) {
        const uint idx = lid + l * WG_SIZE;
        if (idx < TN * (TK / VEC))
            stage[(TM + idx / (TK / VEC)) * ROW_VECS + idx % (TK / VEC)] = w[l];
    }
}

/* The register block's products over one local stage. TILE_PTR_READS 1
 * (the default; 0 keeps the index form, MOECL_BUILD_OPTIONS=-DTILE_PTR_READS=0)
 * reads each vector as the block's first token or expert row plus a
 * constant, which a compiler can fold into the load's offset; an index
 * computed in uint and then widened cannot be folded (NVIDIA's PTX spends
 * an add, a multiply and a 64-bit add on each read). Same addresses, same
 * bits. */
static inline void multiply_step(__local const vec_t *stage, uint row_group, uint col_group, float acc[MT][NT])
{
#if TILE_PTR_READS
    __local const vec_t *a_row = stage + row_group * ROW_VECS, *b_row = stage + (TM + col_group) * ROW_VECS;
#define TILE_A(i, kv) a_row[(i) * ROW_GROUPS * ROW_VECS + (kv)]
#define TILE_B(j, kv) b_row[(j) * COL_GROUPS * ROW_VECS + (kv)]
#else
#define TILE_A(i, kv) stage[(row_group + (i) * ROW_GROUPS) * ROW_VECS + (kv)]
#define TILE_B(j, kv) stage[(TM + col_group + (j) * COL_GROUPS) * ROW_VECS + (kv)]
#endif
    UNROLL
    for (uint kv = 0; kv < TK / VEC; kv++) {
        vec_t b[NT];
        UNROLL
        for (uint j = 0; j < NT; j++)
            b[j] = TILE_B(j, kv);
        UNROLL
        for (uint i = 0; i < MT; i++) {
            const vec_t a = TILE_A(i, kv);
            UNROLL
            for (uint j = 0; j < NT; j++)
                acc[i][j] = DOT_FMA(a, b[j], acc[i][j]);
        }
    }
}
#undef TILE_A
#undef TILE_B

__kernel __attribute__((reqd_work_group_size(WG_SIZE, 1, 1))) void
grounded_router_tiled(__global const in_t *hidden, ulong hidden_off, __global const float *logits, ulong logits_off,
                      __global const in_t *ground, ulong ground_off, OUTPUT_PARAMS)
{
    /* The input stages (layout.h: k-contiguous rows padded by VEC floats,
     * which keeps neighbouring experts' vectors in different banks). The
     * tile of g is only live between the hidden loop and the merge, when
     * the stages are not, so they share one array. */
    __local vec_t tile_memory[LAYOUT_TILE_FLOATS(TM, TN, TK, VEC, DB) / VEC];
    __local ulong top_keys[LAYOUT_TILE_KEYS(TM, TOPK)];
#define G_AT(m, n) ((__local float *)tile_memory)[(m) * (TN + 1) + (n)]

    const uint lid = get_local_id(0);
    /* One panel: the plain form, to which NVIDIA's compiler gives fewer
     * registers than the general one (128 against 156 for the 8 x 4 tile,
     * 565 against 640 us on the H200). */
#if WC == COL_GROUPS
    const uint col_group = lid % COL_GROUPS, row_group = lid / COL_GROUPS;
#else
    const uint col_group = lid / (WC * ROW_GROUPS) * WC + lid % WC;
    const uint row_group = lid / WC % ROW_GROUPS;
#endif
    const uint row0 = get_group_id(0) * TM;
    /* Whole vectors at vector-aligned addresses (buffers are aligned far
     * beyond 16 bytes): aligned loads are safe. */
    const bool aligned = ((hidden_off | ground_off) % VEC) == 0;
    OFFSET_OUTPUTS();
    ROUTE_EXTRAS(extras);

    for (uint i = lid; i < TM * TOPK; i += WG_SIZE)
        top_keys[i] = KEY_NONE;

    for (uint tile = 0; tile < EXPERT_TILES; tile++) {
        const uint expert0 = tile * TN;
        float acc[MT][NT];
        UNROLL
        for (uint i = 0; i < MT; i++)
            UNROLL
            for (uint j = 0; j < NT; j++)
                acc[i][j] = 0.0f;

        vec_t h[HIDDEN_LOADS], w[GROUND_LOADS];
#if DB
        load_step(hidden, ground, row0, expert0, num_tokens, 0, lid, aligned, h, w);
        store_step(tile_memory, lid, h, w);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint s = 0; s < K_STEPS; s++) {
            __local vec_t *current = tile_memory + (s % 2) * STEP_VECS;
            if (s + 1 < K_STEPS)
                load_step(hidden, ground, row0, expert0, num_tokens, (s + 1) * TK, lid, aligned, h, w);
            multiply_step(current, row_group, col_group, acc);
            /* The other stage was last read in step s - 1, before the
             * barrier that ended it. */
            if (s + 1 < K_STEPS)
                store_step(tile_memory + ((s + 1) % 2) * STEP_VECS, lid, h, w);
            barrier(CLK_LOCAL_MEM_FENCE);
        }
#else
        for (uint s = 0; s < K_STEPS; s++) {
            load_step(hidden, ground, row0, expert0, num_tokens, s * TK, lid, aligned, h, w);
            store_step(tile_memory, lid, h, w);
            barrier(CLK_LOCAL_MEM_FENCE);
            multiply_step(tile_memory, row_group, col_group, acc);
            barrier(CLK_LOCAL_MEM_FENCE);
        }
#endif

        /* g for this tile into local memory. */
        UNROLL
        for (uint i = 0; i < MT; i++) {
            const uint m = row_group + i * ROW_GROUPS, t = row0 + m;
            UNROLL
            for (uint j = 0; j < NT; j++) {
                const uint n = col_group + j * COL_GROUPS, e = expert0 + n;
                if (t < num_tokens && e < NUM_EXPERTS)
                    G_AT(m, n) = G_OF(LOGIT_AT(t, e), acc[i][j]);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* Merge the tile into each token's top-k, one work-item per token. */
        if (lid < TM && row0 + lid < num_tokens) {
            __local ulong *keys = top_keys + lid * TOPK;
            const uint width = min((uint)TN, (uint)(NUM_EXPERTS - expert0));
            for (uint n = 0; n < width; n++) {
                const ulong key = rank_key(G_AT(lid, n), expert0 + n);
                if (key > keys[TOPK - 1]) {
                    int j = TOPK - 1;
                    while (j > 0 && keys[j - 1] < key) {
                        keys[j] = keys[j - 1];
                        j--;
                    }
                    keys[j] = key;
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    if (lid < TM && row0 + lid < num_tokens) {
        /* Steps 4-5 of the pipeline from the merged keys (MERGEABLE: the
         * selection was on g, which comes back from the keys). */
        ulong keys[TOPK];
        float w[TOPK];
        uint id[TOPK];
        for (uint j = 0; j < TOPK; j++) {
            keys[j] = top_keys[lid * TOPK + j];
            w[j] = float_of_rank((uint)(keys[j] >> 32));
        }
        rows_final(keys, w, scaling_factor, id);
        for (uint j = 0; j < TOPK; j++)
            write_output(j, id[j], w[j], row0 + lid, pairs, weights, ids, &extras);
        if (SHARED)
            write_shared(0, 1, row0 + lid, hidden, scaling_factor, pairs, weights, ids, &extras);
    }
}

#elif KERNEL == 4
/* ---------------------------------------------------------------------- */
/* Split-K: TM tokens x TN experts x TK hidden indices a work-group (few    */
/* tokens, GPUs).                                                           */
/* ---------------------------------------------------------------------- */

/* The grid is (blocks of TM tokens) x (tiles of TN experts) x (chunks of TK
 * hidden indices), one work-group each, so that at a decode batch the
 * ground table is read once by many work-groups, each a short walk, not by
 * one work-group per token block walking all of it. A work-group stages its
 * tokens' chunk of hidden values in local memory, then takes its tile's
 * expert rows SPLIT_ROWS at a time: 32 lanes along the hidden index per
 * row, each lane SPLIT_VEC consecutive values a step (a warp reads one
 * row's 32 x SPLIT_VEC contiguous values), every lane an fma chain per
 * token; the lanes' sums are added in lane order and the chunk's dot
 * product goes to the scratch buffer. A ticket per token block elects the
 * block's last work-group, which adds each dot product's chunks in chunk
 * order (0, 1, 2, ...) and gates its tokens, SPLIT_LANES work-items a token
 * (TEAM; TEAM 1: a work-item a token). Every sum's order is fixed by
 * the code, never by timing: repeated calls give the same bits. */
#ifndef SPLIT_WG
#define SPLIT_WG 256
#endif
#define SPLIT_LANES LAYOUT_SPLITK_LANES(SPLIT_WG)
#define SPLIT_ROWS LAYOUT_SPLITK_ROWS(SPLIT_WG)
#define SPLIT_VEC 4
#define K_CHUNKS ((HIDDEN_DIM + TK - 1) / TK)
#define EXPERT_TILES ((NUM_EXPERTS + TN - 1) / TN)
#define BLOCK_GROUPS (EXPERT_TILES * K_CHUNKS) /* work-groups of a token block */
#define G_STRIDE (LAYOUT_ROWS_BLOCKS(NUM_EXPERTS) * LAYOUT_ROWS_BLOCK) /* a row of g, padded to blocks of 8 */
#define SUM_STRIDE (SPLIT_LANES + 1)
#if TK % SPLIT_VEC || TN % SPLIT_ROWS || SPLIT_WG % SPLIT_LANES
#error "split-K kernel: SPLIT_VEC must divide TK, SPLIT_ROWS divide TN"
#endif
#if TEAM > 1 && (TEAM != SPLIT_LANES || ROWS != SPLIT_ROWS || ROWS < TM)
#error "split-K kernel: the gating's teams are the lanes of a row (TEAM SPLIT_LANES, ROWS SPLIT_ROWS >= TM)"
#endif

/* A word one work-group writes and another reads: atomics, the only global
 * accesses OpenCL 1.2 makes coherent between work-groups (cl/moe_align.cl,
 * moe_align_fused, explains the pattern). */
static inline void part_store(__global uint *p, float v) { atomic_xchg((volatile __global uint *)p, as_uint(v)); }
static inline float part_load(__global uint *p) { return as_float(atomic_or((volatile __global uint *)p, 0u)); }

/* Step 1: the block's chunk of hidden values, h_tile[m][i] = hidden[row0 +
 * m][k0 + i] widened, zeros past the tokens and the hidden dimension. */
static inline void stage_hidden(__global const in_t *hidden, uint row0, uint num_tokens, uint k0, uint lid,
                                __local float *h_tile)
{
    for (uint idx = lid; idx < TM * TK; idx += SPLIT_WG) {
        const uint m = idx / TK, i = idx % TK;
        h_tile[idx] = row0 + m < num_tokens && k0 + i < HIDDEN_DIM
                          ? LOAD_IN(hidden, (size_t)(row0 + m) * HIDDEN_DIM + k0 + i)
                          : 0.0f;
    }
}

/* SPLIT_VEC values of a ground row from hidden index k, zeros past it. */
static inline float4 load_ground4(__global const in_t *row, uint k)
{
    float v[SPLIT_VEC];
    UNROLL
    for (uint q = 0; q < SPLIT_VEC; q++)
        v[q] = k + q < HIDDEN_DIM ? LOAD_IN(row, k + q) : 0.0f;
    return vload4(0, v);
}

/* Step 2: one lane's sums over the chunk for expert row e: acc[m] =
 * fma chain over hidden indices k0 + (lane + j SPLIT_LANES) SPLIT_VEC + q,
 * ascending. */
static inline void lane_dots(__global const in_t *ground, __local const float *h_tile, uint e, uint k0, uint lane,
                             float *acc)
{
    __global const in_t *row = ground + (size_t)e * HIDDEN_DIM;
    for (uint m = 0; m < TM; m++)
        acc[m] = 0.0f;
    for (uint v = lane; v < TK / SPLIT_VEC; v += SPLIT_LANES) {
        const uint i = v * SPLIT_VEC;
        if (k0 + i >= HIDDEN_DIM)
            break;
        const float4 w = load_ground4(row, k0 + i);
        UNROLL
        for (uint m = 0; m < TM; m++) {
            const float4 h = vload4(0, h_tile + m * TK + i);
            acc[m] = fma(h.s3, w.s3, fma(h.s2, w.s2, fma(h.s1, w.s1, fma(h.s0, w.s0, acc[m]))));
        }
    }
}

/* Step 3: the lanes' sums of SPLIT_ROWS expert rows from e0 added in lane
 * order, each token's chunk dot product stored at part[chunk][token][e]
 * (experts and tokens that exist). */
static inline void store_chunk_dots(const float *acc, uint lid, uint e0, uint row0, uint num_tokens,
                                    __local float *sums, __global uint *part)
{
    const uint lane = lid % SPLIT_LANES, r = lid / SPLIT_LANES;
    for (uint m = 0; m < TM; m++)
        sums[(r * TM + m) * SUM_STRIDE + lane] = acc[m];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < SPLIT_ROWS * TM) {
        const uint m = lid % TM, e = e0 + lid / TM, t = row0 + m;
        float s = 0.0f;
        for (uint l = 0; l < SPLIT_LANES; l++)
            s += sums[lid * SUM_STRIDE + l];
        if (e < NUM_EXPERTS && t < num_tokens)
            part_store(part + (size_t)t * NUM_EXPERTS + e, s);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* Step 4: whether this work-group is its token block's last; the last puts
 * the ticket back to 0 for the next call (every other work-group of the
 * block has taken its ticket by then). No work-group waits for another. */
static inline bool last_of_block(volatile __global uint *ticket, uint lid, __local uint *flag)
{
    mem_fence(CLK_GLOBAL_MEM_FENCE); /* this work-item's dot products before the ticket */
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    if (lid == 0) {
        const uint taken = atomic_inc(ticket);
        *flag = taken == BLOCK_GROUPS - 1;
        if (taken == BLOCK_GROUPS - 1)
            atomic_xchg(ticket, 0u);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const bool last = *flag;
    mem_fence(CLK_GLOBAL_MEM_FENCE); /* the ticket before the reads of the others' dot products */
    return last;
}

/* Step 5: the block's rows of g, g_rows[m][e] = G_OF(logit, the chunks'
 * dot products added in chunk order); padding lanes and rows 0. */
static inline void gather_g(__global uint *parts, __global const float *logits, uint row0, uint num_tokens,
                            float alpha, uint lid, __local float *g_rows)
{
    for (uint idx = lid; idx < TM * G_STRIDE; idx += SPLIT_WG) {
        const uint m = idx / G_STRIDE, e = idx % G_STRIDE, t = row0 + m;
        float g = 0.0f;
        if (t < num_tokens && e < NUM_EXPERTS) {
            float dot = 0.0f;
            for (uint c = 0; c < K_CHUNKS; c++)
                dot += part_load(parts + ((size_t)c * num_tokens + t) * NUM_EXPERTS + e);
            g = G_OF(LOGIT_AT(t, e), dot);
        }
        g_rows[idx] = g;
    }
}

#if TEAM > 1
/* Step 6 with teams: the block's rows of g (row m at g_rows + m * G_STRIDE)
 * gated by cl/gating.cl's team pipeline, a row of SPLIT_LANES work-items a
 * token, so that a warp ranks a token's experts, not one work-item alone.
 * A macro: TEAM_GATING reads the kernel's local arrays. Every work-item
 * runs it (barriers). */
#define gate_team_rows(g_rows, row0, num_tokens, lid, hidden, bias, scaling_factor, pairs, weights, ids, extras) \
    do {                                                                                           \
        const uint lane_ = (lid) % TEAM, r_ = (lid) / TEAM;                                        \
        const bool active_ = r_ < TM && (row0) + r_ < (num_tokens);                                \
        float g_[EPT];                                                                             \
        UNROLL                                                                                     \
        for (uint j_ = 0; j_ < EPT; j_++) {                                                        \
            const uint e_ = j_ * TEAM + lane_;                                                     \
            g_[j_] = active_ && e_ < NUM_EXPERTS ? (g_rows)[r_ * G_STRIDE + e_] : 0.0f;            \
        }                                                                                          \
        float w_[TOPK];                                                                            \
        TEAM_GATING(g_, active_, lane_, r_, bias, scaling_factor, w_);                             \
        if (active_) {                                                                             \
            for (uint j_ = lane_; j_ < TOPK; j_ += TEAM)                                           \
                write_output(j_, GATE_IDS(r_)[j_], w_[j_], (row0) + r_, pairs, weights, ids, extras); \
            if (SHARED)                                                                            \
                write_shared(lane_, TEAM, (row0) + r_, hidden, scaling_factor, pairs, weights, ids, extras); \
        }                                                                                          \
    } while (0)
#endif

/* scratch: a ticket per token block (0 before the call; 0 again after it),
 * then from word LAYOUT_SPLITK_PARTS_AT(blocks) part[K_CHUNKS][num_tokens]
 * [NUM_EXPERTS]. */
__kernel __attribute__((reqd_work_group_size(SPLIT_WG, 1, 1))) void
grounded_router_splitk(__global const in_t *hidden, ulong hidden_off, __global const float *logits,
                       ulong logits_off, __global const in_t *ground, ulong ground_off, OUTPUT_PARAMS,
                       __global uint *scratch)
{
    /* The hidden chunk and the lanes' sums, then the block's rows of g. */
    __local float tile_memory[LAYOUT_SPLITK_FLOATS(TM, TK, SPLIT_WG, NUM_EXPERTS)];
    __local uint last_flag;
#if TEAM > 1
    TEAM_GATING_LOCALS;
#endif
    __local float *h_tile = tile_memory, *sums = tile_memory + TM * TK;
    const uint lid = get_local_id(0), group = get_group_id(0);
    const uint chunk = group % K_CHUNKS, tile = group / K_CHUNKS % EXPERT_TILES, block = group / BLOCK_GROUPS;
    const uint row0 = block * TM, k0 = chunk * TK;
    const uint blocks = (num_tokens + TM - 1) / TM;
    __global uint *parts = scratch + LAYOUT_SPLITK_PARTS_AT(blocks);
    OFFSET_OUTPUTS();
    ROUTE_EXTRAS(extras);

    stage_hidden(hidden, row0, num_tokens, k0, lid, h_tile);
    barrier(CLK_LOCAL_MEM_FENCE);
    __global uint *chunk_part = parts + (size_t)chunk * num_tokens * NUM_EXPERTS;
    for (uint e0 = tile * TN; e0 < min((uint)(tile + 1) * TN, (uint)NUM_EXPERTS); e0 += SPLIT_ROWS) {
        float acc[TM];
        const uint e = min(e0 + lid / SPLIT_LANES, (uint)NUM_EXPERTS - 1);
        lane_dots(ground, h_tile, e, k0, lid % SPLIT_LANES, acc);
        store_chunk_dots(acc, lid, e0, row0, num_tokens, sums, chunk_part);
    }

    /* No return before the barrier: every work-item reaches it (pocl 3.1
     * ran the rows after it in the wrong work-items otherwise). */
    const bool last = last_of_block(scratch + block, lid, &last_flag);
    if (last)
        gather_g(parts, logits, row0, num_tokens, alpha, lid, tile_memory);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last)
        return;
    /* Step 6: the gating of the block's tokens. */
#if TEAM > 1
    gate_team_rows(tile_memory, row0, num_tokens, lid, hidden, bias, scaling_factor, pairs, weights, ids, &extras);
#else
    gate_local_rows(tile_memory, G_STRIDE, TM, row0, num_tokens, lid, hidden, bias, scaling_factor, pairs, weights,
                    ids, &extras);
#endif
}
#endif
