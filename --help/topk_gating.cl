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

/* Top-k gating (docs/routing.md, section 1): the gating pipeline of
 * cl/gating.cl over rows of logits read from global memory, with its
 * defines (the shape, SCORING, WEIGHTING, HAS_BIAS, groups,
 * renormalisation) and these:
 *   HAS_COUNTS                 also count the chosen ids per expert (below)
 *   TEAM, ROWS                 launch shape (common.cl)
 * Two kernels: topk_gating_rows (TEAM == 1, for CPUs: one work-item per
 * row, plain loops over the row) and topk_gating_team (TEAM > 1, for GPUs:
 * the row lives in the registers of TEAM work-items, EPT elements each). */

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
#if TEAM == 1
/* ---------------------------------------------------------------------- */
/* One work-item per row (CPU devices).                                    */
/* ---------------------------------------------------------------------- */

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
#if SCORING == 0 && WEIGHTING == 0 && !HAS_BIAS && NUM_GROUPS == 0 && CPU_DEVICE
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
/* The generic loop, cl/gating.cl's rows_pipeline: every scoring,
 * weighting, bias and grouping. */
static inline void topk_rows_generic(__global const in_t *x, __global const float *bias, __global float *w_out,
                                     __global int *id_out, float scaling_factor COUNTS_PARAMS)
{
    float8 logit[BLOCKS];
    for (uint b = 0; b < BLOCKS; b++)
        logit[b] = load_block(x, b * BLOCK, 0.0f);
    float weights[TOPK];
    uint ids[TOPK];
    rows_pipeline(logit, bias, scaling_factor, weights, ids);
    for (uint j = 0; j < TOPK; j++) {
        w_out[j] = weights[j];
        id_out[j] = (int)ids[j];
        COUNT_ID(ids[j]);
    }
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

__kernel __attribute__((reqd_work_group_size(TEAM * ROWS, 1, 1))) void
topk_gating_team(__global const in_t *gating, BIAS_PARAM __global float *topk_weights, __global int *topk_ids,
                 COUNTS_PARAM layout_topk_args args DISPATCH_PARAMS)
{
    DISPATCH_LOCALS;
    TEAM_GATING_LOCALS;
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
    float weights[TOPK];
    TEAM_GATING(value, active, lane, r, BIAS_AT(args), args.scaling_factor, weights);
    if (active) {
        __global float *w_out = topk_weights + args.weights_off + (size_t)row * TOPK;
        __global int *id_out = topk_ids + args.ids_off + (size_t)row * TOPK;
        for (uint j = lane; j < TOPK; j += TEAM) {
            w_out[j] = weights[j];
            id_out[j] = (int)GATE_IDS(r)[j];
            COUNT_ID(GATE_IDS(r)[j]);
        }
    }
    DISPATCH_AFTER_ROWS(topk_ids + args.ids_off, args.num_tokens);
}
#endif

