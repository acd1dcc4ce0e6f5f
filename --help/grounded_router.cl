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

/* Grounded router on tensor cores (docs/routing.md, section 4): the GEMM
 * hidden @ ground^T through mma.sync with fp32 accumulation, then the same
 * g = router_logits + alpha * dot, top-k and softmax as grounded_router.cl
 * (whose helpers this file uses: it comes after it in the program).
 * Specialised at build time, besides grounded_router.cl's defines:
 *   KERNEL == 3                     this kernel
 *   PRECISION                       f32 only: 1 TF32, 2 3xTF32
 *   MMA_MI, MMA_NT                  a warp's m16 tiles and n8 tiles
 *   MMA_WM, MMA_WN                  warps along the tokens and the experts
 *   MMA_KW                          32-bit words of a row per k step
 *   MMA_EMULATE                     1: every mma instruction is replaced by
 *                                   a function that does what the PTX ISA
 *                                   says it does with the same per-lane
 *                                   fragments (portable; the default
 *                                   without MOECL_PTX)
 * A work-group of MMA_WM x MMA_WN warps computes TM = 16 MMA_MI MMA_WM
 * tokens by TN = 8 MMA_NT MMA_WN >= NUM_EXPERTS experts in one pass, so a
 * token's row of g is whole in local memory at the end. The hidden
 * dimension is streamed through two local stages, with the global loads
 * of the next two steps in registers while the current one is multiplied
 * (one barrier a step). Local memory holds 32-bit words: two f16/bf16
 * elements, or one f32; then the fragment of every lane is the same word
 * pattern for
 * m16n8k16 (16-bit) and m16n8k8 (tf32). */

#if KERNEL == 3

#ifndef MMA_EMULATE
#define MMA_EMULATE (!MOECL_PTX)
#endif
#if !MMA_EMULATE && !MOECL_PTX
#error "grounded_router_mma without MMA_EMULATE needs MOECL_PTX"
#endif
#ifndef PRECISION
#define PRECISION 0
#endif
#if IN_DTYPE == 0 && PRECISION != 1 && PRECISION != 2
#error "grounded_router_mma on f32 needs PRECISION 1 (TF32) or 2 (3xTF32)"
#endif

#define MMA_TM (16 * MMA_MI * MMA_WM)
#define MMA_TN (8 * MMA_NT * MMA_WN)
#define MMA_WG (32 * MMA_WM * MMA_WN)
#define MMA_EPW (IN_DTYPE == 0 ? 1 : 2) /* elements a word */
#define MMA_KS (MMA_KW + 4)             /* row stride in words: lanes 4g + t hit distinct banks */
#define MMA_STEP (MMA_KW * MMA_EPW)     /* hidden elements a k step */
#define MMA_KSTEPS ((HIDDEN_DIM + MMA_STEP - 1) / MMA_STEP)
#define MMA_VEC_ROW (MMA_KW / 4)        /* 4-word vectors a row of a stage */
#define MMA_VECS ((MMA_TM + MMA_TN) * MMA_VEC_ROW)
#define MMA_VPT ((MMA_VECS + MMA_WG - 1) / MMA_WG)
#define MMA_GS (MMA_TN + 1) /* stride of the g rows */

#if MMA_TN < NUM_EXPERTS
#error "grounded_router_mma: the experts must fit one pass (MMA_TN >= NUM_EXPERTS)"
#endif

/* ---- the instructions ------------------------------------------------ */

#if MMA_EMULATE
/* A warp's scratch: A (16 x 16) and B (16 x 8, k-major) as floats. */
#define MMA_EMU_FLOATS LAYOUT_MMA_EMU_FLOATS
#define MMA_EMU_ARGS , emu, lane
#define MMA_EMU_PARAMS , __local float *emu, uint lane

/* The float a 16-bit word stands for. */
static inline float mma_half_value(uint bits)
{
#if IN_DTYPE == 1
    const ushort h = (ushort)bits;
    return vload_half(0, (const half *)&h);
#else
    return as_float(bits << 16);
#endif
}

/* D = A B + C for the warp: each lane scatters its fragment registers to
 * where the PTX ISA's layout puts them (lane = 4 groupID + threadID),
 * then computes its four elements of D from the whole A and B, summing in
 * k order with fp32 roundings (the products are exact in fp32). Every
 * work-item of the work-group calls this in lockstep: it holds barriers. */
static inline void mma_emulated(float c[4], const uint a[4], const uint b[2], uint ksize MMA_EMU_PARAMS)
{
    const uint g = lane >> 2, t = lane & 3;
    __local float *A = emu;            /* [16][ksize] */
    __local float *B = emu + 16 * 16;  /* [ksize][8] */
    if (ksize == 16) {
        /* m16n8k16: a0 (g, 2t..2t+1), a1 (g+8, ..), a2 (g, 2t+8..), a3
         * (g+8, 2t+8..), the lower half the lower index; b0 (k 2t..2t+1,
         * n g), b1 (k 2t+8..). */
        for (uint i = 0; i < 4; i++) {
            const uint row = g + (i & 1) * 8, col = 2 * t + (i >> 1) * 8;
            A[row * 16 + col] = mma_half_value(a[i] & 0xffffu);
            A[row * 16 + col + 1] = mma_half_value(a[i] >> 16);
        }
        for (uint i = 0; i < 2; i++) {
            const uint k = 2 * t + i * 8;
            B[k * 8 + g] = mma_half_value(b[i] & 0xffffu);
            B[(k + 1) * 8 + g] = mma_half_value(b[i] >> 16);
        }
    } else {
        /* m16n8k8 tf32: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8,
         * t+4); b0 (k t, n g), b1 (k t+4, n g). */
        for (uint i = 0; i < 4; i++)
            A[(g + (i & 1) * 8) * 8 + t + (i >> 1) * 4] = as_float(a[i]);
        for (uint i = 0; i < 2; i++)
            B[(t + i * 4) * 8 + g] = as_float(b[i]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* c0, c1 (g, 2t..2t+1), c2, c3 (g+8, ..). */
    for (uint i = 0; i < 4; i++) {
        const uint row = g + (i >> 1) * 8, col = 2 * t + (i & 1);
        float d = c[i];
        for (uint k = 0; k < ksize; k++)
            d = fma(A[row * ksize + k], B[k * 8 + col], d);
        c[i] = d;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* cvt.rna.tf32.f32: round to nearest, ties away from zero (the magnitude
 * bits plus half of the dropped unit), 13 low mantissa bits cleared; inf
 * and NaN kept. */
static inline uint tf32_of(float x)
{
    const uint u = as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u)
        return u;
    return (u + 0x1000u) & 0xffffe000u;
}

#define MMA_K16(c, a, b) mma_emulated(c, a, b, 16 MMA_EMU_ARGS)
#define MMA_K8(c, a, b) mma_emulated(c, a, b, 8 MMA_EMU_ARGS)

#else /* the instructions themselves (MOECL_PTX) */
#define MMA_EMU_ARGS
#define MMA_EMU_PARAMS

#if IN_DTYPE == 1
#define MMA_K16_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#else
#define MMA_K16_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#endif

/* D = A B + C with the instruction op; the accumulators are separate
 * outputs and inputs (no read-write operands). */
#define MMA_DEFINE(name, op)                                                                       \
    static inline void name(float c[4], const uint a[4], const uint b[2])                          \
    {                                                                                              \
        float d0, d1, d2, d3;                                                                      \
        asm volatile(op " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"     \
                     : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)                                      \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), \
                       "f"(c[1]), "f"(c[2]), "f"(c[3]));                                           \
        c[0] = d0;                                                                                 \
        c[1] = d1;                                                                                 \
        c[2] = d2;                                                                                 \
        c[3] = d3;                                                                                 \
    }
MMA_DEFINE(mma_k16, MMA_K16_OP)
MMA_DEFINE(mma_k8, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")

static inline uint tf32_of(float x)
{
    uint r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

#define MMA_K16(c, a, b) mma_k16(c, a, b)
#define MMA_K8(c, a, b) mma_k8(c, a, b)
#endif

/* ---- the steps ------------------------------------------------------- */

/* 3xTF32's split: x = hi + lo with hi the tf32 of x and lo the tf32 of
 * the (exact) residual. A hi that rounds a finite x to inf is taken
 * truncated instead, and an infinite x has no residual, so that neither
 * turns a finite or infinite product into NaN. */
static inline void tf32_split(uint x, uint *hi, uint *lo)
{
    const float f = as_float(x);
    uint h = tf32_of(f);
    if (isinf(as_float(h)) && !isinf(f))
        h = x & 0xffffe000u;
    *hi = h;
    *lo = isinf(f) ? 0u : tf32_of(f - as_float(h));
}

/* Four words of row `row` (of `rows`) at word w of the step at element
 * k0: hidden elements k0 + w EPW .. , zero past the row count and the
 * hidden size. TF32 rounds here, once per element. aligned: the rows
 * start on 16 bytes (then one 16-byte load; vload's alignment is only the
 * element's, which NVIDIA's compiler splits into element loads). */
static inline uint4 mma_load4(__global const in_t *src, uint row, uint rows, uint k0, uint w, bool aligned)
{
    uint4 v = (uint4)(0u);
    const uint k = k0 + w * MMA_EPW;
    if (row >= rows || k >= HIDDEN_DIM)
        return v;
    __global const in_t *p = src + (size_t)row * HIDDEN_DIM;
    if (aligned && k + 4 * MMA_EPW <= HIDDEN_DIM) {
        v = *(__global const uint4 *)(p + k);
    } else if (k + 4 * MMA_EPW <= HIDDEN_DIM) {
#if IN_DTYPE == 0
        v = as_uint4(vload4(0, p + k));
#else
        v = as_uint4(vload8(0, p + k));
#endif
    } else {
        uint word[4] = {0u, 0u, 0u, 0u};
        for (uint e = 0; e < 4 * MMA_EPW && k + e < HIDDEN_DIM; e++)
#if IN_DTYPE == 0
            word[e] = as_uint(p[k + e]);
#else
            word[e / 2] |= (uint)p[k + e] << (16 * (e % 2));
#endif
        v = (uint4)(word[0], word[1], word[2], word[3]);
    }
#if IN_DTYPE == 0 && PRECISION == 1
    v = (uint4)(tf32_of(as_float(v.x)), tf32_of(as_float(v.y)), tf32_of(as_float(v.z)), tf32_of(as_float(v.w)));
#endif
    return v;
}

/* A step's hidden rows (TM) then ground rows (TN) from global memory into
 * registers: vector i of the step is row i / VEC_ROW, words 4 (i % VEC_ROW). */
static inline void mma_fetch(uint4 staged[MMA_VPT], __global const in_t *hidden, __global const in_t *ground,
                             uint row0, uint num_tokens, uint k0, uint lid, bool aligned)
{
    UNROLL
    for (uint v = 0; v < MMA_VPT; v++) {
        const uint i = lid + v * MMA_WG;
        const uint r = i / MMA_VEC_ROW, w = (i % MMA_VEC_ROW) * 4;
        if (i >= MMA_VECS)
            staged[v] = (uint4)(0u);
        else if (r < MMA_TM)
            staged[v] = mma_load4(hidden, row0 + r, num_tokens, k0, w, aligned);
        else
            staged[v] = mma_load4(ground, r - MMA_TM, NUM_EXPERTS, k0, w, aligned);
    }
}

/* The registers into a stage: rows 0..TM-1 hidden, then TN ground rows. */
static inline void mma_stage(const uint4 staged[MMA_VPT], __local uint *stage, uint lid)
{
    UNROLL
    for (uint v = 0; v < MMA_VPT; v++) {
        const uint i = lid + v * MMA_WG;
        if (i < MMA_VECS)
            vstore4(staged[v], 0, stage + (i / MMA_VEC_ROW) * MMA_KS + (i % MMA_VEC_ROW) * 4);
    }
}

/* One lane's fragment words of a 16-row (A) or 8-row (B) block at word w:
 * the same pattern for both instructions (see the file's comment). */
static inline void mma_frag_a(__local const uint *rows, uint w, uint g, uint t, uint a[4])
{
    a[0] = rows[g * MMA_KS + w + t];
    a[1] = rows[(g + 8) * MMA_KS + w + t];
    a[2] = rows[g * MMA_KS + w + t + 4];
    a[3] = rows[(g + 8) * MMA_KS + w + t + 4];
}

static inline void mma_frag_b(__local const uint *rows, uint w, uint g, uint t, uint b[2])
{
    b[0] = rows[g * MMA_KS + w + t];
    b[1] = rows[g * MMA_KS + w + t + 4];
}

/* The warp's tile of a stage: MMA_MI x MMA_NT mma per 8 words. */
static inline void mma_multiply(float acc[MMA_MI][MMA_NT][4], __local const uint *stage, uint wm, uint wn, uint g,
                                uint t MMA_EMU_PARAMS)
{
    __local const uint *arows = stage + wm * MMA_MI * 16 * MMA_KS;
    __local const uint *brows = stage + (MMA_TM + wn * MMA_NT * 8) * MMA_KS;
    for (uint w = 0; w < MMA_KW; w += 8) {
        uint a[MMA_MI][4];
        UNROLL
        for (uint i = 0; i < MMA_MI; i++)
            mma_frag_a(arows + i * 16 * MMA_KS, w, g, t, a[i]);
#if IN_DTYPE == 0 && PRECISION == 2
        /* 3xTF32: each fragment split once, not once per tile it meets
         * (inside the tile loops the splits kept the ALU busier than the
         * tensor cores: bench/RESULTS.md, the ncu profiles). */
        uint ah[MMA_MI][4], al[MMA_MI][4];
        UNROLL
        for (uint i = 0; i < MMA_MI; i++)
            UNROLL
            for (uint q = 0; q < 4; q++)
                tf32_split(a[i][q], &ah[i][q], &al[i][q]);
#endif
        UNROLL
        for (uint j = 0; j < MMA_NT; j++) {
            uint b[2];
            mma_frag_b(brows + j * 8 * MMA_KS, w, g, t, b);
#if IN_DTYPE == 0 && PRECISION == 2
            uint bh[2], bl[2];
            UNROLL
            for (uint q = 0; q < 2; q++)
                tf32_split(b[q], &bh[q], &bl[q]);
#endif
            UNROLL
            for (uint i = 0; i < MMA_MI; i++) {
#if IN_DTYPE != 0
                MMA_K16(acc[i][j], a[i], b);
#elif PRECISION == 1
                MMA_K8(acc[i][j], a[i], b);
#else
                /* The small products first, then hi * hi. */
                MMA_K8(acc[i][j], al[i], bh);
                MMA_K8(acc[i][j], ah[i], bl);
                MMA_K8(acc[i][j], ah[i], bh);
#endif
            }
        }
    }
}

/* Step s of the hidden loop: multiply the stage cur; stage step s + 1
 * (in the registers r) into next; fetch step s + 3 into r. A macro: as a
 * function taking r, Intel's CPU runtime gave wrong 3xTF32 results
 * (emulated, bench/RESULTS.md) where pocl and oclgrind agreed with the
 * reference. */
#define MMA_STEP_AT(cur, next, r, s)                                                               \
    do {                                                                                           \
        mma_multiply(acc, cur, wm, wn, g, t MMA_EMU_ARGS);                                         \
        if ((s) + 1 < MMA_KSTEPS)                                                                  \
            mma_stage(r, next, lid);                                                               \
        if ((s) + 3 < MMA_KSTEPS)                                                                  \
            mma_fetch(r, hidden, ground, row0, num_tokens, ((s) + 3) * MMA_STEP, lid, aligned);    \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
    } while (0)

/* g = logits + alpha * dot of the warp's accumulators into the g rows
 * (c0, c1: row g, columns 2t, 2t+1; c2, c3: row g + 8). */
static inline void mma_store_g(const float acc[MMA_MI][MMA_NT][4], __local float *g_rows, __global const float *logits,
                               uint row0, uint num_tokens, float alpha, uint wm, uint wn, uint g, uint t)
{
    UNROLL
    for (uint i = 0; i < MMA_MI; i++)
        UNROLL
        for (uint j = 0; j < MMA_NT; j++)
            UNROLL
            for (uint q = 0; q < 4; q++) {
                const uint m = (wm * MMA_MI + i) * 16 + g + (q >> 1) * 8;
                const uint e = (wn * MMA_NT + j) * 8 + 2 * t + (q & 1);
                const uint tok = row0 + m;
                if (tok < num_tokens && e < NUM_EXPERTS)
                    g_rows[m * MMA_GS + e] = G_OF(LOGIT_AT(tok, e), acc[i][j][q]);
            }
}

/* The gating of the work-group's rows of g, one work-item per token: each
 * row, whole in local memory (every expert of a token is in the tile), is
 * copied into private float8 blocks and goes through the rows pipeline of
 * cl/gating.cl (steps 1-5, every gating, the bias where there is one). The
 * one call site of the epilogue. */
static inline void mma_gate_rows(__local const float *g_rows, uint row0, uint num_tokens, uint lid,
                                 __global const float *bias, float scaling_factor, __global float *pairs,
                                 __global float *weights, __global int *ids)
{
    if (lid >= MMA_TM || row0 + lid >= num_tokens)
        return;
    float8 logit[BLOCKS];
    for (uint b = 0; b < BLOCKS; b++) {
        float v[8];
        for (uint q = 0; q < 8; q++) {
            const uint e = b * 8 + q;
            v[q] = e < NUM_EXPERTS ? g_rows[lid * MMA_GS + e] : 0.0f;
        }
        logit[b] = vload8(0, v);
    }
    float w[TOPK];
    uint id[TOPK];
    rows_pipeline(logit, bias, scaling_factor, w, id);
    for (uint j = 0; j < TOPK; j++)
        write_output(j, id[j], w[j], row0 + lid, pairs, weights, ids);
}

__kernel __attribute__((reqd_work_group_size(MMA_WG, 1, 1))) void
grounded_router_mma(__global const in_t *hidden, ulong hidden_off, __global const float *logits, ulong logits_off,
                    __global const in_t *ground, ulong ground_off, OUTPUT_PARAMS)
{
    /* Two stages, and after the hidden loop the g rows in the same words. */
    __local uint stages[LAYOUT_MMA_WORDS(MMA_TM, MMA_TN, MMA_KW)];
#if MMA_EMULATE
    __local float emu_all[MMA_WM * MMA_WN * MMA_EMU_FLOATS];
#endif
    const uint lid = get_local_id(0);
    const uint lane = lid % 32, warp = lid / 32;
    const uint wm = warp / MMA_WN, wn = warp % MMA_WN;
    const uint g = lane >> 2, t = lane & 3;
    const uint row0 = get_group_id(0) * MMA_TM;
#if MMA_EMULATE
    __local float *emu = emu_all + warp * MMA_EMU_FLOATS;
#endif
    OFFSET_OUTPUTS();
    /* Rows of a multiple of 16 bytes from 16-byte aligned bases (the
     * caller's offsets decide). */
    const bool aligned = (HIDDEN_DIM * sizeof(in_t)) % 16 == 0 && ((size_t)hidden & 15) == 0 &&
                         ((size_t)ground & 15) == 0;

    float acc[MMA_MI][MMA_NT][4];
    UNROLL
    for (uint i = 0; i < MMA_MI; i++)
        UNROLL
        for (uint j = 0; j < MMA_NT; j++)
            UNROLL
            for (uint q = 0; q < 4; q++)
                acc[i][j][q] = 0.0f;

    /* Two steps in flight from global memory: registers r0 and r1 take
     * the even and odd steps, and at step s the one holding step s + 1 is
     * staged into the local stage free since step s - 1, then reloaded
     * with step s + 3. The loop goes two steps at a time so that neither
     * set of registers is indexed at run time. */
    uint4 r0[MMA_VPT], r1[MMA_VPT];
    __local uint *const l0 = stages, *const l1 = stages + (MMA_TM + MMA_TN) * MMA_KS;
    mma_fetch(r0, hidden, ground, row0, num_tokens, 0, lid, aligned);
    mma_stage(r0, l0, lid);
    if (MMA_KSTEPS > 1)
        mma_fetch(r1, hidden, ground, row0, num_tokens, MMA_STEP, lid, aligned);
    if (MMA_KSTEPS > 2)
        mma_fetch(r0, hidden, ground, row0, num_tokens, 2 * MMA_STEP, lid, aligned);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = 0; s < MMA_KSTEPS; s += 2) {
        MMA_STEP_AT(l0, l1, r1, s);
        if (s + 1 < MMA_KSTEPS)
            MMA_STEP_AT(l1, l0, r0, s + 1);
    }

    __local float *g_rows = (__local float *)stages;
    mma_store_g(acc, g_rows, logits, row0, num_tokens, alpha, wm, wn, g, t);
    barrier(CLK_LOCAL_MEM_FENCE);
    mma_gate_rows(g_rows, row0, num_tokens, lid, bias, scaling_factor, pairs, weights, ids);
}
#endif

