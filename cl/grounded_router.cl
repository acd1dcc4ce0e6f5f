/* Grounded router (docs/routing.md, section 2):
 *   g[e] = router_logits[e] + alpha * dot(token_hidden, expert_ground[e])
 * with fp32 accumulation, the TOPK largest g (descending, ties to the lower
 * index, NaN lowest), and a softmax over the chosen g values.
 * Specialised at build time:
 *   HIDDEN_DIM, NUM_EXPERTS, TOPK       the shape
 *   IN_DTYPE                            dtype of token_hidden and expert_ground
 *   HAS_PAIRS, HAS_WEIGHTS, HAS_IDS     which outputs to write
 *   KERNEL                              0 rows, 1 team, 2 tiled (below)
 *   TM, TN, TK                          tile of the tiled kernel (tokens,
 *                                       experts, hidden step)
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
 *    registers; the top-k of each token is merged tile by tile. */

#ifndef KERNEL
#define KERNEL 0
#endif

/* The float a rank_of_float value came from (-0 comes back as +0 and every
 * NaN as one NaN, neither of which changes a softmax). */
static inline float float_of_rank(uint r)
{
    if (r == 0u)
        return NAN;
    return (r & 0x80000000u) ? as_float(r & 0x7fffffffu) : as_float(~r);
}

/* Softmax over the chosen values g (max-subtracted: g[0] is the largest
 * number unless every chosen value is NaN) and the outputs. The sum runs in
 * index order, so every device gives the same bits. Private arrays. */
static inline void write_outputs(const uint *id, const float *g, uint row, __global float *pairs,
                                 __global float *weights, __global int *ids)
{
    float e[TOPK];
    float sum = 0.0f;
    for (uint j = 0; j < TOPK; j++) {
        e[j] = exp(g[j] - g[0]);
        sum += e[j];
    }
    for (uint j = 0; j < TOPK; j++) {
        const float w = e[j] / sum;
        const size_t at = (size_t)row * TOPK + j;
#if HAS_PAIRS
        pairs[2 * at] = (float)id[j];
        pairs[2 * at + 1] = w;
#endif
#if HAS_WEIGHTS
        weights[at] = w;
#endif
#if HAS_IDS
        ids[at] = (int)id[j];
#endif
    }
}

/* write_outputs from a descending list of rank keys. */
static inline void write_outputs_from_keys(const ulong *keys, uint row, __global float *pairs,
                                           __global float *weights, __global int *ids)
{
    uint id[TOPK];
    float g[TOPK];
    for (uint j = 0; j < TOPK; j++) {
        id[j] = key_index(keys[j]);
        g[j] = float_of_rank((uint)(keys[j] >> 32));
    }
    write_outputs(id, g, row, pairs, weights, ids);
}

#define OUTPUT_PARAMS                                                                              \
    __global float *pairs, ulong pairs_off, __global float *weights, ulong weights_off, __global int *ids, \
        ulong ids_off, uint num_tokens, float alpha

#define OFFSET_OUTPUTS()                                                                           \
    do {                                                                                           \
        hidden += hidden_off;                                                                      \
        logits += logits_off;                                                                      \
        ground += ground_off;                                                                      \
        if (HAS_PAIRS)                                                                             \
            pairs += pairs_off;                                                                    \
        if (HAS_WEIGHTS)                                                                           \
            weights += weights_off;                                                                \
        if (HAS_IDS)                                                                               \
            ids += ids_off;                                                                        \
    } while (0)

#if KERNEL == 0
/* ---------------------------------------------------------------------- */
/* TM tokens per work-item (CPU devices).                                  */
/* ---------------------------------------------------------------------- */

/* Register blocking: a work-item takes TM tokens and goes through the
 * experts RN at a time, keeping TM x RN dot products as float16 partial
 * sums (16 hidden indices per step, SIMD on CPUs). Each ground row read
 * serves TM tokens and each hidden vector RN experts, so the ground table
 * is streamed once per TM tokens, not once per token. Every token's dot
 * products are computed the same way whatever its place in the block, so
 * a row's result does not depend on the others: a block past the last
 * token repeats the last token and writes nothing for it, and the last
 * expert block repeats the last expert. */
#if !defined(TM) || TM < 1
#undef TM
#define TM 1
#endif
#define RN LAYOUT_GROUNDED_RN
#define H16 (HIDDEN_DIM / 16 * 16)
#define HC 1024 /* hidden chunk (a multiple of 16) */
#define EB LAYOUT_GROUNDED_EB(NUM_EXPERTS) /* expert block (a multiple of RN) */

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

__kernel void grounded_router_rows(__global const in_t *hidden, ulong hidden_off, __global const float *logits,
                                   ulong logits_off, __global const in_t *ground, ulong ground_off, OUTPUT_PARAMS)
{
    const uint t0 = (uint)get_global_id(0) * TM;
    if (t0 >= num_tokens)
        return;
    OFFSET_OUTPUTS();
    uint tok[TM];
    for (uint m = 0; m < TM; m++)
        tok[m] = min(t0 + m, num_tokens - 1);

    ulong keys[TM][TOPK];
    float unused[TOPK];
    for (uint m = 0; m < TM; m++)
        for (uint j = 0; j < TOPK; j++)
            keys[m][j] = KEY_NONE;
    /* Experts in blocks of EB, the hidden dimension in chunks of HC, so that
     * the TM hidden chunks (32 KiB) stay in L1 while the block's ground
     * rows stream by; the dot products of a block wait in dots[][]. */
    float dots[TM][EB];
    for (uint eb = 0; eb < NUM_EXPERTS; eb += EB) {
        for (uint c0 = 0; c0 < H16; c0 += HC) {
            const uint c1 = min(c0 + HC, (uint)H16);
            for (uint e0 = eb; e0 < min(eb + EB, (uint)NUM_EXPERTS); e0 += RN) {
                uint ex[RN];
                for (uint n = 0; n < RN; n++)
                    ex[n] = min(e0 + n, (uint)(NUM_EXPERTS - 1));
                float16 acc[TM][RN];
#pragma unroll
                for (uint m = 0; m < TM; m++)
#pragma unroll
                    for (uint n = 0; n < RN; n++)
                        acc[m][n] = (float16)(0.0f);
                for (uint i = c0; i < c1; i += 16) {
                    float16 w[RN];
#pragma unroll
                    for (uint n = 0; n < RN; n++)
                        w[n] = load_hidden16(ground + (size_t)ex[n] * HIDDEN_DIM, i);
#pragma unroll
                    for (uint m = 0; m < TM; m++) {
                        const float16 h = load_hidden16(hidden + (size_t)tok[m] * HIDDEN_DIM, i);
#pragma unroll
                        for (uint n = 0; n < RN; n++)
                            acc[m][n] = fma(h, w[n], acc[m][n]);
                    }
                }
#pragma unroll
                for (uint m = 0; m < TM; m++)
#pragma unroll
                    for (uint n = 0; n < RN; n++)
                        if (e0 + n < eb + EB)
                            dots[m][e0 + n - eb] = (c0 == 0 ? 0.0f : dots[m][e0 + n - eb]) + sum16(acc[m][n]);
            }
        }
        for (uint m = 0; m < TM; m++) {
            for (uint e = eb; e < min(eb + EB, (uint)NUM_EXPERTS); e++) {
                float dot = H16 > 0 ? dots[m][e - eb] : 0.0f;
                for (uint i = H16; i < HIDDEN_DIM; i++)
                    dot = fma(LOAD_IN(hidden, (size_t)tok[m] * HIDDEN_DIM + i),
                              LOAD_IN(ground, (size_t)e * HIDDEN_DIM + i), dot);
                const float g = logits[(size_t)tok[m] * NUM_EXPERTS + e] + alpha * dot;
                const ulong key = rank_key(g, e);
                TOPK_INSERT(keys[m], unused, TOPK, key, 0.0f);
            }
        }
    }
    for (uint m = 0; m < TM; m++)
        if (t0 + m < num_tokens)
            write_outputs_from_keys(keys[m], t0 + m, pairs, weights, ids);
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
    __local float chosen_g[ROWS * TOPK];
    __local uint chosen_ids[ROWS * TOPK];
    TEAM_TOPK_LOCALS;
    const uint lid = get_local_id(0);
    const uint lane = lid % TEAM;
    const uint r = lid / TEAM;
    const uint row0 = get_group_id(0) * ROWS;
    const uint row = row0 + r;
    const bool active = row < num_tokens;
    OFFSET_OUTPUTS();

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
        logit[j] = (active && e < NUM_EXPERTS) ? logits[(size_t)row * NUM_EXPERTS + e] : 0.0f;
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
    uint rank[EPT];
    float g[EPT];
    UNROLL
    for (uint j = 0; j < EPT; j++) {
        const uint e = j * TEAM + lane;
        g[j] = 0.0f;
        rank[j] = RANK_NONE;
        if (active && e < NUM_EXPERTS) {
            g[j] = logit[j] + alpha * ((acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]));
            rank[j] = select_rank(g[j]);
        }
    }
    team_topk(rank, g, TEAM_TOPK_SCRATCH(r), lane, chosen_ids + r * TOPK, chosen_g + r * TOPK);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (active && lane == 0) {
        uint id[TOPK];
        float chosen[TOPK];
        for (uint j = 0; j < TOPK; j++) {
            id[j] = chosen_ids[r * TOPK + j];
            chosen[j] = chosen_g[r * TOPK + j];
        }
        write_outputs(id, chosen, row, pairs, weights, ids);
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
#if TM % MT || TN % NT || TK % VEC || (VEC != 1 && VEC != 2 && VEC != 4)
#error "tiled kernel: MT must divide TM, NT divide TN, VEC (1, 2 or 4) divide TK"
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
 * then split it); the rest go element by element. */
static inline vec_t load_vec(__global const in_t *p, size_t row, uint k, bool aligned)
{
    __global const in_t *at = p + row * HIDDEN_DIM + k;
#if IN_DTYPE == 0
    if (HIDDEN_DIM % VEC == 0 && k + VEC <= HIDDEN_DIM)
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

/* The register block's products over one local stage. */
static inline void multiply_step(__local const vec_t *stage, uint row_group, uint col_group, float acc[MT][NT])
{
    UNROLL
    for (uint kv = 0; kv < TK / VEC; kv++) {
        vec_t b[NT];
        UNROLL
        for (uint j = 0; j < NT; j++)
            b[j] = stage[(TM + col_group + j * COL_GROUPS) * ROW_VECS + kv];
        UNROLL
        for (uint i = 0; i < MT; i++) {
            const vec_t a = stage[(row_group + i * ROW_GROUPS) * ROW_VECS + kv];
            UNROLL
            for (uint j = 0; j < NT; j++)
                acc[i][j] = DOT_FMA(a, b[j], acc[i][j]);
        }
    }
}

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
    const uint col_group = lid % COL_GROUPS;
    const uint row_group = lid / COL_GROUPS;
    const uint row0 = get_group_id(0) * TM;
    /* Whole vectors at vector-aligned addresses (buffers are aligned far
     * beyond 16 bytes): aligned loads are safe. */
    const bool aligned = ((hidden_off | ground_off) % VEC) == 0;
    OFFSET_OUTPUTS();

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
                    G_AT(m, n) = logits[(size_t)t * NUM_EXPERTS + e] + alpha * acc[i][j];
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
        ulong keys[TOPK];
        for (uint j = 0; j < TOPK; j++)
            keys[j] = top_keys[lid * TOPK + j];
        write_outputs_from_keys(keys, row0 + lid, pairs, weights, ids);
    }
}
#endif
