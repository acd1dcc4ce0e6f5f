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
 *                    slot's physical expert (physical_ids), the token's
 *                    token_in_rank row, and the chunk's row of the count
 *                    matrix m[chunk][2R + 1]: slots per rank in columns
 *                    0..R-1 (column R: slots not sent), tokens per rank in
 *                    columns R+1..2R;
 *   ep_layout_scan   one work-group: an exclusive scan of each column over
 *                    the chunks, the rank starts (the slots not sent come
 *                    last, so their run is the tail of send_slots), the
 *                    small outputs, and zeroed expert_counts;
 *   ep_layout_place  one work-group per chunk: each slot goes to its
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

/* The replica of a token's slot among c: a multiplicative hash of the
 * token index (Knuth's 2^32 / golden ratio), so that a token's choice does
 * not follow the slot's place in its row (which follows the score order). */
static inline uint replica_of(uint t, uint c)
{
    return (t * 2654435761u) % c;
}

/* The physical expert of token t's slot with logical id e, or -1 where it
 * is not sent (id out of range, a replica count or map entry out of
 * range). */
static inline int physical_of(int e, uint t, uint num_experts, uint num_physical, uint max_replicas, uint flags,
                              __global const int *l2p, __global const int *replicas)
{
    if (e < 0 || (uint)e >= num_experts)
        return -1;
    if (!(flags & EP_MAP))
        return e;
    const int c = replicas[e];
    if (c < 1 || (uint)c > max_replicas)
        return -1;
    const int p = l2p[(size_t)e * max_replicas + replica_of(t, (uint)c)];
    return p >= 0 && (uint)p < num_physical ? p : -1;
}

/* The rank of physical expert p (or -1), num_ranks for one not sent:
 * the table's entry where in range, else contiguous blocks. */
static inline uint rank_of(int p, uint num_physical, uint num_ranks, uint flags, __global const int *p2r)
{
    if (p < 0)
        return num_ranks;
    if (!(flags & EP_TABLE))
        return (uint)p / (num_physical / num_ranks);
    const int r = p2r[p];
    return r >= 0 && (uint)r < num_ranks ? (uint)r : num_ranks;
}

/* Whether slot j of a token (ranks of its slots from phys) is the first
 * of the token on rank r. */
static inline bool first_on_rank(__global const int *phys, uint j, uint r, uint num_physical, uint num_ranks,
                                 uint flags, __global const int *p2r)
{
    for (uint i = 0; i < j; i++)
        if (rank_of(phys[i], num_physical, num_ranks, flags, p2r) == r)
            return false;
    return true;
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void ep_layout_count(__global const int *ids, ulong ids_off, uint num_tokens, uint top_k, uint num_experts,
                     uint num_physical, uint num_ranks, uint max_replicas, uint flags, __global const int *l2p,
                     ulong l2p_off, __global const int *replicas, ulong replicas_off, __global const int *p2r,
                     ulong p2r_off, uint chunk_tokens, __global int *phys, ulong phys_off, __global uchar *tir,
                     ulong tir_off, __global uint *matrix, __local uint *hist)
{
    const uint lid = get_local_id(0), c = get_group_id(0), cols = 2 * num_ranks + 1;
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
        for (uint j = 0; j < top_k; j++) {
            const int p = physical_of(row_ids[j], t, num_experts, num_physical, max_replicas, flags, l2p, replicas);
            const uint r = rank_of(p, num_physical, num_ranks, flags, p2r);
            row_phys[j] = r < num_ranks ? p : -1;
            atomic_inc(&hist[r]);
            if (r < num_ranks && first_on_rank(row_phys, j, r, num_physical, num_ranks, flags, p2r)) {
                atomic_inc(&hist[num_ranks + 1 + r]);
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
void ep_layout_place(__global const int *phys, ulong phys_off, uint num_tokens, uint top_k, uint num_physical,
                     uint num_ranks, uint flags, __global const int *p2r, ulong p2r_off, uint chunk_tokens,
                     __global const uint *matrix, ulong starts_off, __global int *send, ulong send_off,
                     __global int *expert_counts, ulong ec_off, __local uint *run)
{
    __local uint tile[WG];
    const uint lid = get_local_id(0), c = get_group_id(0), cols = 2 * num_ranks + 1;
    phys += phys_off;
    p2r += p2r_off;
    __global const uint *row = matrix + (size_t)c * cols, *starts = matrix + starts_off;
    for (uint r = lid; r <= num_ranks; r += WG)
        run[r] = starts[r] + row[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    const uint begin = c * chunk_tokens * top_k, end = min(begin + chunk_tokens * top_k, num_tokens * top_k);
    for (uint base = begin; base < end; base += WG) {
        const uint s = base + lid;
        const int p = s < end ? phys[s] : -1;
        /* Past the end: a key no slot has. */
        const uint key = s < end ? rank_of(p, num_physical, num_ranks, flags, p2r) : num_ranks + 1;
        const uint rank = tile_rank(key, lid, tile);
        if (key <= num_ranks)
            send[send_off + run[key] + rank] = key < num_ranks ? (int)s : -1;
        if (key < num_ranks && (flags & EP_COUNTS))
            atomic_inc(&expert_counts[ec_off + p]);
        tile_advance(key, run, num_ranks + 1);
    }
}
