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
        for (uint c = 0; c < num_chunks; c++) {
            const uint v = matrix[(size_t)c * cols + e];
            matrix[(size_t)c * cols + e] = acc;
            acc += v;
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

/* One tile of the stable placement, called by all n work-items of a
 * work-group: work-item lid's slot (e: its column; past the end, a column
 * no slot has) goes to run[e] plus the number of lower work-items in the
 * tile with the same column; then run advances past the tile's slots. tile
 * holds n columns, read one at a time (four at a time was slower on the
 * H200: bench/RESULTS.md, moe_align). */
static inline void place_tile(uint slot, uint e, bool in_range, uint lid, __local uint *tile, __local uint *run,
                              uint num_experts, __global int *sorted, ulong sorted_off, __global int *slot_positions,
                              ulong slot_off, uint has_slots)
{
    tile[lid] = e;
    barrier(CLK_LOCAL_MEM_FENCE);
    uint rank = 0;
    for (uint j = 0; j < lid; j++)
        rank += tile[j] == e;
    int pos = -1;
    if (e < num_experts) {
        pos = (int)(run[e] + rank);
        sorted[sorted_off + pos] = (int)slot;
    }
    if (in_range && has_slots)
        slot_positions[slot_off + slot] = pos;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (e < num_experts)
        atomic_inc(&run[e]);
    barrier(CLK_LOCAL_MEM_FENCE);
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

    /* Padded starts: contiguous ranges of experts per work-item, an
     * inclusive scan of the ranges' sums (Hillis-Steele), then each
     * range's own prefix. */
    const uint per = (num_experts + ONE_WG - 1) / ONE_WG;
    const uint lo = min(lid * per, num_experts), hi = min(lo + per, num_experts);
    uint sum = 0;
    for (uint e = lo; e < hi; e++)
        sum += (tot[e] + block_size - 1) / block_size * block_size;
    part[lid] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint d = 1; d < ONE_WG; d <<= 1) {
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
    const uint post = part[ONE_WG - 1];
    if (lid == 0) {
        start[num_experts] = post;
        post_padded[post_off] = (int)post;
        if (has_invalid)
            num_invalid[invalid_off] = (int)tot[num_experts];
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    /* Padding and blocks. The slots' own positions are written below; the
     * two sets are disjoint. */
    for (uint e = lid; e < num_experts; e += ONE_WG) {
        const uint first = start[e], next = start[e + 1];
        for (uint p = first + tot[e]; p < next; p++)
            sorted[sorted_off + p] = (int)num_slots;
        for (uint b = first / block_size; b < next / block_size; b++)
            blocks[blocks_off + b] = (int)e;
    }
    for (uint p = post + lid; p < max_padded; p += ONE_WG)
        sorted[sorted_off + p] = (int)num_slots;
    for (uint b = post / block_size + lid; b < num_blocks; b += ONE_WG)
        blocks[blocks_off + b] = -1;
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
