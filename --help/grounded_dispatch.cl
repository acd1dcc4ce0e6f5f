/* The memory layout of every kernel: the element count of each __local
 * array and of each large private array, and each kernel's local bytes, as
 * macros of its compile-time parameters. One description for both sides:
 * the kernels declare their arrays with these counts (the host prepends
 * this file to each program's text, src/kernel_source.c), and the host
 * sizes launches with the byte totals (src/layout.c includes it). Written
 * in the common subset of C11 and OpenCL C, so it holds only integer
 * expressions of its arguments; the arguments may be preprocessor
 * constants (in #if too) or host variables. Element sizes are OpenCL C's:
 * uchar 1, ushort 2, uint and float 4, ulong 8 bytes.
 *
 * tests/test_layout.c holds these totals against CL_KERNEL_LOCAL_MEM_SIZE
 * and CL_KERNEL_PRIVATE_MEM_SIZE for every variant of the portability
 * suite. */
#ifndef MOECL_LAYOUT_H
#define MOECL_LAYOUT_H

#define LAYOUT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define LAYOUT_MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- team top-k (cl/common.cl team_topk), one row's scratch ---------- */

/* Counting: a lane contributes at most its own TOPK best, so the candidate
 * list (keys and values) holds TEAM * min(EPT, TOPK); the uints are the
 * lanes' maxima, the floor and the candidate count. */
#define LAYOUT_TOPK_PER_LANE(ept, k) LAYOUT_MIN(ept, k)
#define LAYOUT_TOPK_CAP(team, ept, k) ((team) * LAYOUT_TOPK_PER_LANE(ept, k))
#define LAYOUT_TOPK_U32(team) ((team) + 2)
#define LAYOUT_TEAM_TOPK_BYTES(team, ept, k) (4 * LAYOUT_TOPK_U32(team) + (8 + 4) * LAYOUT_TOPK_CAP(team, ept, k))

/* ---- topk_gating_team: ROWS rows of TEAM lanes, EPT experts a lane ---- */

/* Lanes that score one group together: a power of two of at most 32, so
 * that a group's parts are neighbouring lanes (1: one lane per group). */
#define LAYOUT_GROUP_PARTS_RAW(team, groups) ((groups) > 0 ? (team) / (groups) : 0)
#define LAYOUT_GROUP_PARTS(team, groups)                                                           \
    (LAYOUT_GROUP_PARTS_RAW(team, groups) >= 32   ? 32                                             \
     : LAYOUT_GROUP_PARTS_RAW(team, groups) >= 16 ? 16                                             \
     : LAYOUT_GROUP_PARTS_RAW(team, groups) >= 8  ? 8                                              \
     : LAYOUT_GROUP_PARTS_RAW(team, groups) >= 4  ? 4                                              \
     : LAYOUT_GROUP_PARTS_RAW(team, groups) >= 2  ? 2                                              \
                                                  : 1)

/* One row's local memory: the softmax's float slots for the team max and
 * sum (none with shuffles, none for sigmoid), the top-k scratch, the
 * chosen weights and ids, and with groups the row's selection scores, the
 * group keys and kept flags, and the parts' top two and counts. */
#define LAYOUT_TOPK_TEAM_ROW_BYTES(team, ept, k, experts, groups, softmax, shuffle)      \
    (((shuffle) || !(softmax) ? 0 : 4 * (team)) + LAYOUT_TEAM_TOPK_BYTES(team, ept, k) + \
     (4 + 4) * (k) +                                                                               \
     ((groups) > 0 ? 4 * (experts) + (8 + 1) * (groups) + (LAYOUT_GROUP_PARTS(team, groups) > 1 ? 12 * (team) : 0) \
                   : 0))
#define LAYOUT_TOPK_TEAM_LOCAL_BYTES(team, rows, ept, k, experts, groups, softmax, shuffle) \
    ((rows) * LAYOUT_TOPK_TEAM_ROW_BYTES(team, ept, k, experts, groups, softmax, shuffle))
/* A lane's private row: EPT logits and EPT ranks. */
#define LAYOUT_TOPK_TEAM_PRIVATE_BYTES(ept) ((4 + 4) * (ept))

/* ---- topk_gating_rows: one work-item per row ------------------------- */

/* The generic loop keeps the row as blocks of eight: scores (float8),
 * ranks (uint8) and each block's largest rank, then TOPK keys and weights;
 * with groups, each group's top-two accumulator (two floats and a count)
 * and key. The copy of the logits that cl/gating.cl's rows_pipeline takes
 * is left out: a lower bound, which is what test_layout checks private
 * sizes against (Intel's compiler keeps part of it in registers). */
#define LAYOUT_ROWS_BLOCK 8
#define LAYOUT_ROWS_BLOCKS(experts) (((experts) + LAYOUT_ROWS_BLOCK - 1) / LAYOUT_ROWS_BLOCK)
#define LAYOUT_TOPK_ROWS_PRIVATE_BYTES(experts, k, groups)                                         \
    ((32 + 32 + 4) * LAYOUT_ROWS_BLOCKS(experts) + (8 + 4) * (k) + (12 + 8) * (groups))

/* ---- grounded_router_team -------------------------------------------- */

/* The ground table k-major, one column per lane's expert, +1 column
 * against bank conflicts. */
#define LAYOUT_GROUND_STRIDE(team, ept) ((ept) * (team) + 1)
#define LAYOUT_GROUNDED_TEAM_LOCAL_BYTES(hidden, team, ept, rows, k)            \
    (4 * (hidden) * LAYOUT_GROUND_STRIDE(team, ept) + 4 * (rows) * (hidden) + (4 + 4) * (rows) * (k) + \
     (rows) * LAYOUT_TEAM_TOPK_BYTES(team, ept, k))
/* A lane's EPT logits, four partial dot products, ranks and g. */
#define LAYOUT_GROUNDED_TEAM_PRIVATE_BYTES(ept) ((4 + 16 + 4 + 4) * (ept))

/* ---- grounded_router_tiled: TM tokens x TN experts, hidden by TK ------ */

/* A stage holds both input tiles k-contiguous, TM tokens' rows then TN
 * experts' rows, each padded by VEC floats (a vector), so that neighbouring
 * rows start in different banks; DB keeps two stages. The tile of g (one
 * column of padding) shares their array, since the two are never live
 * together; the array is rounded up to whole vectors. Then TOPK keys per
 * token. */
#define LAYOUT_TILE_ROW(tk, vec) ((tk) + (vec))
#define LAYOUT_TILE_STAGE(tm, tn, tk, vec) (((tm) + (tn)) * LAYOUT_TILE_ROW(tk, vec))
#define LAYOUT_TILE_INPUTS(tm, tn, tk, vec, db) (((db) ? 2 : 1) * LAYOUT_TILE_STAGE(tm, tn, tk, vec))
#define LAYOUT_TILE_G(tm, tn) ((tm) * ((tn) + 1))
#define LAYOUT_TILE_FLOATS(tm, tn, tk, vec, db)                                                   \
    ((LAYOUT_MAX(LAYOUT_TILE_INPUTS(tm, tn, tk, vec, db), LAYOUT_TILE_G(tm, tn)) + (vec) - 1) / (vec) * (vec))
#define LAYOUT_TILE_KEYS(tm, k) ((tm) * (k))
#define LAYOUT_GROUNDED_TILED_LOCAL_BYTES(tm, tn, tk, vec, db, k)                                  \
    (4 * LAYOUT_TILE_FLOATS(tm, tn, tk, vec, db) + 8 * LAYOUT_TILE_KEYS(tm, k))

/* ---- grounded_router_rows: TM tokens per work-item ------------------- */

/* Experts go in blocks of EB (a multiple of the two experts a step takes)
 * whose dot products wait in dots[TM][EB]; each token keeps its row of g
 * (padded to blocks of eight) for the gating pipeline, which runs on one
 * token's row at a time (its own arrays, as the top-k rows kernel's, are
 * left out: a lower bound) and keeps TOPK keys. */
#define LAYOUT_GROUNDED_RN 2
#define LAYOUT_GROUNDED_EB(experts) ((experts) < 256 ? ((experts) + 1) / 2 * 2 : 256)
/* The tokens' rows of g for the gating pipeline: in dots[][] itself where
 * one block of experts is the whole row and no padding is needed, else a
 * row of BLOCKS * BLOCK floats a token besides; then one token's TOPK
 * keys (the pipeline's other per-token arrays are left out: a lower bound,
 * as test_layout checks private sizes). */
#define LAYOUT_GROUNDED_G_IN_DOTS(experts)                                                         \
    (LAYOUT_GROUNDED_EB(experts) == (experts) && (experts) % LAYOUT_ROWS_BLOCK == 0)
#define LAYOUT_GROUNDED_ROWS_PRIVATE_BYTES(tm, experts, k)                                         \
    (4 * (tm) * LAYOUT_GROUNDED_EB(experts) +                                                      \
     (LAYOUT_GROUNDED_G_IN_DOTS(experts) ? 0 : 4 * (tm) * LAYOUT_ROWS_BLOCKS(experts) * LAYOUT_ROWS_BLOCK) + \
     8 * (k))
/* TM, the tokens of a work-item: 32, four register blocks of 8 sharing each
 * chunk of ground rows from L2 (bench/RESULTS.md: faster than 8 on pocl),
 * where that keeps the private arrays within 20 KiB (128 experts up to top
 * 16); else the largest of 8, 4, 2 and 1 that does, as Intel's CPU runtime
 * allows a single work-item a group at 48 KiB. */
#define LAYOUT_GROUNDED_ROWS_FITS(tm, experts, k) (LAYOUT_GROUNDED_ROWS_PRIVATE_BYTES(tm, experts, k) <= 20480)
#define LAYOUT_GROUNDED_ROWS_TM(experts, k)                                                        \
    (LAYOUT_GROUNDED_ROWS_FITS(32, experts, k)  ? 32                                               \
     : LAYOUT_GROUNDED_ROWS_FITS(8, experts, k) ? 8                                                \
     : LAYOUT_GROUNDED_ROWS_FITS(4, experts, k) ? 4                                                \
     : LAYOUT_GROUNDED_ROWS_FITS(2, experts, k) ? 2                                                \
                                                : 1)

/* ---- grounded_router_mma: TM tokens x TN experts, kw words a k step --- */

/* Two stages of TM hidden and TN ground rows of kw words (+4 against bank
 * conflicts), which after the hidden loop hold the g rows (TN + 1 floats a
 * row); the emulation (MMA_EMULATE) adds a warp's A and B as floats. */
#define LAYOUT_MMA_WORDS(tm, tn, kw) LAYOUT_MAX(2 * ((tm) + (tn)) * ((kw) + 4), (tm) * ((tn) + 1))
#define LAYOUT_MMA_EMU_FLOATS (16 * 16 + 16 * 8)
#define LAYOUT_GROUNDED_MMA_LOCAL_BYTES(tm, tn, kw, warps, emulated)                               \
    (4 * LAYOUT_MMA_WORDS(tm, tn, kw) + ((emulated) ? 4 * (warps) * LAYOUT_MMA_EMU_FLOATS : 0))

/* ---- moe_align ------------------------------------------------------- */

/* Arrays sized at launch (__local kernel arguments): count, scan and
 * scatter take one array of E + 1 words (a column per expert and one for
 * invalid ids; scatter's running positions use E of them), the one-group
 * kernel two such arrays and, on the warp path, a ushort per slot (rounded
 * up to a word; a word when unused). */
#define LAYOUT_ALIGN_COLS_BYTES(experts) (4 * ((experts) + 1))
#define LAYOUT_ALIGN_SLOT_COLS_BYTES(slots, warp) ((warp) && (slots) > 0 ? ((slots) * 2 + 3) / 4 * 4 : 4)
/* Arrays compiled in: the scan's partial sums and its total; the
 * scatter's tile of WG columns (none with WG 1, the plain loop); the
 * one-group kernel's partial sums and its tile (none on the warp path). */
#define LAYOUT_ALIGN_COUNT_STATIC_BYTES 0
#define LAYOUT_ALIGN_SCAN_STATIC_BYTES(scan_wg) (4 * (scan_wg) + 4)
#define LAYOUT_ALIGN_SCATTER_STATIC_BYTES(wg) ((wg) > 1 ? 4 * (wg) : 0)
/* The expert-parallel layout (cl/ep_layout.cl): count and scan take only
 * arrays sized at launch; place compiles in a tile of WG words, as
 * moe_align's scatter (unused, and dropped, with WG 1). */
#define LAYOUT_EP_PLACE_STATIC_BYTES(wg) LAYOUT_ALIGN_SCATTER_STATIC_BYTES(wg)
/* The layout's fused kernel: one array sized at launch (counts 2R + 1 +
 * P', a pass's sub-tile counts rows * NSUB * (R + 1), starts and bases
 * R + 1 each, a packed rank per slot of its chunk, a pass's rank sets:
 * rows * FWG / top_k tokens of ceil(R / 32) words); compiled in, its tile
 * of FWG words and two flags. */
#define LAYOUT_EP_FUSED_NSUB(fwg) ((fwg) < 32 ? 1 : (fwg) / 32)
#define LAYOUT_EP_FUSED_LM_BYTES(fwg, cols, ranks, chunk_slots, top_k, rows)                                       \
    (4 * ((cols) + (rows) * LAYOUT_EP_FUSED_NSUB(fwg) * ((ranks) + 1) + 2 * ((ranks) + 1) + (chunk_slots) +       \
          (rows) * ((fwg) / (top_k)) * (((ranks) + 31) / 32)))
#define LAYOUT_EP_FUSED_STATIC_BYTES(fwg) (4 * (fwg) + 8)
#define LAYOUT_ALIGN_ONE_GROUP_STATIC_BYTES(one_wg, warp) (4 * (one_wg) + ((warp) ? 0 : 4 * (one_wg)))
/* The fused kernel: two arrays of E + 1 words sized at launch (running
 * counts, then totals; the starts); compiled in, the partial sums, the
 * last-work-group flag and the tile of FUSED_WG columns (none with 1). */
#define LAYOUT_ALIGN_FUSED_STATIC_BYTES(fused_wg) (4 * (fused_wg) + 4 + ((fused_wg) > 1 ? 4 * (fused_wg) : 0))

/* ---- top-k gating's scalar arguments, one record ---------------------- */

/* The offsets (in elements) and scalars of a topk_gating call, passed by
 * value as one argument: each kernel argument costs an enqueue a copy
 * (pocl) or a setting (Intel's CPU runtime). Fields in decreasing
 * alignment, so C and OpenCL C lay it out alike, without padding; the
 * array below fails to compile on either side if the size differs. */
#if defined(__OPENCL_C_VERSION__) || defined(__OPENCL_VERSION__) /* clang sets only the first */
#define LAYOUT_U64 ulong
#define LAYOUT_U32 uint
#else
#define LAYOUT_U64 uint64_t
#define LAYOUT_U32 uint32_t
#endif
typedef struct layout_topk_args {
    LAYOUT_U64 gating_off, bias_off, weights_off, ids_off, counts_off;
    LAYOUT_U32 num_tokens;
    float scaling_factor;
} layout_topk_args;
typedef char layout_topk_args_size_check[sizeof(layout_topk_args) == 48 ? 1 : -1];

/* moecl_route_dispatch's kernel (topk_gating_team built with
 * ROUTE_DISPATCH): moe_align's offsets (in elements) and scalars, one
 * argument as above. */
typedef struct layout_dispatch_args {
    LAYOUT_U64 counts_off, sorted_off, blocks_off, post_off, slots_off, invalid_off;
    LAYOUT_U32 block_size, has_slots, has_invalid, unused;
} layout_dispatch_args;
typedef char layout_dispatch_args_size_check[sizeof(layout_dispatch_args) == 64 ? 1 : -1];

#endif

/* Helpers shared by every moecl kernel: input loads, the ranking key that
 * encodes the spec's order (NaN lowest, ties to the lower index), and
 * reductions across the team of work-items that shares one row.
 *
 * Build-time defines (set by the host, see src/):
 *   IN_DTYPE   0 f32, 1 f16, 2 bf16 (the dtype of the main input)
 *   TEAM       work-items per row (a power of two; 1 on CPUs)
 *   ROWS       rows per work-group
 *   MOECL_PTX  1: inline PTX may be compiled (below)
 * OpenCL C 1.2, no extensions: f16 goes through vload_half and bf16 is a
 * 16-bit word widened by a shift, so both work on every device.
 * Helper functions are `static inline`: a plain (C99) `inline` function
 * that the compiler does not inline has no definition anywhere, and clang
 * for AMD GPUs leaves such calls unresolved (write_outputs at TOPK=64). */

/* No contraction of a * b + c into fma behind our back: a compiler may fuse
 * one copy of an expression and not another, and then equal inputs give
 * unequal results and break the tie rule. Dot products call fma()
 * explicitly. */
#pragma OPENCL FP_CONTRACT OFF

/* UNROLL: fully unroll a loop over a private array so that the array stays
 * in registers (a loop index into a private array puts it in memory on
 * GPUs). Only where the compiler is known to honour it well. */
#if defined(MOECL_VENDOR_NVIDIA) && MOECL_VENDOR_NVIDIA
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

/* MOECL_PTX (a build option, set by the host for NVIDIA devices of
 * compute capability 7.0 or later, src/device.c): without it the warp
 * shuffles a variant's TEAM_SHUFFLE asks for are off, so that a build
 * whose inline PTX fails can be redone portable by this define alone
 * (src/program.c; cl/moe_align.cl does the same for WARP_MATCH). */
#ifndef MOECL_PTX
#define MOECL_PTX 0
#endif
#if !MOECL_PTX
#undef TEAM_SHUFFLE
#endif

#ifndef IN_DTYPE
#define IN_DTYPE 0
#endif
#ifndef TEAM
#define TEAM 1
#endif
#ifndef ROWS
#define ROWS 1
#endif

#if IN_DTYPE == 0
typedef float in_t;
#define LOAD_IN(p, i) ((p)[i])
#elif IN_DTYPE == 1
/* Stored as 16-bit words so that no arithmetic is done on half pointers,
 * which OpenCL C 1.2 allows only with cl_khr_fp16. */
typedef ushort in_t;
#define LOAD_IN(p, i) vload_half((i), (__global const half *)(p))
#elif IN_DTYPE == 2
typedef ushort in_t;
#define LOAD_IN(p, i) as_float((uint)(p)[i] << 16)
#else
#error "IN_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

/* Eight consecutive elements p[i..i+7] widened to floats. */
static inline float8 load_in8(__global const in_t *p, size_t i)
{
#if IN_DTYPE == 0
    return vload8(0, p + i);
#elif IN_DTYPE == 1
    /* The words are loaded as ushort8 and converted from private memory:
     * pocl 3.1 (Debian 12, x86-64) loads vload_half8's global operand with an aligned
     * 16-byte move, which faults on rows that start off a 16-byte boundary
     * (17 f16 experts: row 1 starts at byte 34). vload_halfn needs only
     * 2-byte alignment; the private copy is aligned, so every driver is
     * right. */
    ushort w[8] __attribute__((aligned(16)));
    vstore8(vload8(0, p + i), 0, w);
    return vload_half8(0, (const half *)w);
#else
    return as_float8(convert_uint8(vload8(0, p + i)) << 16);
#endif
}

/* Maps a float to a uint whose unsigned order is the spec's order: NaN
 * lowest (0), then -inf ... +inf, with -0 equal to +0. */
static inline uint rank_of_float(float f)
{
    /* Selects, not branches: the team kernels rank every element, and a
     * branch per case costs each of them a divergence region on GPUs. */
    const uint u = as_uint(f);
    const uint r = u ^ ((uint)((int)u >> 31) | 0x80000000u); /* ~u if negative, else u | sign */
    const uint r0 = f == 0.0f ? 0x80000000u : r;
    return isnan(f) ? 0u : r0;
}

/* A 64-bit key whose order is "larger score first, then lower index": the
 * rank of the score above the complemented index. Every valid key is
 * > 0xffffffff, so 0 is free to mark excluded or already-taken entries. */
static inline ulong rank_key(float score, uint index)
{
    return ((ulong)rank_of_float(score) << 32) | (ulong)(~index);
}

static inline uint key_index(ulong key) { return ~(uint)key; }

#define KEY_NONE 0ul

/* The rank of a selection score for the team kernels, with 0 kept free for
 * "excluded or already taken": NaN ranks 1, still below -inf. */
#define RANK_NONE 0u
static inline uint select_rank(float s)
{
    return max(rank_of_float(s), 1u);
}

/* NATIVE_MATH (set by the host for NVIDIA, whose native exp and
 * reciprocal are within the error bounds the tests hold every kernel to):
 * faster exp, and scores as e * (1 / sum). */
#ifndef NATIVE_MATH
#define NATIVE_MATH 0
#endif
#if NATIVE_MATH
#define EXP(x) native_exp(x)
#else
#define EXP(x) exp(x)
#endif

/* Team reductions. Each row's team owns TEAM consecutive slots of a
 * __local scratch array. Every lane gets the same result, computed in the
 * same order, so all lanes agree bit for bit. Small teams read all slots
 * (two barriers); large teams use a tree.
 *
 * TEAM_SHUFFLE (set by the host only with MOECL_PTX, for teams of at most
 * 32 work-items and work-groups of whole warps): the same reductions as
 * butterflies of warp shuffles in inline PTX, with no local memory and no
 * barriers. Max is exact and a butterfly sum adds the same pairs in every
 * lane (addition commutes), so every lane still gets the same bits. */
#ifndef TEAM_SHUFFLE
#define TEAM_SHUFFLE 0
#endif

#if TEAM > 1 && TEAM_SHUFFLE
static inline uint shuffle_xor(uint v, uint lane_mask)
{
    uint r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(v), "r"(lane_mask));
    return r;
}

static inline float team_max_float(float v, __local float *slots, uint lane)
{
    (void)slots;
    (void)lane;
    for (uint m = TEAM / 2; m > 0; m >>= 1)
        v = fmax(v, as_float(shuffle_xor(as_uint(v), m)));
    return v;
}

static inline float team_sum_float(float v, __local float *slots, uint lane)
{
    (void)slots;
    (void)lane;
    for (uint m = TEAM / 2; m > 0; m >>= 1)
        v = v + as_float(shuffle_xor(as_uint(v), m));
    return v;
}

#elif TEAM > 1
/* fmax ignores NaN, as the spec's max over the non-NaN logits does. */
static inline float team_max_float(float v, __local float *slots, uint lane)
{
    slots[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
#if TEAM <= 32
    float r = slots[0];
    for (uint i = 1; i < TEAM; i++)
        r = fmax(r, slots[i]);
#else
    for (uint s = TEAM / 2; s > 0; s >>= 1) {
        if (lane < s)
            slots[lane] = fmax(slots[lane], slots[lane + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float r = slots[0];
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

/* The sum in the pairing order of the shuffle butterfly (lane l with
 * l + s for s = TEAM/2 ... 1), so that a row gets the same bits whether its
 * work-group takes the shuffles or local memory (on NVIDIA that depends on
 * the rows per work-group). */
static inline float team_sum_float(float v, __local float *slots, uint lane)
{
    slots[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
#if TEAM <= 32
    float a[TEAM];
    UNROLL
    for (uint i = 0; i < TEAM; i++)
        a[i] = slots[i];
    UNROLL
    for (uint s = TEAM / 2; s > 0; s >>= 1) {
        UNROLL
        for (uint i = 0; i < s; i++)
            a[i] = a[i] + a[i + s];
    }
    const float r = a[0];
#else
    for (uint s = TEAM / 2; s > 0; s >>= 1) {
        if (lane < s)
            slots[lane] = slots[lane] + slots[lane + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float r = slots[0];
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}
#endif


/* Insert key (with its weight) into a descending list of K keys if it
 * belongs there. Used by the one-row-per-work-item kernels. */
#define TOPK_INSERT(keys, vals, K, key, val)                                                       \
    do {                                                                                           \
        if ((key) > (keys)[(K)-1]) {                                                               \
            int j_ = (K)-1;                                                                        \
            while (j_ > 0 && (keys)[j_ - 1] < (key)) {                                             \
                (keys)[j_] = (keys)[j_ - 1];                                                       \
                (vals)[j_] = (vals)[j_ - 1];                                                       \
                j_--;                                                                              \
            }                                                                                      \
            (keys)[j_] = (key);                                                                    \
            (vals)[j_] = (val);                                                                    \
        }                                                                                          \
    } while (0)

#if defined(EPT) && defined(TOPK) && TEAM > 1
/* Top-k across a team. Each lane holds EPT selection ranks (its element i
 * is expert i * TEAM + lane; RANK_NONE marks an excluded one) and EPT
 * values. It fills the row's chosen_ids[j] / chosen_values[j] (local
 * memory) in order, the largest key first; the caller puts a barrier
 * before reading them. Every work-item of the work-group must call (it
 * uses barriers).
 *
 * The EPT loops are unrolled so that rank[] and value[] stay in registers:
 * indexing a private array with a loop variable would put it in memory. */

/* By counting:
 * 1. a floor: the TOPK-th largest of the lanes' maximum ranks. TOPK lanes
 *    hold a rank at least that large, so every chosen rank is >= floor.
 * 2. each lane appends its elements with rank >= floor (at most TOPK of
 *    them, its own best, since no more can be chosen from one lane) to the
 *    row's candidate list in local memory.
 * 3. each candidate's place is the number of candidates with a larger key
 *    (keys are distinct: they end in the index), and the TOPK first go to
 *    chosen_*. The list's order (where each lane's run lands) does not
 *    matter, so the result is deterministic.
 * On random rows only a handful of elements pass the floor, so step 3 is
 * short; with many ties at the floor it is quadratic but still correct.
 * Scratch per row: cl/layout.h (LAYOUT_TEAM_TOPK_BYTES). */
#define TOPK_PER_LANE LAYOUT_TOPK_PER_LANE(EPT, TOPK)
#define TOPK_CAP LAYOUT_TOPK_CAP(TEAM, EPT, TOPK)
#define TOPK_COUNT_U32 LAYOUT_TOPK_U32(TEAM)

#if TEAM_SHUFFLE
/* Lane `from` of the calling lane's team (inline PTX: the segment width
 * in the shuffle's c operand keeps the index inside the team). */
static inline uint shuffle_team_lane(uint v, uint from)
{
    uint r;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, %3, 0xffffffff;"
                 : "=r"(r)
                 : "r"(v), "r"(from), "r"(((32u - TEAM) << 8) | 0x1fu));
    return r;
}

/* Step 1 with shuffles: the lanes' maxima sorted in descending order across
 * the team by a bitonic network (lane i ends with the i-th largest), and
 * the TOPK-th of them is the floor: the same value as the counting below
 * finds, in log2(TEAM) * (log2(TEAM) + 1) / 2 exchanges instead of TEAM
 * reads a lane, and no barrier. Every lane of the team calls; the first
 * barrier of team_topk comes before, for its other scratch. */
static inline uint team_topk_floor(uint best, uint lane, __local uint *lane_max, __local uint *floor_slot)
{
    (void)lane_max;
    (void)floor_slot;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (TEAM < TOPK)
        return 1u;
    uint v = best;
    for (uint size = 2; size <= TEAM; size <<= 1)
        for (uint stride = size / 2; stride > 0; stride >>= 1) {
            const uint other = shuffle_xor(v, stride);
            const bool take_max = ((lane & size) == 0) == ((lane & stride) == 0);
            v = take_max ? max(v, other) : min(v, other);
        }
    return max(shuffle_team_lane(v, TOPK - 1), 1u);
}
#else
/* Step 1: the lane whose maximum is TOPK-th in (rank, lower lane) order
 * publishes it. Every work-item of the work-group calls (barriers). */
static inline uint team_topk_floor(uint best, uint lane, __local uint *lane_max, __local uint *floor_slot)
{
    lane_max[lane] = best;
    barrier(CLK_LOCAL_MEM_FENCE);
    uint above = 0;
    for (uint l = 0; l < TEAM; l++) {
        const uint m = lane_max[l];
        above += (m > best) || (m == best && l < lane);
    }
    if (above == TOPK - 1)
        *floor_slot = max(best, 1u);
    barrier(CLK_LOCAL_MEM_FENCE);
    return *floor_slot;
}
#endif

/* Step 2's slots: a lane appends its `take` candidates as one run, at the
 * offset this returns; the list's length is team_candidate_count() after
 * the barrier that follows the appends. Where the runs go does not change
 * the result (step 3 places candidates by key). */
#if TEAM_SHUFFLE
/* The value of lane - delta of the caller's team (its own below delta). */
static inline uint shuffle_team_up(uint v, uint delta)
{
    uint r;
    asm volatile("shfl.sync.up.b32 %0, %1, %2, %3, 0xffffffff;"
                 : "=r"(r)
                 : "r"(v), "r"(delta), "r"((32u - TEAM) << 8));
    return r;
}

/* An exclusive prefix sum across the team: no atomics and no divergence. */
static inline uint team_candidate_base(uint take, uint lane, __local uint *count_slot, uint *count)
{
    (void)count_slot;
    uint inclusive = take;
    for (uint d = 1; d < TEAM; d <<= 1) {
        const uint below = shuffle_team_up(inclusive, d);
        inclusive += lane >= d ? below : 0u;
    }
    *count = shuffle_team_lane(inclusive, TEAM - 1);
    return inclusive - take;
}

static inline uint team_candidate_count(uint count, __local const uint *count_slot)
{
    (void)count_slot;
    return count;
}
#else
static inline uint team_candidate_base(uint take, uint lane, __local uint *count_slot, uint *count)
{
    (void)lane;
    *count = 0u;
    return take ? atomic_add(count_slot, take) : 0u;
}

static inline uint team_candidate_count(uint count, __local const uint *count_slot)
{
    (void)count;
    return *count_slot;
}
#endif

static inline void team_topk(uint *rank, const float *value, __local uint *u32_scratch, __local ulong *cand_keys,
                             __local float *cand_values, uint lane, __local uint *chosen_ids,
                             __local float *chosen_values)
{
    __local uint *lane_max = u32_scratch;
    __local uint *floor_slot = u32_scratch + TEAM;
    __local uint *count_slot = u32_scratch + TEAM + 1;

    uint best = RANK_NONE;
    UNROLL
    for (uint i = 0; i < EPT; i++)
        best = max(best, rank[i]);
    if (lane == 0) {
        *floor_slot = 1u; /* fewer lanes than TOPK: every valid rank */
        *count_slot = 0u;
    }
    for (uint j = lane; j < TOPK; j += TEAM) {
        chosen_ids[j] = 0xffffffffu;
        chosen_values[j] = 0.0f;
    }
    /* Step 1. */
    const uint floor_rank = team_topk_floor(best, lane, lane_max, floor_slot);

    /* Step 2: candidates. */
    uint mine = 0;
    UNROLL
    for (uint i = 0; i < EPT; i++)
        mine += rank[i] >= floor_rank;
    uint total;
    uint at = team_candidate_base(min(mine, (uint)TOPK_PER_LANE), lane, count_slot, &total);
    if (mine <= TOPK_PER_LANE) {
        UNROLL
        for (uint i = 0; i < EPT; i++) {
            if (rank[i] >= floor_rank) {
                cand_keys[at] = ((ulong)rank[i] << 32) | (ulong)(~(i * TEAM + lane));
                cand_values[at] = value[i];
                at++;
            }
        }
    } else {
        /* Rare (ties, or a lane holding most of the winners): the lane's
         * own TOPK_PER_LANE best, first of equal ranks first. */
        uint taken[(EPT + 31) / 32];
        for (uint w = 0; w < (EPT + 31) / 32; w++)
            taken[w] = 0;
        for (uint t = 0; t < TOPK_PER_LANE; t++) {
            uint b = RANK_NONE, slot = 0;
            UNROLL
            for (uint i = 0; i < EPT; i++) {
                if (rank[i] >= floor_rank && rank[i] > b && !(taken[i / 32] & (1u << (i % 32)))) {
                    b = rank[i];
                    slot = i;
                }
            }
            taken[slot / 32] |= 1u << (slot % 32);
            float v = 0.0f;
            UNROLL
            for (uint i = 0; i < EPT; i++)
                if (i == slot)
                    v = value[i];
            cand_keys[at + t] = ((ulong)b << 32) | (ulong)(~(slot * TEAM + lane));
            cand_values[at + t] = v;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    /* Step 3: places. */
    const uint count = team_candidate_count(total, count_slot);
    for (uint c = lane; c < count; c += TEAM) {
        const ulong key = cand_keys[c];
        uint place = 0;
        for (uint o = 0; o < count; o++)
            place += cand_keys[o] > key;
        if (place < TOPK) {
            chosen_ids[place] = key_index(key);
            chosen_values[place] = cand_values[c];
        }
    }
}

/* team_topk's local scratch for the ROWS rows of a work-group, declared at
 * the top of a kernel (OpenCL C allows __local variables only at kernel
 * scope), and row r's share of it as team_topk's scratch arguments. */
#define TEAM_TOPK_LOCALS                                                                           \
    __local uint topk_u32[ROWS * TOPK_COUNT_U32];                                                  \
    __local ulong topk_keys[ROWS * TOPK_CAP];                                                      \
    __local float topk_values[ROWS * TOPK_CAP]
#define TEAM_TOPK_SCRATCH(r) topk_u32 + (r)*TOPK_COUNT_U32, topk_keys + (r)*TOPK_CAP, topk_values + (r)*TOPK_CAP
#endif

/* ROUTE_DISPATCH: a routing kernel's dispatch epilogue (moecl_route_dispatch's
 * topk_gating_team, moecl_grounded_route_dispatch's grounded_router_team).
 * The program holds cl/moe_align.cl too, built with FUSED_WG = TEAM * ROWS:
 * after its rows, each work-group takes them as its chunk of moe_align_fused,
 * so that routing and dispatch are one launch. DISPATCH_PARAMS follow the
 * kernel's own parameters, DISPATCH_LOCALS open its body, and
 * DISPATCH_AFTER_ROWS(ids, num_tokens) ends it, every work-item reaching it
 * (ids: the kernel's topk_ids at their offset). */
#ifndef ROUTE_DISPATCH
#define ROUTE_DISPATCH 0
#endif
#if ROUTE_DISPATCH
#define DISPATCH_PARAMS                                                                            \
    , __global uint *scratch, __global int *expert_counts, __global int *sorted_token_ids,          \
        __global int *block_expert_ids, __global int *post_padded, __global int *slot_positions,    \
        __global int *num_invalid, layout_dispatch_args dargs, __local uint *run, __local uint *start
#define DISPATCH_LOCALS                                                                            \
    __local uint align_part[FUSED_WG], align_tile[FUSED_WG];                                       \
    __local uint align_flag
/* The rows' ids are this work-group's own writes: a barrier makes them
 * visible to all its work-items; other work-groups get their columns
 * through the scratch buffer's atomics. */
#define DISPATCH_AFTER_ROWS(ids, num_tokens)                                                       \
    do {                                                                                           \
        barrier(CLK_GLOBAL_MEM_FENCE);                                                             \
        fused_align((ids), (num_tokens) * TOPK, NUM_EXPERTS, ROWS * TOPK, dargs.block_size, scratch, \
                    expert_counts, dargs.counts_off, sorted_token_ids, dargs.sorted_off, block_expert_ids, \
                    dargs.blocks_off, post_padded, dargs.post_off, slot_positions, dargs.slots_off,    \
                    dargs.has_slots, num_invalid, dargs.invalid_off, dargs.has_invalid, run, start,   \
                    align_part, &align_flag, align_tile, true);                                    \
    } while (0)
#else
#define DISPATCH_PARAMS
#define DISPATCH_LOCALS
#define DISPATCH_AFTER_ROWS(ids, num_tokens)
#endif

/* Dispatch after routing: moe_align (docs/routing.md, "Dispatch:
 * moe_align"). Groups the flat slots s = t * top_k + j of topk_ids by
 * expert, in increasing expert order and increasing slot order within an
 * expert, pads each expert's run to a multiple of the block size, and
 * names the expert of each block.
 *
 * Three launches, chained by the host:
 *   moe_align_count    one work-group per chunk of CHUNK slots: a
 *                      histogram of the chunk's ids in local memory, written
 *                      as the chunk's row of the count matrix
 *                      m[chunk][E + 1] (column E counts invalid ids);
 *   moe_align_scan     one work-group: per expert, an exclusive scan of its
 *                      column over the chunks (in slot order), the totals,
 *                      the padded totals and their exclusive scan over the
 *                      experts (expert_start), and the small outputs;
 *   moe_align_scatter  one work-group per chunk: each valid slot goes to
 *                      expert_start[e] + (slots of e in earlier chunks) +
 *                      (slots of e earlier in this chunk); and all its
 *                      work-items together write the sentinel at the
 *                      padding positions and the expert of each block.
 * The within-chunk rank is stable: the chunk is walked in tiles of WG
 * slots, a slot's rank in its tile is the count of equal ids before it
 * (a loop over the tile in local memory), and a per-expert running offset
 * in local memory advances after each tile. Every output element is
 * written by exactly one work-item and its value does not depend on
 * scheduling, so results are deterministic on every device.
 *
 * Small routings (GPUs; the host decides by size) take one launch instead,
 * moe_align_one_group: one work-group does every step. It saves two
 * launches and the scratch buffer, which is most of the time at decode
 * sizes where a launch costs the host more than the work (NVIDIA's OpenCL;
 * bench/RESULTS.md, moe_align).
 *
 * Build-time defines: WG (work-items of the count and scatter work-groups;
 * 1 on CPUs, where each chunk is then a plain loop), SCAN_WG (the scan's
 * work-group) and ONE_WG (the one-group kernel's work-group). Everything
 * else is a kernel argument. OpenCL C 1.2 with no extensions: local
 * atomic_inc on uint is core since 1.1. Sizes fit in int32 (the host
 * validates num_tokens * top_k + E * (block_size - 1) <= INT32_MAX), so
 * uint arithmetic does not wrap. */

#ifndef WG
#define WG 1
#endif
#ifndef SCAN_WG
#define SCAN_WG 64
#endif
#ifndef ONE_WG
#define ONE_WG 256
#endif
/* WARP_MATCH (set by the host only with MOECL_PTX): the one-group
 * kernel's first warp places the slots in tiles of 32, ranking equal ids
 * with PTX match.any.sync (sm_70 and later) instead of a loop over the
 * tile. MOECL_PTX, a build option (src/device.c): without it WARP_MATCH is
 * off, so that a build whose inline PTX fails can be redone portable by
 * that define alone (src/program.c; cl/common.cl, which this program does
 * not include, does the same for TEAM_SHUFFLE). */
#ifndef MOECL_PTX
#define MOECL_PTX 0
#endif
#if !MOECL_PTX
#undef WARP_MATCH
#endif
#ifndef WARP_MATCH
#define WARP_MATCH 0
#endif

#ifndef UNROLL /* cl/common.cl's, where the program holds it (route dispatch) */
#if defined(MOECL_VENDOR_NVIDIA) && MOECL_VENDOR_NVIDIA
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif
#endif
/* The loads of a serial walk (the scans, the fused kernel's placement) go
 * out LOAD_BATCH at a time before any is used: a GPU issues in order and
 * stalls at a value's first use, so one load a step would cost a round
 * trip to memory a step. */
#define LOAD_BATCH 8

/* The column of a slot's id: its expert, or E for an id outside [0, E). */
static inline uint column_of(int id, uint num_experts)
{
    return id >= 0 && (uint)id < num_experts ? (uint)id : num_experts;
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void moe_align_count(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint chunk,
                     __global uint *matrix, __local uint *hist)
{
    const uint lid = get_local_id(0), c = get_group_id(0), cols = num_experts + 1;
    ids += ids_off;
    for (uint e = lid; e < cols; e += WG)
        hist[e] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = c * chunk, end = min(begin + chunk, num_slots);
    for (uint s = begin + lid; s < end; s += WG) {
#if WG == 1
        hist[column_of(ids[s], num_experts)]++;
#else
        atomic_inc(&hist[column_of(ids[s], num_experts)]);
#endif
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __global uint *row = matrix + (size_t)c * cols;
    for (uint e = lid; e < cols; e += WG)
        row[e] = hist[e];
}

/* scratch holds, after the count matrix: expert_start[E + 1] (start[E] is
 * num_tokens_post_padded) and totals[E + 1] (totals[E]: invalid ids). The
 * matrix becomes each chunk's exclusive prefix per column. */
__kernel __attribute__((reqd_work_group_size(SCAN_WG, 1, 1)))
void moe_align_scan(__global uint *matrix, uint num_chunks, uint num_experts, uint block_size,
                    __global int *counts, ulong counts_off, __global int *post_padded, ulong post_off,
                    __global int *num_invalid, ulong invalid_off, uint has_invalid, __local uint *tot)
{
    __local uint part[SCAN_WG];
    __local uint total_padded;
    const uint lid = get_local_id(0), cols = num_experts + 1;
    __global uint *expert_start = matrix + (size_t)num_chunks * cols, *totals = expert_start + cols;
    /* Columns over chunks: adjacent work-items read adjacent columns. */
    for (uint e = lid; e < cols; e += SCAN_WG) {
        uint acc = 0;
        for (uint c0 = 0; c0 < num_chunks; c0 += LOAD_BATCH) {
            uint count[LOAD_BATCH];
            UNROLL
            for (uint j = 0; j < LOAD_BATCH; j++)
                count[j] = c0 + j < num_chunks ? matrix[(size_t)(c0 + j) * cols + e] : 0u;
            UNROLL
            for (uint j = 0; j < LOAD_BATCH; j++) {
                if (c0 + j < num_chunks)
                    matrix[(size_t)(c0 + j) * cols + e] = acc;
                acc += count[j];
            }
        }
        tot[e] = acc;
        totals[e] = acc;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* Padded totals over experts: contiguous ranges per work-item, then an
     * exclusive scan of the ranges' sums. */
    const uint per = (num_experts + SCAN_WG - 1) / SCAN_WG;
    const uint lo = min(lid * per, num_experts), hi = min(lo + per, num_experts);
    uint sum = 0;
    for (uint e = lo; e < hi; e++)
        sum += (tot[e] + block_size - 1) / block_size * block_size;
    part[lid] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
        uint acc = 0;
        for (uint w = 0; w < SCAN_WG; w++) {
            const uint v = part[w];
            part[w] = acc;
            acc += v;
        }
        total_padded = acc;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    uint at = part[lid];
    for (uint e = lo; e < hi; e++) {
        expert_start[e] = at;
        counts[counts_off + e] = (int)tot[e];
        at += (tot[e] + block_size - 1) / block_size * block_size;
    }
    if (lid == 0) {
        expert_start[num_experts] = total_padded;
        post_padded[post_off] = (int)total_padded;
        if (has_invalid)
            num_invalid[invalid_off] = (int)tot[num_experts];
    }
}

/* The expert whose padded range holds position p < start[E]: the largest
 * e with start[e] <= p (empty experts have start[e] == start[e + 1]). */
static inline uint expert_at(__global const uint *start, uint num_experts, uint p)
{
    uint lo = 0, hi = num_experts;
    while (hi - lo > 1) {
        const uint mid = (lo + hi) / 2;
        if (start[mid] <= p)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The stable rank of work-item lid's column e in a tile of n work-items:
 * the number of lower work-items with the same column (tile holds the n
 * columns, read one at a time: four at a time was slower on the H200,
 * bench/RESULTS.md, moe_align). Called by all n work-items. */
static inline uint tile_rank(uint e, uint lid, __local uint *tile)
{
    tile[lid] = e;
    barrier(CLK_LOCAL_MEM_FENCE);
    uint rank = 0;
    for (uint j = 0; j < lid; j++)
        rank += tile[j] == e;
    return rank;
}

/* After a tile: each column's running count (run) moves past the tile's
 * slots of that column, for the columns below limit. */
static inline void tile_advance(uint e, __local uint *run, uint limit)
{
    barrier(CLK_LOCAL_MEM_FENCE);
    if (e < limit)
        atomic_inc(&run[e]);
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* One tile of the stable placement, called by all n work-items of a
 * work-group: work-item lid's slot (e: its column; past the end, a column
 * no slot has) goes to run[e] plus its rank in the tile; then run advances
 * past the tile's slots. */
static inline void place_tile(uint slot, uint e, bool in_range, uint lid, __local uint *tile, __local uint *run,
                              uint num_experts, __global int *sorted, ulong sorted_off, __global int *slot_positions,
                              ulong slot_off, uint has_slots)
{
    const uint rank = tile_rank(e, lid, tile);
    int pos = -1;
    if (e < num_experts) {
        pos = (int)(run[e] + rank);
        sorted[sorted_off + pos] = (int)slot;
    }
    if (in_range && has_slots)
        slot_positions[slot_off + slot] = pos;
    tile_advance(e, run, num_experts);
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void moe_align_scatter(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint chunk,
                       __global const uint *matrix, ulong starts_off, __global int *sorted,
                       ulong sorted_off, __global int *slot_positions, ulong slot_off, uint has_slots,
                       uint block_size, uint max_padded, uint num_blocks, __global int *blocks, ulong blocks_off,
                       __local uint *run)
{
    const uint lid = get_local_id(0), c = get_group_id(0), cols = num_experts + 1;
    ids += ids_off;
    __global const uint *row = matrix + (size_t)c * cols, *expert_start = matrix + starts_off;
    /* Padding positions (the sentinel num_slots) and blocks, spread over
     * every work-item of the launch: a launch of its own would cost the
     * host more than this work. Each expert's padding (under block_size
     * positions) after its slots, then the tail after the last run; a
     * binary search per block (there are few). */
    const uint post = expert_start[num_experts], gid = get_global_id(0), gsize = get_global_size(0);
    __global const uint *totals = expert_start + cols;
    for (uint e = gid; e < num_experts; e += gsize)
        for (uint p = expert_start[e] + totals[e]; p < expert_start[e + 1]; p++)
            sorted[sorted_off + p] = (int)num_slots;
    for (uint p = post + gid; p < max_padded; p += gsize)
        sorted[sorted_off + p] = (int)num_slots;
    for (uint b = gid; b < num_blocks; b += gsize) {
        const uint q = b * block_size;
        blocks[blocks_off + b] = q >= post ? -1 : (int)expert_at(expert_start, num_experts, q);
    }
    for (uint e = lid; e < num_experts; e += WG)
        run[e] = expert_start[e] + row[e];
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = c * chunk, end = min(begin + chunk, num_slots);
#if WG == 1
    for (uint s = begin; s < end; s++) {
        const uint e = column_of(ids[s], num_experts);
        int pos = -1;
        if (e < num_experts) {
            pos = (int)run[e]++;
            sorted[sorted_off + pos] = (int)s;
        }
        if (has_slots)
            slot_positions[slot_off + s] = pos;
    }
#else
    __local uint tile[WG];
    for (uint base = begin; base < end; base += WG) {
        const uint s = base + lid;
        /* Past the end: a column no slot has. */
        const uint e = s < end ? column_of(ids[s], num_experts) : num_experts + 1;
        place_tile(s, e, s < end, lid, tile, run, num_experts, sorted, sorted_off, slot_positions, slot_off,
                   has_slots);
    }
#endif
}

/* ---- one launch for small routings ---- */

/* The padded starts from the column totals tot[E + 1] in one work-group
 * of n work-items (part: n words): contiguous ranges of experts per
 * work-item, an inclusive scan of the ranges' sums (Hillis-Steele), then
 * each range's own prefix. Writes start[0..E] (start[E]: the padded
 * total), expert_counts and, where publish is set,
 * num_tokens_post_padded and num_invalid; returns the padded total. start is
 * complete for every work-item on return. */
static inline uint padded_starts(__local const uint *tot, __local uint *start, __local uint *part, uint n, uint lid,
                                 uint num_experts, uint block_size, __global int *counts, ulong counts_off,
                                 __global int *post_padded, ulong post_off, __global int *num_invalid,
                                 ulong invalid_off, uint has_invalid, bool publish)
{
    const uint per = (num_experts + n - 1) / n;
    const uint lo = min(lid * per, num_experts), hi = min(lo + per, num_experts);
    uint sum = 0;
    for (uint e = lo; e < hi; e++)
        sum += (tot[e] + block_size - 1) / block_size * block_size;
    part[lid] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint d = 1; d < n; d <<= 1) {
        const uint add = lid >= d ? part[lid - d] : 0;
        barrier(CLK_LOCAL_MEM_FENCE);
        part[lid] += add;
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    uint at = part[lid] - sum;
    for (uint e = lo; e < hi; e++) {
        start[e] = at;
        counts[counts_off + e] = (int)tot[e];
        at += (tot[e] + block_size - 1) / block_size * block_size;
    }
    const uint post = part[n - 1];
    if (lid == 0) {
        start[num_experts] = post;
        if (publish) {
            post_padded[post_off] = (int)post;
            if (has_invalid)
                num_invalid[invalid_off] = (int)tot[num_experts];
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    return post;
}

/* The sentinel at the padding positions and the expert of each block, by
 * the n work-items of one work-group: per expert, its padding follows its
 * slots and its blocks are its run; then the tail after post. The slots'
 * own positions, written apart, are disjoint from these. */
static inline void pad_and_blocks(__local const uint *tot, __local const uint *start, uint post, uint n, uint lid,
                                  uint num_slots, uint num_experts, uint block_size, uint max_padded, uint num_blocks,
                                  __global int *sorted, ulong sorted_off, __global int *blocks, ulong blocks_off)
{
    for (uint e = lid; e < num_experts; e += n) {
        const uint first = start[e], next = start[e + 1];
        for (uint p = first + tot[e]; p < next; p++)
            sorted[sorted_off + p] = (int)num_slots;
        for (uint b = first / block_size; b < next / block_size; b++)
            blocks[blocks_off + b] = (int)e;
    }
    for (uint p = post + lid; p < max_padded; p += n)
        sorted[sorted_off + p] = (int)num_slots;
    for (uint b = post / block_size + lid; b < num_blocks; b += n)
        blocks[blocks_off + b] = -1;
}

/* tot and start hold num_experts + 1 words each. The same steps as the
 * three kernels, in one work-group: count, scan, padding and blocks (per
 * expert: its padding follows its slots, its blocks are its run), then the
 * slots in tiles of ONE_WG with the stable rank of moe_align_scatter. */
__kernel __attribute__((reqd_work_group_size(ONE_WG, 1, 1)))
void moe_align_one_group(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint block_size,
                         uint max_padded, uint num_blocks, __global int *counts, ulong counts_off,
                         __global int *sorted, ulong sorted_off, __global int *blocks, ulong blocks_off,
                         __global int *post_padded, ulong post_off, __global int *slot_positions, ulong slot_off,
                         uint has_slots, __global int *num_invalid, ulong invalid_off, uint has_invalid,
                         __local uint *tot, __local uint *start, __local ushort *slot_cols)
{
    __local uint part[ONE_WG];
#if !WARP_MATCH
    __local uint tile[ONE_WG];
#endif
    const uint lid = get_local_id(0), cols = num_experts + 1;
    ids += ids_off;
    for (uint e = lid; e < cols; e += ONE_WG)
        tot[e] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = lid; s < num_slots; s += ONE_WG) {
        const uint e = column_of(ids[s], num_experts);
        atomic_inc(&tot[e]);
#if WARP_MATCH
        slot_cols[s] = (ushort)e; /* the placing warp reads them from here */
#endif
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    const uint post = padded_starts(tot, start, part, ONE_WG, lid, num_experts, block_size, counts, counts_off,
                                    post_padded, post_off, num_invalid, invalid_off, has_invalid, true);
    pad_and_blocks(tot, start, post, ONE_WG, lid, num_slots, num_experts, block_size, max_padded, num_blocks, sorted,
                   sorted_off, blocks, blocks_off);
    barrier(CLK_LOCAL_MEM_FENCE);
    /* tot becomes each expert's next position (the warp path: its count
     * so far, which fits the 16-bit ranks). */
    for (uint e = lid; e < num_experts; e += ONE_WG)
        tot[e] = WARP_MATCH ? 0 : start[e];
    barrier(CLK_LOCAL_MEM_FENCE);

#if WARP_MATCH
    /* One warp ranks the slots in tiles of 32: a slot's rank within its
     * expert is the expert's count so far plus the lower lanes with the
     * same column; the lowest such lane then advances the count. The
     * warp touches only local memory (bar.warp.sync orders it between the
     * lanes); the rank replaces the slot's column, and all work-items write
     * the outputs afterwards. */
    if (lid < 32) {
        uint lower;
        asm("mov.u32 %0, %%lanemask_lt;" : "=r"(lower));
        for (uint base = 0; base < num_slots; base += 32) {
            const uint slot = lid + base;
            const uint e = slot < num_slots ? slot_cols[slot] : num_experts + 1;
            uint same;
            asm volatile("match.any.sync.b32 %0, %1, 0xffffffff;" : "=r"(same) : "r"(e));
            if (e < num_experts)
                slot_cols[slot] = (ushort)(tot[e] + popcount(same & lower));
            asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
            if (e < num_experts && (same & lower) == 0)
                tot[e] += popcount(same);
            asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint slot = lid; slot < num_slots; slot += ONE_WG) {
        const uint e = column_of(ids[slot], num_experts);
        int pos = -1;
        if (e < num_experts) {
            pos = (int)(start[e] + slot_cols[slot]);
            sorted[sorted_off + pos] = (int)slot;
        }
        if (has_slots)
            slot_positions[slot_off + slot] = pos;
    }
#else
    for (uint base = 0; base < num_slots; base += ONE_WG) {
        const uint slot = base + lid;
        /* Past the end: a column no slot has. */
        const uint e = slot < num_slots ? column_of(ids[slot], num_experts) : num_experts + 1;
        place_tile(slot, e, slot < num_slots, lid, tile, tot, num_experts, sorted, sorted_off, slot_positions,
                   slot_off, has_slots);
    }
#endif
}

/* ---- one launch at every size: moe_align_fused ---- */

/* Each work-group c counts and ranks its chunk of slots: the ranks (a
 * slot's place among the chunk's slots of its column, stable) go to
 * ranks[s], the chunk's counts to row c of the count matrix. Then it takes
 * a ticket; the work-group that takes the last one does the rest alone:
 * the scan of the matrix, the small outputs, the padding and blocks, and
 * every slot's placement (position = its expert's start + the expert's
 * slots in earlier chunks + its rank). No work-group waits for another:
 * OpenCL does not promise that work-groups run concurrently (pocl and
 * Intel's CPU runtime run them on a few threads), so a wait could hang.
 *
 * The ticket is OpenCL 1.2's pattern: each work-item's global writes, a
 * mem_fence, a barrier, then one atomic_inc per work-group. Every word
 * one work-group writes for another (the counts, the ranks) is written
 * and read with atomics, the only global accesses OpenCL 1.2 makes
 * coherent between the work-groups of a kernel (so no copy cached before
 * the ticket is read, as NVIDIA's L1 could hold, and oclgrind's race check
 * sees no race). It assumes that the fence and the ticket's atomic order
 * a work-item's earlier atomics for every work-group that sees the
 * ticket's result: OpenCL 1.2 promises each atomic's atomicity, not this
 * order between atomics on different words (the header says so). The
 * last work-group puts the ticket back to 0 for the next call; the host
 * zeroes it where the scratch is new.
 *
 * With FUSED_WG 1 (CPUs) no rank is stored: the last work-group, one
 * work-item, walks every slot in order with a running position per
 * expert (the host launches one work-group there, so nothing crosses
 * work-groups: bench/RESULTS.md). With more work-items the ranks are
 * stored, not recomputed, so that the last work-group's placement is one
 * pass without a rank loop.
 *
 * scratch: [0] the ticket, then the count matrix m[groups][E + 1], the
 * last work-group's prefixes of it (same shape), ranks[num_slots] and,
 * where the ids are this launch's own (moecl_route_dispatch's kernel,
 * cl/topk_gating.cl), each slot's column[num_slots]. run and start hold
 * E + 1 words each. */
#ifndef FUSED_WG
#define FUSED_WG 1
#endif

/* A word written by one work-group and read by another (see above). A
 * launch of one work-group (a decode batch) needs no atomics, nor a
 * ticket: its own barriers with global fences order its accesses, and
 * each atomic costs a round trip to the device's cache on GPUs. */
static inline bool alone(void) { return get_num_groups(0) == 1; }

static inline void shared_store(__global uint *p, uint v)
{
    if (alone())
        *p = v;
    else
        atomic_xchg((volatile __global uint *)p, v);
}

static inline uint shared_load(__global const uint *p)
{
    return alone() ? *p : atomic_or((volatile __global uint *)p, 0u);
}

/* Counts and (with more than one work-item) ranks of slots [begin, end)
 * by one work-group: run[e] ends as the chunk's count of column e. Where
 * columns is not 0 (ids written by this kernel: moecl_route_dispatch), each
 * slot's column goes there too, so that the last work-group reads it by
 * an atomic rather than another work-group's plain store. */
static inline void rank_chunk(__global const int *ids, uint begin, uint end, uint num_experts, uint lid,
                              __local uint *run, __local uint *tile, __global uint *ranks, __global uint *columns)
{
#if FUSED_WG == 1
    /* One work-item: the counts only; the last work-group walks every
     * slot in order itself (place_all), so no rank crosses work-groups. */
    (void)lid;
    (void)tile;
    (void)ranks;
    (void)columns;
    for (uint s = begin; s < end; s++)
        run[column_of(ids[s], num_experts)]++;
#else
    for (uint at = begin; at < end; at += FUSED_WG) {
        const uint s = at + lid;
        /* Past the end: a column no slot has. */
        const uint e = s < end ? column_of(ids[s], num_experts) : num_experts + 1;
        const uint rank = tile_rank(e, lid, tile);
        if (s < end) {
            shared_store(&ranks[s], run[e] + rank);
            if (columns)
                shared_store(&columns[s], e);
        }
        tile_advance(e, run, num_experts + 1);
    }
#endif
}

/* Whether this work-group is the last to finish its chunk; the last one
 * puts the ticket back to 0 (every other work-group has taken its ticket
 * by then). */
static inline bool last_to_finish(volatile __global uint *ticket, uint groups, uint lid, __local uint *flag)
{
    mem_fence(CLK_GLOBAL_MEM_FENCE); /* this work-item's counts and ranks before the ticket */
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    if (lid == 0) {
        const uint t = alone() ? 0u : atomic_inc(ticket);
        *flag = t == groups - 1;
        if (t == groups - 1 && !alone())
            atomic_xchg(ticket, 0u);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const bool last = *flag;
    mem_fence(CLK_GLOBAL_MEM_FENCE); /* the ticket before the reads of the others' writes */
    return last;
}

/* Per column, each chunk's exclusive prefix over the chunks before it
 * (prefix, beside the matrix) and the column's total (tot), by one
 * work-group: adjacent work-items walk adjacent columns. */
static inline void scan_columns(__global const uint *matrix, __global uint *prefix, uint groups, uint cols,
                                uint lid, __local uint *tot)
{
    for (uint e = lid; e < cols; e += FUSED_WG) {
        uint acc = 0;
        for (uint c0 = 0; c0 < groups; c0 += LOAD_BATCH) {
            uint count[LOAD_BATCH];
            UNROLL
            for (uint j = 0; j < LOAD_BATCH; j++)
                count[j] = c0 + j < groups ? shared_load(&matrix[(size_t)(c0 + j) * cols + e]) : 0u;
            UNROLL
            for (uint j = 0; j < LOAD_BATCH; j++) {
                if (c0 + j < groups)
                    prefix[(size_t)(c0 + j) * cols + e] = acc;
                acc += count[j];
            }
        }
        tot[e] = acc;
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
}

/* Every slot to its position, by the last work-group (a slot's column
 * from columns where rank_chunk stored them there). */
#if FUSED_WG == 1
/* One work-item walks the slots in order; start becomes each expert's
 * next position. */
static inline void place_all(__global const int *ids, uint num_slots, uint num_experts, uint chunk, uint lid,
                             __local uint *start, __global const uint *prefix,
                             __global const uint *ranks, __global const uint *columns, __global int *sorted,
                             ulong sorted_off, __global int *slot_positions, ulong slot_off, uint has_slots)
{
    (void)chunk;
    (void)lid;
    (void)prefix;
    (void)ranks;
    (void)columns;
    for (uint s = 0; s < num_slots; s++) {
        const uint e = column_of(ids[s], num_experts);
        int pos = -1;
        if (e < num_experts) {
            pos = (int)start[e]++;
            sorted[sorted_off + pos] = (int)s;
        }
        if (has_slots)
            slot_positions[slot_off + s] = pos;
    }
}
#else
/* A slot's position is its expert's start + the expert's slots in earlier
 * chunks + its rank; each work-item takes LOAD_BATCH slots a round. */
static inline void place_all(__global const int *ids, uint num_slots, uint num_experts, uint chunk, uint lid,
                             __local uint *start, __global const uint *prefix,
                             __global const uint *ranks, __global const uint *columns, __global int *sorted,
                             ulong sorted_off, __global int *slot_positions, ulong slot_off, uint has_slots)
{
    const uint cols = num_experts + 1;
    for (uint s0 = lid; s0 < num_slots; s0 += FUSED_WG * LOAD_BATCH) {
        uint e[LOAD_BATCH], rank[LOAD_BATCH];
        UNROLL
        for (uint j = 0; j < LOAD_BATCH; j++) {
            const uint s = s0 + j * FUSED_WG;
            const bool in = s < num_slots;
            e[j] = !in ? num_experts : columns ? shared_load(&columns[s]) : column_of(ids[s], num_experts);
            rank[j] = in ? shared_load(&ranks[s]) : 0u;
        }
        UNROLL
        for (uint j = 0; j < LOAD_BATCH; j++) {
            const uint s = s0 + j * FUSED_WG;
            int pos = -1;
            if (s < num_slots && e[j] < num_experts) {
                pos = (int)(start[e[j]] + prefix[(size_t)(s / chunk) * cols + e[j]] + rank[j]);
                sorted[sorted_off + pos] = (int)s;
            }
            if (s < num_slots && has_slots)
                slot_positions[slot_off + s] = pos;
        }
    }
}
#endif

/* The fused kernel's steps, by every work-group of a launch: work-group c
 * counts and ranks slots [c * chunk, (c + 1) * chunk) of ids, takes a
 * ticket, and the last one does the rest. part and tile hold FUSED_WG
 * words, run and start E + 1; columns as for rank_chunk (0: read ids). */
static inline void fused_align(__global const int *ids, uint num_slots, uint num_experts, uint chunk,
                               uint block_size, __global uint *scratch, __global int *counts, ulong counts_off,
                               __global int *sorted, ulong sorted_off, __global int *blocks, ulong blocks_off,
                               __global int *post_padded, ulong post_off, __global int *slot_positions,
                               ulong slot_off, uint has_slots, __global int *num_invalid, ulong invalid_off,
                               uint has_invalid, __local uint *run, __local uint *start, __local uint *part,
                               __local uint *flag, __local uint *tile, bool store_columns)
{
    const uint lid = get_local_id(0), c = get_group_id(0), groups = get_num_groups(0), cols = num_experts + 1;
    /* As moecl_moe_align_max_padded (kernel arguments are at most
     * MOECL_MAX_KERNEL_ARGS, src/internal.h). */
    const uint max_padded = num_slots + num_experts * (block_size - 1), num_blocks = max_padded / block_size;
    __global uint *matrix = scratch + 1, *prefix = matrix + (size_t)groups * cols;
    __global uint *ranks = prefix + (size_t)groups * cols;
    __global uint *columns = store_columns ? ranks + num_slots : 0;

    for (uint e = lid; e < cols; e += FUSED_WG)
        run[e] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = min(c * chunk, num_slots), end = min(begin + chunk, num_slots);
    rank_chunk(ids, begin, end, num_experts, lid, run, tile, ranks, columns);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint e = lid; e < cols; e += FUSED_WG)
        shared_store(&matrix[(size_t)c * cols + e], run[e]);

    /* Every work-group meets the same barriers: the others run the last
     * one's steps over nothing (pocl 3.1 computed wrong results with these
     * barriers under a branch on the ticket, bench/RESULTS.md). */
    const bool last = last_to_finish(scratch, groups, lid, flag);
    const uint live_experts = last ? num_experts : 0;
    scan_columns(matrix, prefix, last ? groups : 0, last ? cols : 0, lid, run);
    const uint post = padded_starts(run, start, part, FUSED_WG, lid, live_experts, block_size, counts, counts_off,
                                    post_padded, post_off, num_invalid, invalid_off, has_invalid, last);
    if (last) {
        pad_and_blocks(run, start, post, FUSED_WG, lid, num_slots, num_experts, block_size, max_padded, num_blocks,
                       sorted, sorted_off, blocks, blocks_off);
        place_all(ids, num_slots, num_experts, chunk, lid, start, prefix, ranks, columns, sorted, sorted_off,
                  slot_positions, slot_off, has_slots);
    }
}

__kernel __attribute__((reqd_work_group_size(FUSED_WG, 1, 1)))
void moe_align_fused(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint chunk,
                     uint block_size, __global uint *scratch,
                     __global int *counts, ulong counts_off, __global int *sorted, ulong sorted_off,
                     __global int *blocks, ulong blocks_off, __global int *post_padded, ulong post_off,
                     __global int *slot_positions, ulong slot_off, uint has_slots, __global int *num_invalid,
                     ulong invalid_off, uint has_invalid, __local uint *run, __local uint *start)
{
    __local uint part[FUSED_WG];
    __local uint flag;
#if FUSED_WG > 1
    __local uint tile[FUSED_WG];
#else
    __local uint *tile = part; /* unused */
#endif
    fused_align(ids + ids_off, num_slots, num_experts, chunk, block_size, scratch, counts, counts_off, sorted,
                sorted_off, blocks, blocks_off, post_padded, post_off, slot_positions, slot_off, has_slots,
                num_invalid, invalid_off, has_invalid, run, start, part, &flag, tile, false);
}

/* The gating pipeline (docs/routing.md, section 2, steps 1-5), shared by
 * top-k gating (cl/topk_gating.cl) and the grounded router
 * (cl/grounded_router.cl): a row of logits x becomes ids and weights, one
 * function per step of the spec. Specialised at build time:
 *   NUM_EXPERTS, TOPK          the shape
 *   SCORING                    0 softmax, 1 sigmoid, 2 sqrt(softplus), 3 the
 *                              logit itself (moecl_scoring)
 *   WEIGHTING                  (absent: 0) what the chosen weigh: 0 their
 *                              score, 1 a softmax over their logits, 2
 *                              the sigmoid of their logits (moecl_weighting)
 *   HAS_BIAS                   correction bias steers selection only
 *   NUM_GROUPS, TOPK_GROUP     group-limited selection (NUM_GROUPS 0: none)
 *   GROUP_SCORE                0 max, 1 sum of the top two
 *   RENORMALIZE                divide the weights by their sum when > 0
 *   RENORM_FLOOR               (absent: none) divide by max(sum, floor)
 *   GROUP_FILL                 0 (absent): dropped groups never selected;
 *                              1: their selection score is 0.0 (below)
 *   TEAM, ROWS, EPT            launch shape (common.cl)
 * Two layouts: TEAM == 1, one work-item per row with the row in private
 * float8 blocks (rows_pipeline); TEAM > 1, the row in the registers of
 * TEAM work-items, EPT elements each (TEAM_GATING). */

#ifndef SCORING
#define SCORING 0
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef RENORMALIZE
#define RENORMALIZE 0
#endif
#ifndef GROUP_SCORE
#define GROUP_SCORE 0
#endif
#ifndef TOPK_GROUP
#define TOPK_GROUP 0
#endif
#ifndef NUM_GROUPS
#define NUM_GROUPS 0
#endif
#ifndef GROUP_FILL
#define GROUP_FILL 0
#endif
#ifndef WEIGHTING
#define WEIGHTING 0
#endif

#define GROUP_SIZE (NUM_GROUPS > 0 ? NUM_EXPERTS / NUM_GROUPS : NUM_EXPERTS)

/* Step 1, the score: softmax takes the row's max over the non-NaN logits
 * and the sum of exp(x - max); NaN and inf propagate as IEEE arithmetic
 * makes them (any NaN or +inf logit makes the whole row NaN). Each kernel
 * computes softmax in its own layout below; the scorings of one logit
 * are elementwise_score. */

/* sqrt(softplus(x)), softplus(x) = x above 20 and log1p(exp(x)) below
 * (PyTorch's threshold): NaN stays NaN, -inf gives 0, +inf gives +inf.
 * Plain exp, not EXP: the bound of section 4 assumes it. */
static inline float sqrt_softplus(float x)
{
    return sqrt(x > 20.0f ? x : log1p(exp(x)));
}

/* The score of one logit for the elementwise scorings (not softmax):
 * sigmoid 1 / (1 + exp(-x)), sqrt(softplus(x)), or x itself. */
static inline float elementwise_score(float x)
{
#if SCORING == 2
    return sqrt_softplus(x);
#elif SCORING == 3
    return x;
#else
    return 1.0f / (1.0f + EXP(-x));
#endif
}

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
#define ZERO_FILLED_WEIGHTS (NUM_GROUPS > 0 && GROUP_FILL == 1 && !HAS_BIAS && WEIGHTING == 0)

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

/* Step 5, what the chosen weigh before renormalising (WEIGHTING), on k
 * values in slot order in private memory: their scores as they are
 * (WEIGHTING 0); with 1 and 2 they hold the chosen logits and become a
 * softmax over them (max-subtracted, M the largest non-NaN one, the sum
 * in slot order: the grounded router's rule, so its bits) or each one's
 * sigmoid. */
static inline void chosen_weights_of(float *w, uint k)
{
#if WEIGHTING == 1
    float m = -INFINITY;
    for (uint j = 0; j < k; j++)
        m = fmax(m, w[j]);
    float sum = 0.0f;
    for (uint j = 0; j < k; j++) {
        w[j] = exp(w[j] - m);
        sum += w[j];
    }
    for (uint j = 0; j < k; j++)
        w[j] = w[j] / sum;
#elif WEIGHTING == 2
    for (uint j = 0; j < k; j++)
        w[j] = 1.0f / (1.0f + EXP(-w[j]));
#else
    (void)w;
    (void)k;
#endif
}

#if TEAM == 1
/* The row is processed in blocks of eight experts as float8 vectors, so a
 * CPU driver runs exp and the comparisons in SIMD registers. The last,
 * partial block goes through the same vector code (padded), so equal inputs
 * give equal scores wherever they sit in the row. */
#define BLOCK LAYOUT_ROWS_BLOCK
#define BLOCKS LAYOUT_ROWS_BLOCKS(NUM_EXPERTS)

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

/* Step 1: the row's scores from its logits (padding lanes 0). Softmax:
 * the row's max (padding left out), then exp(x - max) once per element,
 * kept, and their sum (padding adds nothing); the sum's order is fixed,
 * so the bits are too. */
static inline void rows_scores(const float8 *logit, float8 *score)
{
#if SCORING == 0
    float8 max8 = (float8)(-INFINITY);
    for (uint b = 0; b < BLOCKS; b++)
        max8 = fmax(max8, select(logit[b], (float8)(-INFINITY), past_end(b)));
    const float row_max = fmax(fmax(fmax(max8.s0, max8.s1), fmax(max8.s2, max8.s3)),
                               fmax(fmax(max8.s4, max8.s5), fmax(max8.s6, max8.s7)));
    float8 sum8 = (float8)(0.0f);
    for (uint b = 0; b < BLOCKS; b++) {
        score[b] = exp(logit[b] - row_max);
        sum8 += select(score[b], (float8)(0.0f), past_end(b));
    }
    const float row_sum = ((sum8.s0 + sum8.s1) + (sum8.s2 + sum8.s3)) + ((sum8.s4 + sum8.s5) + (sum8.s6 + sum8.s7));
    for (uint b = 0; b < BLOCKS; b++)
        score[b] = score[b] / row_sum;
#elif SCORING == 1
    for (uint b = 0; b < BLOCKS; b++)
        score[b] = 1.0f / (1.0f + exp(-logit[b]));
#else
    for (uint b = 0; b < BLOCKS; b++) {
        float t[BLOCK];
        vstore8(logit[b], 0, t);
        for (uint l = 0; l < BLOCK; l++)
            t[l] = elementwise_score(t[l]);
        score[b] = vload8(0, t);
    }
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
 * the complemented index), with each chosen expert's value (its score,
 * or its logit for WEIGHTING 1 and 2) as its weight.
 * A block is looked at lane by lane only when one of its ranks could
 * still enter: experts come in index order, so an equal rank never beats
 * the list's last entry. dropped(e): expert e's group is dropped (the
 * plain fill: never selected). */
static inline void rows_topk(const float8 *value, const uint8 *rank, const uint *block_max, uint floor_rank,
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
        vstore8(value[b], 0, w);
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

/* Step 5: the weighting, renormalise and scale; the row's ids. */
static inline void rows_final(const ulong *keys, float *weights, float scaling_factor, uint *ids)
{
    chosen_weights_of(weights, TOPK);
    float divisor;
    WEIGHTS_DIVISOR(divisor, weights, TOPK);
    for (uint j = 0; j < TOPK; j++) {
        weights[j] = weights[j] / divisor * scaling_factor;
        ids[j] = key_index(keys[j]);
    }
}

/* Steps 1-5 on a row of logits in private blocks (padding lanes 0): the
 * row's final weights and ids, in slot order, for the kernel to write. */
static inline void rows_pipeline(const float8 *logit, __global const float *bias, float scaling_factor,
                                 float *weights, uint *ids)
{
    float8 score[BLOCKS];
    rows_scores(logit, score);
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
    rows_topk(WEIGHTING == 0 ? score : logit, rank, block_max, floor_rank, group_key, threshold, keys, weights);
    rows_final(keys, weights, scaling_factor, ids);
}

#else
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
    return SCORING == 0 ? team_softmax_score(x, row_max, sum_term) : elementwise_score(x);
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
        /* WEIGHTING 1 and 2 weigh the chosen logits: team_write_row. */
        if (WEIGHTING == 0 && id != 0xffffffffu)
            weights[j] = team_score(weights[j], row_max, sum_term);
        /* Zero fill without a bias: the fill replaced a dropped expert's
         * score, which is its weight. */
        if (ZERO_FILLED_WEIGHTS && id != 0xffffffffu && !kept[id / GROUP_SIZE])
            weights[j] = 0.0f;
    }
}

/* Step 5, the rest: the weighting, renormalise and scale, into weights[]
 * (private, the whole row: every lane takes all of it, no barrier until
 * it is written, see step 1). */
static inline void team_final_weights(__local const float *chosen, float scaling_factor, float *weights)
{
    for (uint j = 0; j < TOPK; j++)
        weights[j] = chosen[j];
    chosen_weights_of(weights, TOPK);
    float divisor;
    WEIGHTS_DIVISOR(divisor, weights, TOPK);
    for (uint j = 0; j < TOPK; j++)
        weights[j] = weights[j] / divisor * scaling_factor;
}

/* The pipeline's local memory for the ROWS rows of a work-group
 * (cl/layout.h, LAYOUT_TOPK_TEAM_ROW_BYTES), declared at kernel scope
 * (OpenCL C allows __local variables only there); each GATE_* macro below
 * is row r's share. The softmax's slots for the max and sum: none with
 * shuffles, none for the elementwise scorings (nothing to reduce). */
#if TEAM_SHUFFLE || SCORING != 0
#define GATE_FLOAT_SLOTS_DECL
#define GATE_FLOAT_SLOTS(r) ((__local float *)0)
#else
#define GATE_FLOAT_SLOTS_DECL __local float gate_float_slots[ROWS * TEAM];
#define GATE_FLOAT_SLOTS(r) (gate_float_slots + (r) * TEAM)
#endif
#if NUM_GROUPS > 0
#if GROUP_PARTS > 1
#define GATE_PARTS_DECL                                                                            \
    __local float gate_part_first[ROWS * TEAM];                                                    \
    __local float gate_part_second[ROWS * TEAM];                                                   \
    __local uint gate_part_count[ROWS * TEAM];
#define GATE_PARTS(r) gate_part_first + (r) * TEAM, gate_part_second + (r) * TEAM, gate_part_count + (r) * TEAM
#else
#define GATE_PARTS_DECL
#define GATE_PARTS(r) (__local float *)0, (__local float *)0, (__local uint *)0
#endif
#define GATE_GROUPS_DECL                                                                           \
    __local float gate_selection[ROWS * NUM_EXPERTS];                                              \
    __local ulong gate_group_keys[ROWS * NUM_GROUPS];                                              \
    __local uchar gate_group_kept[ROWS * NUM_GROUPS];                                              \
    GATE_PARTS_DECL
#define GATE_SELECTION(r) (gate_selection + (r) * NUM_EXPERTS)
#define GATE_KEPT(r) (gate_group_kept + (r) * NUM_GROUPS)
#else
#define GATE_GROUPS_DECL
#define GATE_SELECTION(r) ((__local float *)0)
#define GATE_KEPT(r) ((__local uchar *)0)
#endif
#define TEAM_GATING_LOCALS                                                                         \
    GATE_FLOAT_SLOTS_DECL                                                                          \
    GATE_GROUPS_DECL                                                                               \
    TEAM_TOPK_LOCALS;                                                                              \
    __local float gate_chosen[ROWS * TOPK];                                                        \
    __local uint gate_ids[ROWS * TOPK]
/* Row r's chosen ids after TEAM_GATING (0xffffffff: a slot no candidate
 * filled, which cannot happen). */
#define GATE_IDS(r) (gate_ids + (r) * TOPK)

/* Steps 1-5 for row r of the work-group, whose logits are value[EPT] in
 * the registers of its TEAM lanes (element i * TEAM + lane; the caller
 * loads them, 0 for padding and inactive rows): GATE_IDS(r) gets the ids
 * and weights (private float[TOPK]) every lane's copy of the row's final
 * weights, in slot order; bias is NULL without HAS_BIAS. Every work-item
 * of the work-group runs it (barriers), active or not; it ends with a
 * barrier, so GATE_IDS(r) can be read at once. A macro for the kernel
 * scope locals of TEAM_GATING_LOCALS. */
#define TEAM_GATING(value, active, lane, r, bias, scaling_factor, weights)                         \
    do {                                                                                           \
        float row_max_, sum_term_;                                                                 \
        team_score_terms(value, lane, GATE_FLOAT_SLOTS(r), &row_max_, &sum_term_);                 \
        uint rank_[EPT];                                                                           \
        team_selection_ranks(value, active, lane, bias, row_max_, sum_term_, rank_, GATE_SELECTION(r)); \
        TEAM_GATING_GROUPS(rank_, lane, r);                                                        \
        /* Step 4: the top-k of the ranks; gate_chosen gets the chosen logits. */                 \
        team_topk(rank_, value, TEAM_TOPK_SCRATCH(r), lane, GATE_IDS(r), gate_chosen + (r) * TOPK); \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
        team_chosen_weights(lane, row_max_, sum_term_, GATE_IDS(r), gate_chosen + (r) * TOPK, GATE_KEPT(r)); \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
        team_final_weights(gate_chosen + (r) * TOPK, scaling_factor, weights);                     \
    } while (0)
#if NUM_GROUPS > 0
#define TEAM_GATING_GROUPS(rank, lane, r)                                                          \
    team_group_limit(rank, lane, GATE_SELECTION(r), gate_group_keys + (r) * NUM_GROUPS, GATE_KEPT(r), GATE_PARTS(r))
#else
#define TEAM_GATING_GROUPS(rank, lane, r) ((void)0)
#endif
#endif

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
#ifndef HAS_LOGITS
#define HAS_LOGITS 1
#endif
/* g from the dot product: the router logit plus alpha times it, or alpha
 * times it alone. */
#if HAS_LOGITS
#define G_OF(logit, dot) ((logit) + alpha * (dot))
#define LOGIT_AT(t, e) logits[(size_t)(t)*NUM_EXPERTS + (e)]
#else
#define G_OF(logit, dot) (alpha * (dot))
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

/* Output slot j of a row: its id and final weight (private values). */
static inline void write_output(uint j, uint id, float w, uint row, __global float *pairs, __global float *weights,
                                __global int *ids)
{
    const size_t at = (size_t)row * TOPK + j;
#if HAS_PAIRS
    pairs[2 * at] = (float)id;
    pairs[2 * at + 1] = w;
#endif
#if HAS_WEIGHTS
    weights[at] = w;
#endif
#if HAS_IDS
    ids[at] = (int)id;
#endif
}

#define OUTPUT_PARAMS                                                                              \
    __global const float *bias, ulong bias_off, __global float *pairs, ulong pairs_off, __global float *weights,   \
        ulong weights_off, __global int *ids, ulong ids_off, uint num_tokens, float alpha, float scaling_factor

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
#define MB (TM < 8 ? TM : 8) /* tokens of a register block */
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
#define HC 1024 /* hidden chunk (a multiple of 16) */
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
 * instructions of sixteen separate sum16 calls). */
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
    float16 acc[MB][RN];
#pragma unroll
    for (uint m = 0; m < MB; m++)
#pragma unroll
        for (uint n = 0; n < RN; n++)
            acc[m][n] = (float16)(0.0f);
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
                acc[m][n] = fma(h, w[n], acc[m][n]);
        }
    }
#if MB * RN == 16
    float sums[16];
    vstore16(sum16_of_16(&acc[0][0]), 0, sums);
#define SUM_OF(m, n) sums[(m) * RN + (n)]
#else
#define SUM_OF(m, n) sum16(acc[m][n])
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
            write_output(j, id[j], w[j], t0 + m, pairs, weights, ids);
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
    if (active)
        for (uint j = lane; j < TOPK; j += TEAM)
            write_output(j, GATE_IDS(r)[j], w[j], row, pairs, weights, ids);
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
    /* One panel: the plain form, to which NVIDIA's compiler gave fewer
     * registers than the general one (bench/RESULTS.md). */
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
            write_output(j, id[j], w[j], row0 + lid, pairs, weights, ids);
    }
}
#endif

