/* The expert-parallel dispatch layout (docs/routing.md, "Expert-parallel
 * dispatch layout"). Each slot s = t * top_k + j of topk_ids goes to a
 * physical expert (its replica, by the token's hash) and so to a rank; the
 * sent slots are grouped by rank, stably, as moe_align groups slots by
 * expert with block size 1: this program is built after cl/moe_align.cl
 * and places with its tile_rank and tile_advance.
 *
 * Three launches, chained by the host, over chunks of chunk_tokens tokens
 * (a chunk never splits a token, so each token's flags are one
 * work-item's):
 *   ep_layout_count  one work-group per chunk, a work-item per token: each
 *                    slot's physical expert (physical_ids) and rank (a
 *                    key in the scratch buffer, R where not sent), the token's
 *                    token_in_rank row, and the chunk's row of the count
 *                    matrix m[chunk][2R + 1]: slots per rank in columns
 *                    0..R-1 (column R: slots not sent), tokens per rank in
 *                    columns R+1..2R;
 *   ep_layout_scan   one work-group: an exclusive scan of each column over
 *                    the chunks, the rank starts (the slots not sent come
 *                    last, so their run is the tail of send_slots), the
 *                    small outputs, and zeroed expert_counts;
 *   ep_layout_place  one work-group per chunk: each slot goes by its key to its
 *                    rank's start + its rank's slots in earlier chunks +
 *                    those earlier in this chunk (tiles of WG slots, the
 *                    stable rank of cl/moe_align.cl); a slot not sent
 *                    writes -1 in the tail; expert_counts by atomic_inc.
 * Every send_slots entry is written by exactly one work-item with a value
 * independent of scheduling, and the counts are sums of increments, so the
 * results are the same bits on every device. The tables are read only at
 * checked indices: an entry out of range makes its slot not sent. */

/* flags: which optional tables and outputs the call has. */
#define EP_MAP 1u       /* logical_to_physical and replica_counts */
#define EP_TABLE 2u     /* physical_to_rank */
#define EP_TIR 4u       /* token_in_rank */
#define EP_TPR 8u       /* tokens_per_rank */
#define EP_COUNTS 16u   /* expert_counts */
#define EP_MAX_TOPK 64  /* the host's limit on top_k */

static inline uint token_hash(uint t) { return t * 2654435761u; }

/* replica_of for c in 1..4, from the token's hash. */
static inline uint replica_small(uint h, uint c) { return c == 4u ? h & 3u : c == 3u ? h % 3u : c == 2u ? h & 1u : 0u; }

/* The replica of a token's slot among c: a multiplicative hash of the
 * token index (Knuth's 2^32 / golden ratio), so that a token's choice does
 * not follow the slot's place in its row (which follows the score order).
 * Up to 4 replicas by constant divisors: a division by the count, which is
 * loaded, would sit in the keys' dependent chain (on the H200 at 64 ranks
 * with 32 doubled experts, 470 of a work-group's 19280 cycles). */
static inline uint replica_of(uint t, uint c)
{
    const uint h = token_hash(t);
    return c > 4u ? h % c : replica_small(h, c);
}

/* a / b for a < 2^21, b >= 1, from rcp = 1.0f / b: the float quotient
 * is off by less than 1 for such a, so a step either way makes it exact.
 * For the contiguous blocks' rank of a slot, where a division by a value
 * known only at run time sits in the keys' dependent chain on the H200
 * (700 cycles of the keys phase at 64 ranks without replicas); elsewhere
 * it measured no faster than `/`. */
static inline uint div_small(uint a, uint b, float rcp)
{
    uint q = (uint)((float)a * rcp);
    q -= q * b > a;
    return q + ((q + 1) * b <= a);
}

/* The physical expert of token t's slot with logical id e, or -1 where it
 * is not sent (id out of range, a replica count or map entry out of
 * range). */
static inline bool id_sent(int e, uint num_experts) { return e >= 0 && (uint)e < num_experts; }

/* The same from the replica count c of logical expert e (replicas[e],
 * read by the caller where the id is in range and there is a map). */
static inline int physical_with(int e, int c, uint t, uint num_experts, uint num_physical, uint max_replicas,
                                uint flags, __global const int *l2p)
{
    if (!id_sent(e, num_experts))
        return -1;
    if (!(flags & EP_MAP))
        return e;
    if (c < 1 || (uint)c > max_replicas)
        return -1;
    const int p = l2p[(size_t)e * max_replicas + replica_of(t, (uint)c)];
    return p >= 0 && (uint)p < num_physical ? p : -1;
}

static inline int physical_of(int e, uint t, uint num_experts, uint num_physical, uint max_replicas, uint flags,
                              __global const int *l2p, __global const int *replicas)
{
    const int c = (flags & EP_MAP) && id_sent(e, num_experts) ? replicas[e] : 1;
    return physical_with(e, c, t, num_experts, num_physical, max_replicas, flags, l2p);
}

/* A placement table's entry as a rank: num_ranks where out of range. */
static inline uint rank_checked(int r, uint num_ranks) { return r >= 0 && (uint)r < num_ranks ? (uint)r : num_ranks; }

/* The rank of physical expert p (or -1), num_ranks for one not sent:
 * the table's entry where in range, else contiguous blocks. */
static inline uint rank_of(int p, uint num_physical, uint num_ranks, uint flags, __global const int *p2r)
{
    if (p < 0)
        return num_ranks;
    if (!(flags & EP_TABLE))
        return (uint)p / (num_physical / num_ranks);
    return rank_checked(p2r[p], num_ranks);
}

/* A local count: a plain increment where the work-group is one
 * work-item (CPUs), an atomic otherwise. */
static inline void count_in(__local uint *c)
{
#if WG == 1
    (*c)++;
#else
    atomic_inc(c);
#endif
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void ep_layout_count(__global const int *ids, ulong ids_off, uint num_tokens, uint top_k, uint num_experts,
                     uint num_physical, uint num_ranks, uint max_replicas, uint flags, __global const int *l2p,
                     ulong l2p_off, __global const int *replicas, ulong replicas_off, __global const int *p2r,
                     ulong p2r_off, uint chunk_tokens, __global int *phys, ulong phys_off, __global uchar *tir,
                     ulong tir_off, __global uint *matrix, ulong keys_off, __local uint *hist)
{
    const uint lid = get_local_id(0), c = get_group_id(0), cols = 2 * num_ranks + 1;
    __global uint *keys = matrix + keys_off;
    ids += ids_off;
    l2p += l2p_off;
    replicas += replicas_off;
    p2r += p2r_off;
    phys += phys_off;
    tir += tir_off;
    for (uint k = lid; k < cols; k += WG)
        hist[k] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = c * chunk_tokens, end = min(begin + chunk_tokens, num_tokens);
    for (uint t = begin + lid; t < end; t += WG) {
        __global const int *row_ids = ids + (size_t)t * top_k;
        __global int *row_phys = phys + (size_t)t * top_k;
        __global uchar *row_tir = tir + (size_t)t * num_ranks;
        if (flags & EP_TIR)
            for (uint r = 0; r < num_ranks; r++)
                row_tir[r] = 0;
        /* The row's ranks, each computed once: the token counts on a
         * rank at its first slot there. */
        uint row_ranks[EP_MAX_TOPK];
        for (uint j = 0; j < top_k; j++) {
            const int p = physical_of(row_ids[j], t, num_experts, num_physical, max_replicas, flags, l2p, replicas);
            const uint r = rank_of(p, num_physical, num_ranks, flags, p2r);
            row_phys[j] = r < num_ranks ? p : -1;
            keys[(size_t)t * top_k + j] = r;
            row_ranks[j] = r;
            count_in(&hist[r]);
            bool first = r < num_ranks;
            for (uint i = 0; i < j && first; i++)
                first = row_ranks[i] != r;
            if (first) {
                count_in(&hist[num_ranks + 1 + r]);
                if (flags & EP_TIR)
                    row_tir[r] = 1;
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __global uint *row = matrix + (size_t)c * cols;
    for (uint k = lid; k < cols; k += WG)
        row[k] = hist[k];
}

/* After the matrix [num_chunks][2R + 1], scratch holds starts[R + 1]:
 * where each rank's run begins (starts[R]: the slots sent, where the run
 * of those not sent begins). The matrix becomes each chunk's exclusive
 * prefix per column. */
__kernel __attribute__((reqd_work_group_size(SCAN_WG, 1, 1)))
void ep_layout_scan(__global uint *matrix, uint num_chunks, uint num_ranks, uint num_physical, uint flags,
                    __global int *rank_counts, ulong rc_off, __global int *rank_offsets, ulong ro_off,
                    __global int *tokens_per_rank, ulong tpr_off, __global int *expert_counts, ulong ec_off,
                    __local uint *tot)
{
    const uint lid = get_local_id(0), cols = 2 * num_ranks + 1;
    __global uint *starts = matrix + (size_t)num_chunks * cols;
    for (uint k = lid; k < cols; k += SCAN_WG) {
        uint acc = 0;
        for (uint c = 0; c < num_chunks; c++) {
            const uint v = matrix[(size_t)c * cols + k];
            matrix[(size_t)c * cols + k] = acc;
            acc += v;
        }
        tot[k] = acc;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
        uint acc = 0;
        for (uint r = 0; r <= num_ranks; r++) {
            starts[r] = acc;
            rank_offsets[ro_off + r] = (int)acc;
            acc += tot[r];
        }
    }
    for (uint r = lid; r < num_ranks; r += SCAN_WG) {
        rank_counts[rc_off + r] = (int)tot[r];
        if (flags & EP_TPR)
            tokens_per_rank[tpr_off + r] = (int)tot[num_ranks + 1 + r];
    }
    if (flags & EP_COUNTS)
        for (uint p = lid; p < num_physical; p += SCAN_WG)
            expert_counts[ec_off + p] = 0;
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void ep_layout_place(__global const int *phys, ulong phys_off, uint num_tokens, uint top_k, uint num_ranks,
                     uint flags, uint chunk_tokens, __global const uint *matrix, ulong starts_off, ulong keys_off,
                     __global int *send, ulong send_off, __global int *expert_counts, ulong ec_off,
                     __local uint *run)
{
    __local uint tile[WG];
    const uint lid = get_local_id(0), c = get_group_id(0), cols = 2 * num_ranks + 1;
    phys += phys_off;
    __global const uint *row = matrix + (size_t)c * cols, *starts = matrix + starts_off, *keys = matrix + keys_off;
    for (uint r = lid; r <= num_ranks; r += WG)
        run[r] = starts[r] + row[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = c * chunk_tokens * top_k, end = min(begin + chunk_tokens * top_k, num_tokens * top_k);
#if WG == 1
    /* One work-item walks its chunk in order: a plain running count. */
    for (uint s = begin; s < end; s++) {
        const uint key = keys[s];
        send[send_off + run[key]++] = key < num_ranks ? (int)s : -1;
        if (key < num_ranks && (flags & EP_COUNTS))
            atomic_inc(&expert_counts[ec_off + phys[s]]);
    }
#else
    for (uint base = begin; base < end; base += WG) {
        const uint s = base + lid;
        /* Past the end: a key no slot has. */
        const uint key = s < end ? keys[s] : num_ranks + 1;
        const uint rank = tile_rank(key, lid, tile, key <= num_ranks);
        if (key <= num_ranks)
            send[send_off + run[key] + rank] = key < num_ranks ? (int)s : -1;
        if (key < num_ranks && (flags & EP_COUNTS))
            atomic_inc(&expert_counts[ec_off + phys[s]]);
        tile_advance(key, run, num_ranks + 1);
    }
#endif
}

/* ---- one launch: ep_layout_fused ----
 *
 * The same layout in one launch of G work-groups (G <= 127), work-group c
 * taking the tokens of chunk c (GPUs, where three launches cost several
 * times the work: 72.6-87.9 against 30.8-38.4 us on the H200 at 13526 x
 * 256). Three kernels pass the count matrix
 * from one launch to the next; here the work-groups pass it through a
 * grid-wide wait, which is safe only where every work-group waited on has
 * started (a started work-group finishes its counting without waiting for
 * anyone; OpenCL does not promise that work-groups run concurrently):
 *   1. each work-group counts its chunk and ranks its slots stably (the
 *      rank of a slot among the chunk's slots of its rank, kept in local
 *      memory), publishes its counts as row c of the matrix, and takes a
 *      ticket; the first to take one decides the mode: WAIT where every
 *      work-group has started by then, else LAST;
 *   2. WAIT: once all G have counted, every work-group reads columns
 *      0..R of the whole matrix itself (its chunk's prefix per rank and
 *      the totals: a few words per work-item, so no second grid-wide wait
 *      for a shared scan), sums a share of the other columns into their
 *      outputs, and places its own chunk;
 *      LAST: the last work-group to count sums the columns alone and its
 *      first work-item places every slot in order (a device that does not
 *      run the work-groups together: pocl and Intel's CPU runtime on a few
 *      threads, oclgrind one at a time), and the others end after
 *      counting.
 * The tickets are three 7-bit fields of scratch word 0 (started, counted,
 * ended; bits 28-29 the mode), so that the word is 0 between calls as
 * moe_align's fused kernel keeps it: the last work-group to end puts it
 * back to 0 (its ended ticket is every other work-group's last access to
 * the scratch, and a launch runs to completion, so no call leaves it
 * otherwise once it was 0 at the start). Every word one work-group writes
 * for another goes by atomics, as in moe_align_fused (cl/moe_align.cl says
 * what that assumes), or with MOECL_PTX by NVIDIA's volatile accesses
 * (peer_store, peer_load). The positions are those of the
 * three kernels, so the bits are the same on every device and in both
 * modes.
 *
 * Build-time define: FWG, the work-group (a power of two, at least top_k;
 * sub-tiles of SUB work-items rank equal keys). A tile is FWG / top_k
 * whole tokens, so that a token's slots are in one tile. */
#ifndef FWG
#define FWG 256
#endif
#define SUB (FWG < 32 ? FWG : 32)
#define NSUB (FWG / SUB)
#define EP_MAY_WAIT 32u /* flags: the grid-wide wait is allowed (off: LAST mode forced, for tests) */
#define EP_ROWS_SHIFT 8 /* flags >> this: the rows a pass of rank_chunk_fused takes, 1..EP_MAX_ROWS */
#define EP_MAX_ROWS 4

#define F_STARTED 0
#define F_COUNTED 7
#define F_ENDED 14
#define F_MODE 28
#define MODE_WAIT 1u
#define MODE_LAST 2u

static inline uint field(uint word, uint at) { return (word >> at) & 127u; }

/* The call's inputs and shape, passed to the steps below as one. */
typedef struct ep_in {
    __global const int *ids, *l2p, *replicas, *p2r;
    uint num_tokens, top_k, num_experts, num_physical, num_ranks, max_replicas, flags, chunk_tokens;
} ep_in;

/* The key of lane i of a row (a tile of FWG / top_k tokens) whose slots
 * start at kr[row] (chunk-relative), R + 1 (no slot has it) where the lane
 * holds no slot: past the row's slots or the chunk's n slots. */
static inline uint row_key(__local const uint *kr, uint row, uint i, uint row_slots, uint n, uint R)
{
    return i < row_slots && row + i < n ? kr[row + i] >> 16 : R + 1;
}

/* The lanes of work-item lid's sub-tile [base, base + SUB) of a row
 * before and after it with the same key (keys up to R + 1): with
 * WARP_MATCH (NVIDIA's PTX; a sub-tile is then a warp) the lanes whose
 * keys agree in every bit, from one warp vote a bit of the key (a few
 * votes, whatever the number of distinct keys: match.any.sync takes
 * longer the more distinct keys a warp holds, as at 64 ranks: 7016
 * cycles against the votes' 6561 for the tiles on the H200), else a loop
 * over the sub-tile's keys in kr. Called by all work-items. */
static inline void sub_tile_rank(uint key, uint R, uint lid, uint base, __local const uint *kr, uint row,
                                 uint row_slots, uint n, uint *before, uint *after)
{
#if WARP_MATCH && SUB == 32
    (void)lid;
    (void)base;
    (void)kr;
    (void)row;
    (void)row_slots;
    (void)n;
    uint lower, higher, same = 0xffffffffu;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(lower));
    asm("mov.u32 %0, %%lanemask_gt;" : "=r"(higher));
    for (uint b = 0, bits = 32 - clz(R + 1); b < bits; b++) {
        uint ones;
        asm volatile("{ .reg .pred p; setp.ne.u32 p, %1, 0; vote.sync.ballot.b32 %0, p, 0xffffffff; }"
                     : "=r"(ones)
                     : "r"(key >> b & 1u));
        same &= key >> b & 1u ? ones : ~ones;
    }
    *before = popcount(same & lower);
    *after = popcount(same & higher);
#else
    uint b = 0, a = 0;
    for (uint i = base; i < base + SUB; i++) {
        const uint same = row_key(kr, row, i, row_slots, n, R) == key;
        b += i < lid ? same : 0u;
        a += i > lid ? same : 0u;
    }
    *before = b;
    *after = a;
#endif
}

/* Whether a slot of logical id e with replica count c has a map entry:
 * the id and the count in range. */
static inline bool map_sent(int e, int c, const ep_in *in)
{
    return id_sent(e, in->num_experts) && c >= 1 && (uint)c <= in->max_replicas;
}

/* The map's index of that entry (replica_of's choice), 0 where there is
 * none; for maps of at most 4 columns (c <= 4, so no division by c). */
static inline uint map_index(int e, int c, uint t, const ep_in *in)
{
    return map_sent(e, c, in) ? (uint)e * in->max_replicas + replica_small(token_hash(t), (uint)c) : 0u;
}

/* Every slot of the chunk [tok0, tok_end) by one work-group, before the
 * tiles: its key (its rank, R where not sent) and physical expert into kr
 * (chunk-relative index) as key << 16 | p + 1 (0 where not sent; p is
 * below EP_MAX_PHYSICAL, 2^14), and its physical_ids entry. Four slots a
 * work-item go through each level of loads together (ids, replica counts,
 * the map, the placement table), so that the chunk waits for memory once
 * a level rather than once a slot and level. A work-item's slots are
 * lid, lid + FWG, ...: their tokens follow by steps of FWG / k with a
 * carry, so that no division by top_k is left in the loop. */
static void chunk_keys_fused(const ep_in *in, uint tok0, uint tok_end, __global int *phys, __local uint *kr)
{
    const uint lid = get_local_id(0), k = in->top_k, R = in->num_ranks, n = (tok_end - tok0) * k;
    const uint s0 = tok0 * k, per = in->num_physical / R, dq = FWG / k, dr = FWG % k;
    const float rper = 1.0f / per;
    uint q = tok0 + lid / k, r = lid % k;
    for (uint i0 = lid; i0 < n; i0 += 4 * FWG) {
        int e[4], c[4], p[4];
        uint t[4];
        UNROLL
        for (uint m = 0; m < 4; m++) {
            const uint i = i0 + m * FWG;
            e[m] = i < n ? in->ids[s0 + i] : -1;
            t[m] = q;
            r += dr;
            q += dq + (r >= k);
            r -= r >= k ? k : 0u;
        }
        /* The physical experts: a branch for the whole work-group per
         * case, and in the map's cases every lookup at an index in range
         * (entry 0 where the slot is not sent, its value then unused), so
         * that each level's four loads issue together: a lookup under a
         * slot's own condition makes NVIDIA's compiler wait for each in
         * turn (keys phase 5328 cycles against 4395 on the H200, 64 ranks,
         * 32 doubled experts). */
        if (!(in->flags & EP_MAP)) {
            UNROLL
            for (uint m = 0; m < 4; m++)
                p[m] = id_sent(e[m], in->num_experts) ? e[m] : -1;
        } else {
            UNROLL
            for (uint m = 0; m < 4; m++)
                c[m] = in->replicas[id_sent(e[m], in->num_experts) ? e[m] : 0];
            if (in->max_replicas <= 4) {
                uint at[4];
                UNROLL
                for (uint m = 0; m < 4; m++)
                    at[m] = map_index(e[m], c[m], t[m], in);
                UNROLL
                for (uint m = 0; m < 4; m++)
                    p[m] = in->l2p[at[m]];
                UNROLL
                for (uint m = 0; m < 4; m++)
                    p[m] = map_sent(e[m], c[m], in) && p[m] >= 0 && (uint)p[m] < in->num_physical ? p[m] : -1;
            } else {
                UNROLL
                for (uint m = 0; m < 4; m++)
                    p[m] = physical_with(e[m], c[m], t[m], in->num_experts, in->num_physical, in->max_replicas,
                                         in->flags, in->l2p);
            }
        }
        /* The ranks: the table's (looked up at entry 0 for a slot not
         * sent, as above), or the contiguous blocks' (a branch for the
         * whole work-group, so that neither path's steps sit in the
         * other's chain). */
        uint key[4];
        if (in->flags & EP_TABLE) {
            int at[4];
            UNROLL
            for (uint m = 0; m < 4; m++)
                at[m] = in->p2r[p[m] < 0 ? 0 : p[m]];
            UNROLL
            for (uint m = 0; m < 4; m++)
                key[m] = p[m] < 0 ? R : rank_checked(at[m], R);
        } else {
            UNROLL
            for (uint m = 0; m < 4; m++)
                key[m] = p[m] < 0 ? R : div_small((uint)p[m], per, rper);
        }
        UNROLL
        for (uint m = 0; m < 4; m++) {
            const uint i = i0 + m * FWG;
            if (i < n) {
                phys[s0 + i] = key[m] < R ? p[m] : -1;
                kr[i] = key[m] << 16 | (key[m] < R ? (uint)p[m] + 1u : 0u);
            }
        }
    }
}

/* Words of a token's rank set (a bit a rank) in mask. */
#define MASK_WORDS(R) (((R) + 31) / 32)

/* The token_in_rank rows of a tile's n tokens (tokens tt..) from their
 * rank sets: each entry written once, whole (no zeros first, so no
 * ordering between work-items' stores), four flags a store where the rows
 * are whole aligned uchar4s. */
static void tile_flags(__local const uint *mask, uint mw, __global uchar *tir, uint tt, uint n, uint R)
{
    const uint lid = get_local_id(0);
    __global uchar *rows = tir + (size_t)tt * R;
    if (R % 4 == 0 && ((size_t)rows & 3) == 0) {
        const uint quads = R / 4;
        for (uint w = lid; w < n * quads; w += FWG) {
            const uint q = w % quads, bits = mask[w / quads * mw + q / 8] >> q % 8 * 4;
            ((__global uchar4 *)rows)[w] = (uchar4)(bits & 1u, bits >> 1 & 1u, bits >> 2 & 1u, bits >> 3 & 1u);
        }
    } else {
        for (uint b = lid; b < n * R; b += FWG)
            rows[b] = mask[b / R * mw + b % R / 32] >> b % R % 32 & 1u;
    }
}

/* Step 2 of rank_chunk_fused for key r: each line's count of the key
 * becomes the chunk's slots of that key before the line, from the count
 * of earlier passes (cnt[r], which then takes this pass's too). The loads
 * go out a batch at a time: a loop of load-add-store pairs would wait
 * once a line. */
static inline void scan_lines(__local uint *sub, __local uint *cnt, uint r, uint lines, uint R)
{
    uint acc = cnt[r];
    for (uint l0 = 0; l0 < lines; l0 += 8) {
        uint v[8];
        UNROLL
        for (uint q = 0; q < 8; q++)
            v[q] = l0 + q < lines ? sub[(l0 + q) * (R + 1) + r] : 0u;
        UNROLL
        for (uint q = 0; q < 8; q++)
            if (l0 + q < lines) {
                sub[(l0 + q) * (R + 1) + r] = acc;
                acc += v[q];
            }
    }
    cnt[r] = acc;
}

/* Step 1 of rank_chunk_fused for row m (m < rows, else nothing), whose
 * slots start at kr[row]: the work-item's key and place among its
 * sub-tile's slots of that key, as key << 16 | place (R + 1 << 16 where
 * it holds no slot); the sub-tile's count of the key into sub (from its
 * last slot of the key), the token's rank set into mask (row_tokens
 * tokens a row), its tokens and slots counted in cnt. */
static inline uint row_rank(const ep_in *in, __local const uint *kr, __local uint *sub, __local uint *mask,
                            __local uint *cnt, uint pass, uint m, uint rows, uint row_slots, uint n)
{
    const uint lid = get_local_id(0), R = in->num_ranks, k = in->top_k, g = lid / SUB, mw = MASK_WORDS(R);
    if (m >= rows) /* the same for the whole work-group */
        return (R + 1) << 16;
    const uint row = pass + m * row_slots, key = row_key(kr, row, lid, row_slots, n, R);
    uint before, after;
    sub_tile_rank(key, R, lid, g * SUB, kr, row, row_slots, n, &before, &after);
    if (key <= R && after == 0)
        sub[(m * NSUB + g) * (R + 1) + key] = before + 1;
    if (key < R) {
        /* The slot that adds rank key to the token's rank set counts the
         * token there, once whatever its slots there. */
        const uint bit = 1u << key % 32;
        if (!(atomic_or(&mask[(m * (row_slots / k) + lid / k) * mw + key / 32], bit) & bit))
            atomic_inc(&cnt[R + 1 + key]);
        if (in->flags & EP_COUNTS)
            atomic_inc(&cnt[2 * R + 1 + (kr[row + lid] & 0xffffu) - 1]);
    }
    return key << 16 | before;
}

/* Step 3 for row m from its step 1 (kb): the slot's rank in the chunk
 * into kr, from its line's count of its key before it (sub, scanned). */
static inline void row_place(__local uint *kr, __local const uint *sub, uint kb, uint pass, uint m, uint row_slots,
                             uint R)
{
    const uint lid = get_local_id(0), key = kb >> 16;
    if (key <= R)
        kr[pass + m * row_slots + lid] = key << 16 | (sub[(m * NSUB + lid / SUB) * (R + 1) + key] + (kb & 0xffffu));
}

/* Chunk c by one work-group, from its keys in kr: each slot's stable
 * rank among the chunk's slots of that key, packed as key << 16 | rank in
 * kr (chunk-relative index); cnt[0..R] ends as the chunk's slots per key,
 * cnt[R + 1 + r] its tokens on rank r and cnt[2R + 1 + p] its slots on
 * physical expert p (with EP_COUNTS); and physical_ids and token_in_rank
 * of the chunk's tokens. A pass takes `rows` rows of FWG / top_k tokens
 * at once, a work-item a slot of each, so that its steps wait on memory
 * and barriers once a pass rather than once a row: (1) each slot's place
 * among its sub-tile's slots of its key, each (row, sub-tile)'s count of
 * each key into sub (rows x NSUB lines of R + 1, zero between passes),
 * the tokens' rank sets into mask; (2) each key's counts scanned over the
 * pass's lines in slot order, from the running count of earlier passes
 * (cnt); (3) the ranks and the pass's token_in_rank rows; (4) sub and
 * mask back to zero. */
static void rank_chunk_fused(const ep_in *in, uint c, uint tok_end, __global int *phys,
                             __global uchar *tir, uint cols, uint rows, __local uint *cnt, __local uint *sub,
                             __local uint *kr, __local uint *mask)
{
    const uint lid = get_local_id(0), R = in->num_ranks, k = in->top_k;
    const uint row_tokens = FWG / k, row_slots = row_tokens * k, tok0 = c * in->chunk_tokens;
    const uint mw = MASK_WORDS(R), lines = rows * NSUB, n = (tok_end - tok0) * k;
    for (uint i = lid; i < cols; i += FWG)
        cnt[i] = 0;
    for (uint i = lid; i < lines * (R + 1); i += FWG)
        sub[i] = 0;
    for (uint i = lid; i < rows * row_tokens * mw; i += FWG)
        mask[i] = 0;
    chunk_keys_fused(in, tok0, tok_end, phys, kr);
    for (uint pass = 0; pass < n; pass += rows * row_slots) {
        barrier(CLK_LOCAL_MEM_FENCE);
        /* 1. Four rows by name (EP_MAX_ROWS), not an array indexed in an
         * unrolled loop: pocl 3.1 ranked wrongly with that array, as if
         * step 2 ran before step 1's stores. */
        const uint4 kb = (uint4)(row_rank(in, kr, sub, mask, cnt, pass, 0, rows, row_slots, n),
                                 row_rank(in, kr, sub, mask, cnt, pass, 1, rows, row_slots, n),
                                 row_rank(in, kr, sub, mask, cnt, pass, 2, rows, row_slots, n),
                                 row_rank(in, kr, sub, mask, cnt, pass, 3, rows, row_slots, n));
        barrier(CLK_LOCAL_MEM_FENCE);
        /* 2. */
        for (uint r = lid; r <= R; r += FWG)
            scan_lines(sub, cnt, r, lines, R);
        barrier(CLK_LOCAL_MEM_FENCE);
        /* 3. */
        row_place(kr, sub, kb.s0, pass, 0, row_slots, R);
        row_place(kr, sub, kb.s1, pass, 1, row_slots, R);
        row_place(kr, sub, kb.s2, pass, 2, row_slots, R);
        row_place(kr, sub, kb.s3, pass, 3, row_slots, R);
        const uint tt = tok0 + pass / k;
        if (in->flags & EP_TIR)
            tile_flags(mask, mw, tir, tt, min(rows * row_tokens, tok_end - tt), R);
        barrier(CLK_LOCAL_MEM_FENCE);
        /* 4. */
        for (uint i = lid; i < lines * (R + 1); i += FWG)
            sub[i] = 0;
        for (uint i = lid; i < rows * row_tokens * mw; i += FWG)
            mask[i] = 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* A word one work-group writes for others (its matrix row) and one it
 * reads from another (the matrix, the tickets), across the tickets: atomics
 * (cl/moe_align.cl says why), except with MOECL_PTX, where NVIDIA's
 * volatile accesses go to the device's L2 without an atomic's round trip
 * (every work-group reads the same words, so atomics would queue on
 * them); the tickets' fences order them. */
static inline void peer_store(__global uint *p, uint v)
{
#if MOECL_PTX
    *(volatile __global uint *)p = v;
#else
    shared_store(p, v);
#endif
}

static inline uint peer_load(__global const uint *p)
{
#if MOECL_PTX
    return alone() ? *p : *(volatile __global const uint *)p;
#else
    return shared_load(p);
#endif
}

/* Lane 0's ticket on field at of word 0, returning the word after it. */
static inline uint ticket(volatile __global uint *word, uint at)
{
    return atomic_add(word, 1u << at) + (1u << at);
}

/* The total of a column past the rank starts: a token count per rank or
 * a slot count per physical expert. */
static inline void column_output(uint col, uint R, uint total, uint flags, __global int *tokens_per_rank,
                                 __global int *expert_counts)
{
    if (col <= 2 * R) {
        if (flags & EP_TPR)
            tokens_per_rank[col - R - 1] = (int)total;
    } else {
        expert_counts[col - 2 * R - 1] = (int)total;
    }
}

#define COLUMN_SUM(N)                                                                                             \
    static inline uint column_sum##N(__global const uint *matrix, uint cols, uint col, uint i, uint step,         \
                                     uint groups, uint c, uint *before)                                           \
    {                                                                                                             \
        uint sum = 0, pre = 0;                                                                                    \
        for (uint cc = i; cc < groups; cc += N * step) {                                                          \
            uint v[N];                                                                                            \
            UNROLL                                                                                                \
            for (uint m = 0; m < N; m++) {                                                                        \
                const uint at = cc + m * step;                                                                    \
                v[m] = at < groups ? peer_load(&matrix[(size_t)at * cols + col]) : 0u;                           \
            }                                                                                                     \
            UNROLL                                                                                                \
            for (uint m = 0; m < N; m++) {                                                                        \
                sum += v[m];                                                                                      \
                pre += cc + m * step < c ? v[m] : 0u;                                                             \
            }                                                                                                     \
        }                                                                                                         \
        *before = pre;                                                                                            \
        return sum;                                                                                               \
    }
COLUMN_SUM(8)
COLUMN_SUM(40)

static inline uint column_sum(__global const uint *matrix, uint cols, uint col, uint i, uint step, uint groups,
                              uint c, uint *before)
{
    return (groups - i + step - 1) / step <= 8 ? column_sum8(matrix, cols, col, i, step, groups, c, before)
                                                : column_sum40(matrix, cols, col, i, step, groups, c, before);
}

/* WAIT mode, after the counted wait: work-group c's view of the matrix.
 * Columns 0..R (the slots per key), which every work-group reads itself,
 * so that no second grid-wide wait is needed: pre[r], its chunk's slots of
 * key r in earlier chunks, and total[r], all chunks'. The other columns
 * (tokens per rank, slots per physical expert), shared out over the
 * work-groups, share each: their totals into their outputs. All of a
 * round's columns load together (a team of work-items a column, reading
 * along the matrix's rows), so that
 * the work-group waits for the matrix once, not once for its own columns
 * and again for its share; rounds of at most FWG shared columns (tile
 * holds their sums). Without active (LAST mode) the same barriers run
 * over nothing. */
static void columns_fused(__global const uint *matrix, uint groups, uint c, uint R, uint cols, bool active,
                          uint flags, __global int *tokens_per_rank, __global int *expert_counts,
                          __local uint *pre, __local uint *total, __local uint *tile)
{
    const uint lid = get_local_id(0), own = R + 1, share = (cols - own + groups - 1) / groups;
    for (uint o0 = 0; o0 == 0 || o0 < share; o0 += FWG) {
        const uint shared = min(share - min(o0, share), (uint)FWG), first = o0 == 0 ? own : 0u;
        /* Neighbouring work-items take neighbouring columns of a chunk's
         * row (coalesced reads), a team's L work-items every L-th chunk. */
        const uint jobs = first + shared, teams = min(jobs, (uint)FWG), L = FWG / teams;
        const uint g = lid % teams, i = lid / teams;
        for (uint r = lid; r < first && active; r += FWG) {
            pre[r] = 0;
            total[r] = 0;
        }
        for (uint j = lid; j < shared && active; j += FWG)
            tile[j] = 0;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint job = g; job < jobs && i < L && active; job += teams) {
            const uint col = job < first ? job : own + c * share + o0 + job - first;
            if (col >= cols)
                continue;
            uint before;
            const uint sum = column_sum(matrix, cols, col, i, L, groups, job < first ? c : 0u, &before);
#if FWG == 1
            if (job < first) {
                pre[job] += before;
                total[job] += sum;
            } else {
                tile[job - first] += sum;
            }
#else
            if (job < first) {
                atomic_add(&pre[job], before);
                atomic_add(&total[job], sum);
            } else {
                atomic_add(&tile[job - first], sum);
            }
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint j = lid; j < shared && active; j += FWG) {
            const uint col = own + c * share + o0 + j;
            if (col < cols)
                column_output(col, R, tile[j], flags, tokens_per_rank, expert_counts);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}

/* dims: num_tokens, top_k, num_experts, num_physical, num_ranks,
 * max_replicas, flags, chunk_tokens. Offsets (in elements): in0 ids, l2p,
 * replicas, p2r; out0 physical_ids, token_in_rank, rank_counts,
 * rank_offsets; out1 send_slots, tokens_per_rank, expert_counts. lm: cnt
 * (2R + 1 + P' words, P' = num_physical with EP_COUNTS, else 0), sub
 * (rows * NSUB * (R + 1), rows = flags >> EP_ROWS_SHIFT), start and base
 * (R + 1 each), kr (chunk_tokens * top_k), mask (rows * FWG / top_k
 * tokens' rank sets, MASK_WORDS(R) words each).
 * scratch: word 0 the tickets, the matrix [G][2R + 1 + P']. Every work-group meets the same barriers
 * whatever its ticket (moe_align_fused says why): the steps of a mode a
 * work-group does not take run over nothing, and the LAST mode's own
 * steps have no barrier. */
__kernel __attribute__((reqd_work_group_size(FWG, 1, 1)))
void ep_layout_fused(__global const int *ids, __global const int *l2p, __global const int *replicas,
                     __global const int *p2r, ulong4 in0, uint8 dims, __global int *phys, __global uchar *tir,
                     __global int *rank_counts, __global int *rank_offsets, ulong4 out0, __global int *send,
                     __global int *tokens_per_rank, __global int *expert_counts, ulong4 out1,
                     __global uint *scratch, __local uint *lm)
{
    __local uint tile[FWG], flag[2];
    const ep_in in = {ids + in0.s0, l2p + in0.s1, replicas + in0.s2, p2r + in0.s3,
                      dims.s0, dims.s1, dims.s2, dims.s3, dims.s4, dims.s5, dims.s6, dims.s7};
    phys += out0.s0;
    tir += out0.s1;
    rank_counts += out0.s2;
    rank_offsets += out0.s3;
    send += out1.s0;
    tokens_per_rank += out1.s1;
    expert_counts += out1.s2;
    const uint lid = get_local_id(0), c = get_group_id(0), G = get_num_groups(0), R = in.num_ranks;
    const uint cols = 2 * R + 1 + (in.flags & EP_COUNTS ? in.num_physical : 0u);
    const uint rows = in.flags >> EP_ROWS_SHIFT;
    __local uint *cnt = lm, *sub = cnt + cols, *start = sub + rows * NSUB * (R + 1), *base = start + R + 1;
    __local uint *kr = base + R + 1, *mask = kr + in.chunk_tokens * in.top_k;
    volatile __global uint *word = scratch;
    __global uint *matrix = scratch + 1;

    if (lid == 0 && !alone())
        ticket(word, F_STARTED);
    const uint tok0 = c * in.chunk_tokens, tok1 = min(tok0 + in.chunk_tokens, in.num_tokens);
    rank_chunk_fused(&in, c, tok1, phys, tir, cols, rows, cnt, sub, kr, mask);
    for (uint i = lid; i < cols; i += FWG)
        peer_store(&matrix[(size_t)c * cols + i], cnt[i]);

    /* 1. The counted ticket; the first decides the mode; in WAIT mode
     * lane 0 then spins until all G have counted. */
    mem_fence(CLK_GLOBAL_MEM_FENCE);
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    if (lid == 0) {
        uint mode = MODE_WAIT, last = 1;
        if (!alone()) {
            __global const uint *w0 = (__global const uint *)word;
            const uint w = ticket(word, F_COUNTED), counted = field(w, F_COUNTED) - 1;
            last = counted == G - 1;
            mode = w >> F_MODE;
            if (counted == 0) {
                mode = field(w, F_STARTED) == G && (in.flags & EP_MAY_WAIT) ? MODE_WAIT : MODE_LAST;
                atomic_or(word, mode << F_MODE);
            }
            for (uint v = w; !mode; v = peer_load(w0))
                mode = v >> F_MODE;
            for (uint v = w; mode == MODE_WAIT && field(v, F_COUNTED) < G; v = peer_load(w0))
                ;
        }
        flag[0] = mode;
        flag[1] = last;
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    mem_fence(CLK_GLOBAL_MEM_FENCE);
    const bool wait = flag[0] == MODE_WAIT, alone_last = !wait && flag[1];

    /* 2. WAIT: this chunk's prefix and the totals of columns 0..R (cnt
     * and base), and a share of the other columns' outputs. */
    columns_fused(matrix, G, c, R, cols, wait, in.flags, tokens_per_rank, expert_counts, cnt, base, tile);

    /* 3. LAST: the last work-group sums every column over the chunks
     * (the totals of ranks 0..R into base, the others into their
     * outputs). */
    for (uint col = lid; col < cols && alone_last; col += FWG) {
        uint total = 0;
        for (uint cc = 0; cc < G; cc++)
            total += shared_load(&matrix[(size_t)cc * cols + col]);
        if (col > R)
            column_output(col, R, total, in.flags, tokens_per_rank, expert_counts);
        else
            base[col] = total;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* The rank starts: the exclusive scan of the totals (start[R]: the
     * slots sent, where the run of those not sent begins). */
    const bool small_outputs = wait ? c == 0 : alone_last;
    for (uint r = lid; r <= R && (wait || alone_last); r += FWG) {
        uint acc = 0;
        for (uint i = 0; i < r; i++)
            acc += base[i];
        start[r] = acc;
        if (small_outputs) {
            rank_offsets[r] = (int)acc;
            if (r < R)
                rank_counts[r] = (int)base[r];
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    /* 4. The placement. WAIT: this chunk's slots from their ranks in kr,
     * at their rank's start + its slots in earlier chunks (cnt now holds
     * that sum); LAST: the last work-group's first work-item walks every
     * slot in order with a running position per rank. */
    for (uint r = lid; r <= R && wait; r += FWG)
        cnt[r] += start[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint i = lid; i < (tok1 - tok0) * in.top_k && wait; i += FWG) {
        const uint v = kr[i], key = v >> 16;
        send[cnt[key] + (v & 0xffffu)] = key < R ? (int)(tok0 * in.top_k + i) : -1;
    }
    if (alone_last && lid == 0)
        for (uint t = 0; t < in.num_tokens; t++)
            for (uint j = 0; j < in.top_k; j++) {
                const uint s = t * in.top_k + j;
                const int p = physical_of(in.ids[s], t, in.num_experts, in.num_physical, in.max_replicas, in.flags,
                                          in.l2p, in.replicas);
                const uint key = rank_of(p, in.num_physical, R, in.flags, in.p2r);
                send[start[key]++] = key < R ? (int)s : -1;
            }

    if (lid == 0 && !alone()) {
        const uint w = ticket(word, F_ENDED);
        if (field(w, F_ENDED) == G)
            atomic_xchg(word, 0u);
    }
}
