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
        fused_align((ids), (num_tokens) * ROW_SLOTS, ID_EXPERTS, ROWS * ROW_SLOTS, dargs.block_size, scratch, \
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
