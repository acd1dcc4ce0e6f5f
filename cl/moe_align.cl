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
 * sizes where a launch costs the host more than the work (NVIDIA's
 * OpenCL: one token 20.1 us in one launch against 36.0 for three).
 *
 * Build-time defines: WG (work-items of the count and scatter work-groups;
 * 1 on CPUs, where each chunk is then a plain loop), SCAN_WG (the scan's
 * work-group), ONE_WG (the one-group kernel's work-group) and HAS_MAP
 * (expert parallelism: the kernels that read ids take three more
 * arguments, MAP_KERNEL_PARAMS, and map each id where they read it;
 * column_of says how). Everything else is a kernel argument. OpenCL C 1.2 with no extensions: local
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

#ifndef HAS_MAP
#define HAS_MAP 0
#endif
/* HAS_MAP: the global-to-local expert map (int32[num_global], a local
 * expert or -1) follows every function that maps ids, as MAP_PARAM, and
 * every kernel that reads ids, as MAP_KERNEL_PARAMS (MAP_SETUP applies its
 * offset). Without it they are empty, so those variants are unchanged. */
#if HAS_MAP
#define MAP_PARAM , __global const int *expert_map, uint num_global
#define MAP_ARG , expert_map, num_global
#define MAP_KERNEL_PARAMS , __global const int *expert_map_base, ulong map_off, uint num_global
#define MAP_SETUP __global const int *expert_map = expert_map_base + map_off
/* Whether a column is counted: all but a remote expert's (E + 1). */
#define COUNTED(e, num_experts) ((e) <= (num_experts))
#else
#define MAP_PARAM
#define MAP_ARG
#define MAP_KERNEL_PARAMS
#define MAP_SETUP
#define COUNTED(e, num_experts) 1
#endif

/* The column of a slot's id: its expert, or E for an id outside [0, E).
 * With the map, the id is global: E where it is outside [0, num_global)
 * or its map entry is neither -1 nor a local expert (both counted in
 * num_invalid), E + 1 where the entry is -1 (another rank's expert:
 * skipped, not counted; the same column as a tile's slots past the end,
 * which no slot has either), else the entry. */
static inline uint column_of(int id, uint num_experts MAP_PARAM)
{
#if HAS_MAP
    if (id < 0 || (uint)id >= num_global)
        return num_experts;
    id = expert_map[id];
    if (id == -1)
        return num_experts + 1;
#endif
    return id >= 0 && (uint)id < num_experts ? (uint)id : num_experts;
}

/* The slots of [from, to) counted into hist per column by the n
 * work-items of a work-group (lid: this one's); a plain increment with one
 * work-item, local atomic_inc with more. */
static inline void count_slots(__global const int *ids, uint from, uint to, uint num_experts, uint lid, uint n,
                               __local uint *hist MAP_PARAM)
{
    for (uint s = from + lid; s < to; s += n) {
        const uint e = column_of(ids[s], num_experts MAP_ARG);
        if (!COUNTED(e, num_experts))
            continue;
        if (n == 1)
            hist[e]++;
        else
            atomic_inc(&hist[e]);
    }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void moe_align_count(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint chunk,
                     __global uint *matrix, __local uint *hist MAP_KERNEL_PARAMS)
{
    const uint lid = get_local_id(0), c = get_group_id(0), cols = num_experts + 1;
    ids += ids_off;
    MAP_SETUP;
    for (uint e = lid; e < cols; e += WG)
        hist[e] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = c * chunk, end = min(begin + chunk, num_slots);
    count_slots(ids, begin, end, num_experts, lid, WG, hist MAP_ARG);
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
 * columns, read one at a time: four at a time makes the scatter kernel
 * 1.2-2.3 us slower on the H200). Called by all n work-items; only those
 * whose slot is placed (needed) walk the tile, so that a tile of a few
 * slots (a decode batch) costs a few steps, not n. */
static inline uint tile_rank(uint e, uint lid, __local uint *tile, bool needed)
{
    tile[lid] = e;
    barrier(CLK_LOCAL_MEM_FENCE);
    uint rank = 0;
    for (uint j = 0; j < (needed ? lid : 0u); j++)
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

/* Slots [from, to) to their positions by one work-item walking them in
 * order: run[e] is expert e's next position (CPUs' placement, where a
 * work-group is one work-item). */
static inline void place_in_order(__global const int *ids, uint from, uint to, uint num_experts, __local uint *run,
                                  __global int *sorted, ulong sorted_off, __global int *slot_positions,
                                  ulong slot_off, uint has_slots MAP_PARAM)
{
    for (uint s = from; s < to; s++) {
        const uint e = column_of(ids[s], num_experts MAP_ARG);
        int pos = -1;
        if (e < num_experts) {
            pos = (int)run[e]++;
            sorted[sorted_off + pos] = (int)s;
        }
        if (has_slots)
            slot_positions[slot_off + s] = pos;
    }
}

/* One tile of the stable placement, called by all n work-items of a
 * work-group: work-item lid's slot (e: its column; past the end, a column
 * no slot has) goes to run[e] plus its rank in the tile; then run advances
 * past the tile's slots. */
static inline void place_tile(uint slot, uint e, bool in_range, uint lid, __local uint *tile, __local uint *run,
                              uint num_experts, __global int *sorted, ulong sorted_off, __global int *slot_positions,
                              ulong slot_off, uint has_slots)
{
    const uint rank = tile_rank(e, lid, tile, e < num_experts);
    int pos = -1;
    if (e < num_experts) {
        pos = (int)(run[e] + rank);
        sorted[sorted_off + pos] = (int)slot;
    }
    if (in_range && has_slots)
        slot_positions[slot_off + slot] = pos;
    tile_advance(e, run, num_experts);
}

/* A chunk's slots [begin, end) to their positions by the n work-items of
 * a work-group, stable: walked in order by one work-item, else in tiles of
 * n (tile: n words). run[e] starts at the chunk's first position of
 * expert e. */
static inline void place_chunk(__global const int *ids, uint begin, uint end, uint num_experts, uint lid, uint n,
                               __local uint *tile, __local uint *run, __global int *sorted, ulong sorted_off,
                               __global int *slot_positions, ulong slot_off, uint has_slots MAP_PARAM)
{
    if (n == 1) {
        place_in_order(ids, begin, end, num_experts, run, sorted, sorted_off, slot_positions, slot_off,
                       has_slots MAP_ARG);
        return;
    }
    for (uint base = begin; base < end; base += n) {
        const uint s = base + lid;
        /* Past the end: a column no slot has. */
        const uint e = s < end ? column_of(ids[s], num_experts MAP_ARG) : num_experts + 1;
        place_tile(s, e, s < end, lid, tile, run, num_experts, sorted, sorted_off, slot_positions, slot_off,
                   has_slots);
    }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void moe_align_scatter(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint chunk,
                       __global const uint *matrix, ulong starts_off, __global int *sorted,
                       ulong sorted_off, __global int *slot_positions, ulong slot_off, uint has_slots,
                       uint block_size, uint max_padded, uint num_blocks, __global int *blocks, ulong blocks_off,
                       __local uint *run MAP_KERNEL_PARAMS)
{
    const uint lid = get_local_id(0), c = get_group_id(0), cols = num_experts + 1;
    ids += ids_off;
    MAP_SETUP;
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
#if WG > 1
    __local uint tile[WG];
#else
    __local uint *tile = run; /* unused: one work-item walks the chunk */
#endif
    place_chunk(ids, begin, end, num_experts, lid, WG, tile, run, sorted, sorted_off, slot_positions, slot_off,
                has_slots MAP_ARG);
}

/* ---- one launch for small routings ---- */

/* The padded starts from the column totals tot[E + 1] in one work-group
 * of n work-items (part: n words): contiguous ranges of experts per
 * work-item, an inclusive scan of the ranges' sums (Hillis-Steele), then
 * each range's own prefix. Writes start[0..E] (start[E]: the padded
 * total) and, where publish is set, expert_counts,
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
        if (publish)
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
                         __local uint *tot, __local uint *start, __local ushort *slot_cols MAP_KERNEL_PARAMS)
{
    MAP_SETUP;
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
        const uint e = column_of(ids[s], num_experts MAP_ARG);
        if (COUNTED(e, num_experts))
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
        const uint e = column_of(ids[slot], num_experts MAP_ARG);
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
        const uint e = slot < num_slots ? column_of(ids[slot], num_experts MAP_ARG) : num_experts + 1;
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
 * work-groups: counts passed by atomics took 44-46 us at 129 x 128 on
 * pocl against 9-10 for the three kernels). With more work-items the
 * ranks are
 * stored, not recomputed, so that the last work-group's placement is one
 * pass without a rank loop.
 *
 * scratch: [0] the ticket, then the count matrix m[groups][E + 1], the
 * last work-group's prefixes of it (same shape) and ranks[num_slots]
 * (where the ids are this launch's own, moecl_route_dispatch's kernel,
 * cl/topk_gating.cl, each with its slot's column: rank_chunk). run and
 * start hold E + 1 words each. */
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
 * packed (ids written by this kernel: moecl_route_dispatch), each slot's
 * column goes into its rank's word (LAYOUT_DISPATCH_COLUMN_BITS,
 * cl/layout.h), so that the last work-group reads both by one atomic
 * rather than another work-group's plain store. */
static inline void rank_chunk(__global const int *ids, uint begin, uint end, uint num_experts, uint lid,
                              __local uint *run, __local uint *tile, __global uint *ranks, bool packed MAP_PARAM)
{
#if FUSED_WG == 1
    /* One work-item: the counts only; the last work-group walks every
     * slot in order itself (place_all), so no rank crosses work-groups. */
    (void)lid;
    (void)tile;
    (void)ranks;
    (void)packed;
    count_slots(ids, begin, end, num_experts, 0, 1, run MAP_ARG);
#else
    for (uint at = begin; at < end; at += FUSED_WG) {
        const uint s = at + lid;
        /* Past the end: a column no slot has. */
        const uint e = s < end ? column_of(ids[s], num_experts MAP_ARG) : num_experts + 1;
        const uint rank = tile_rank(e, lid, tile, e < num_experts);
        if (s < end) {
            /* A remote expert's slot has no run (and no position). */
            const uint r = COUNTED(e, num_experts) ? run[e] + rank : 0u;
            shared_store(&ranks[s], packed ? r << LAYOUT_DISPATCH_COLUMN_BITS | e : r);
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
 * from its rank's word where packed). */
#if FUSED_WG == 1
/* One work-item walks the slots in order; start becomes each expert's
 * next position. */
static inline void place_all(__global const int *ids, uint num_slots, uint num_experts, uint chunk, uint lid,
                             __local uint *start, __global const uint *prefix,
                             __global const uint *ranks, bool packed, __global int *sorted,
                             ulong sorted_off, __global int *slot_positions, ulong slot_off,
                             uint has_slots MAP_PARAM)
{
    (void)chunk;
    (void)lid;
    (void)prefix;
    (void)ranks;
    (void)packed;
    place_in_order(ids, 0, num_slots, num_experts, start, sorted, sorted_off, slot_positions, slot_off,
                   has_slots MAP_ARG);
}
#else
/* A slot's position is its expert's start + the expert's slots in earlier
 * chunks + its rank; each work-item takes LOAD_BATCH slots a round. */
static inline void place_all(__global const int *ids, uint num_slots, uint num_experts, uint chunk, uint lid,
                             __local uint *start, __global const uint *prefix,
                             __global const uint *ranks, bool packed, __global int *sorted,
                             ulong sorted_off, __global int *slot_positions, ulong slot_off,
                             uint has_slots MAP_PARAM)
{
    const uint cols = num_experts + 1;
    for (uint s0 = lid; s0 < num_slots; s0 += FUSED_WG * LOAD_BATCH) {
        uint e[LOAD_BATCH], rank[LOAD_BATCH];
        UNROLL
        for (uint j = 0; j < LOAD_BATCH; j++) {
            const uint s = s0 + j * FUSED_WG;
            const bool in = s < num_slots;
            const uint word = in ? shared_load(&ranks[s]) : 0u;
            const uint packed_column = word & ((1u << LAYOUT_DISPATCH_COLUMN_BITS) - 1u);
            e[j] = !in ? num_experts : packed ? packed_column : column_of(ids[s], num_experts MAP_ARG);
            rank[j] = packed ? word >> LAYOUT_DISPATCH_COLUMN_BITS : word;
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
 * words, run and start E + 1; packed as for rank_chunk (false: read ids). */
static inline void fused_align(__global const int *ids, uint num_slots, uint num_experts, uint chunk,
                               uint block_size, __global uint *scratch, __global int *counts, ulong counts_off,
                               __global int *sorted, ulong sorted_off, __global int *blocks, ulong blocks_off,
                               __global int *post_padded, ulong post_off, __global int *slot_positions,
                               ulong slot_off, uint has_slots, __global int *num_invalid, ulong invalid_off,
                               uint has_invalid, __local uint *run, __local uint *start, __local uint *part,
                               __local uint *flag, __local uint *tile, bool packed MAP_PARAM)
{
    const uint lid = get_local_id(0), c = get_group_id(0), groups = get_num_groups(0), cols = num_experts + 1;
    /* As moecl_moe_align_max_padded (kernel arguments are at most
     * MOECL_MAX_KERNEL_ARGS, src/internal.h). */
    const uint max_padded = num_slots + num_experts * (block_size - 1), num_blocks = max_padded / block_size;
    __global uint *matrix = scratch + 1, *prefix = matrix + (size_t)groups * cols;
    __global uint *ranks = prefix + (size_t)groups * cols;

    for (uint e = lid; e < cols; e += FUSED_WG)
        run[e] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = min(c * chunk, num_slots), end = min(begin + chunk, num_slots);
    rank_chunk(ids, begin, end, num_experts, lid, run, tile, ranks, packed MAP_ARG);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint e = lid; e < cols; e += FUSED_WG)
        shared_store(&matrix[(size_t)c * cols + e], run[e]);

    /* Every work-group meets the same barriers: the others run the last
     * one's steps over nothing (pocl 3.1 loses the scan's writes with these
     * barriers under a branch on the ticket wherever E + 1 < 256). */
    const bool last = last_to_finish(scratch, groups, lid, flag);
    const uint live_experts = last ? num_experts : 0;
    scan_columns(matrix, prefix, last ? groups : 0, last ? cols : 0, lid, run);
    const uint post = padded_starts(run, start, part, FUSED_WG, lid, live_experts, block_size, counts, counts_off,
                                    post_padded, post_off, num_invalid, invalid_off, has_invalid, last);
    if (last) {
        pad_and_blocks(run, start, post, FUSED_WG, lid, num_slots, num_experts, block_size, max_padded, num_blocks,
                       sorted, sorted_off, blocks, blocks_off);
        place_all(ids, num_slots, num_experts, chunk, lid, start, prefix, ranks, packed, sorted, sorted_off,
                  slot_positions, slot_off, has_slots MAP_ARG);
    }
}

__kernel __attribute__((reqd_work_group_size(FUSED_WG, 1, 1)))
void moe_align_fused(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint chunk,
                     uint block_size, __global uint *scratch,
                     __global int *counts, ulong counts_off, __global int *sorted, ulong sorted_off,
                     __global int *blocks, ulong blocks_off, __global int *post_padded, ulong post_off,
                     __global int *slot_positions, ulong slot_off, uint has_slots, __global int *num_invalid,
                     ulong invalid_off, uint has_invalid, __local uint *run, __local uint *start MAP_KERNEL_PARAMS)
{
    MAP_SETUP;
    __local uint part[FUSED_WG];
    __local uint flag;
#if FUSED_WG > 1
    __local uint tile[FUSED_WG];
#else
    __local uint *tile = part; /* unused */
#endif
    fused_align(ids + ids_off, num_slots, num_experts, chunk, block_size, scratch, counts, counts_off, sorted,
                sorted_off, blocks, blocks_off, post_padded, post_off, slot_positions, slot_off, has_slots,
                num_invalid, invalid_off, has_invalid, run, start, part, &flag, tile, false MAP_ARG);
}

/* ---- one launch, no work-group waiting on another: moe_align_fused_parallel ---- */

/* Each work-group c computes the scan itself: it counts every slot (the
 * slots before its chunk apart), so that it knows each expert's padded
 * start and its chunk's place in each expert's run, then places its own
 * chunk of slots (stable: in order on CPUs, in tiles ranked as the
 * scatter's on GPUs) and a share of the padding and blocks. Nothing
 * passes between work-groups: no ticket, no scratch, no global atomics;
 * every output element is written by exactly one work-item (work-group 0
 * writes the small outputs). The price is that every work-group reads
 * every id, so the host takes it up to the device table's size.
 *
 * The counts of the slots before [begin, end) per column (before), then
 * of all slots (tot), by the n work-items of a work-group. */
static inline void count_around(__global const int *ids, uint num_slots, uint begin, uint num_experts, uint lid,
                                __local uint *before, __local uint *tot MAP_PARAM)
{
    const uint cols = num_experts + 1;
    for (uint e = lid; e < cols; e += FUSED_WG)
        before[e] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    count_slots(ids, 0, begin, num_experts, lid, FUSED_WG, before MAP_ARG);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint e = lid; e < cols; e += FUSED_WG)
        tot[e] = before[e];
    barrier(CLK_LOCAL_MEM_FENCE);
    count_slots(ids, begin, num_slots, num_experts, lid, FUSED_WG, tot MAP_ARG);
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* tot, start and run hold E + 1 words each. */
__kernel __attribute__((reqd_work_group_size(FUSED_WG, 1, 1)))
void moe_align_fused_parallel(__global const int *ids, ulong ids_off, uint num_slots, uint num_experts, uint chunk,
                              uint block_size, __global int *counts, ulong counts_off, __global int *sorted,
                              ulong sorted_off, __global int *blocks, ulong blocks_off, __global int *post_padded,
                              ulong post_off, __global int *slot_positions, ulong slot_off, uint has_slots,
                              __global int *num_invalid, ulong invalid_off, uint has_invalid, __local uint *tot,
                              __local uint *start, __local uint *run MAP_KERNEL_PARAMS)
{
    MAP_SETUP;
    __local uint part[FUSED_WG];
#if FUSED_WG > 1
    __local uint tile[FUSED_WG];
#else
    __local uint *tile = part; /* unused */
#endif
    const uint lid = get_local_id(0), c = get_group_id(0);
    /* As moecl_moe_align_max_padded (kernel arguments are at most
     * MOECL_MAX_KERNEL_ARGS, src/internal.h). */
    const uint max_padded = num_slots + num_experts * (block_size - 1), num_blocks = max_padded / block_size;
    ids += ids_off;
    const uint begin = min(c * chunk, num_slots), end = min(begin + chunk, num_slots);
    count_around(ids, num_slots, begin, num_experts, lid, run, tot MAP_ARG);
    const uint post = padded_starts(tot, start, part, FUSED_WG, lid, num_experts, block_size, counts, counts_off,
                                    post_padded, post_off, num_invalid, invalid_off, has_invalid, c == 0);
    /* Spread over every work-item of the launch: each expert's padding
     * and blocks by one, the tail by all. */
    pad_and_blocks(tot, start, post, (uint)get_global_size(0), (uint)get_global_id(0), num_slots, num_experts,
                   block_size, max_padded, num_blocks, sorted, sorted_off, blocks, blocks_off);
    for (uint e = lid; e < num_experts; e += FUSED_WG)
        run[e] += start[e];
    barrier(CLK_LOCAL_MEM_FENCE);
    place_chunk(ids, begin, end, num_experts, lid, FUSED_WG, tile, run, sorted, sorted_off, slot_positions, slot_off,
                has_slots MAP_ARG);
}
