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

/* ---- replay_team (cl/replay.cl): top-k gating's team and rows ---------- */

/* One row's local memory: the softmax's float slots (softmax scores
 * weighed as such, without shuffles) and the row's values and ids. Less
 * than top-k gating's row of the same shape, whose launch check (the
 * launch shape is its) therefore admits the replay kernel too. */
#define LAYOUT_REPLAY_TEAM_LOCAL_BYTES(team, rows, k, softmax, shuffle) \
    ((rows) * (((shuffle) || !(softmax) ? 0 : 4 * (team)) + (4 + 4) * (k)))

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
/* The register block, MB tokens (8, or TM where fewer) x RN experts, is
 * sixteen float16 partial sums; the hidden dimension goes in chunks of HC
 * indices, so that the block's MB hidden chunks (32 KiB) stay in a 48 KiB
 * L1 while the ground rows stream from L2. pocl 3.1 on a 2-core Xeon
 * (AVX-512), 2026-12-07, 16384 x 4096 x 128 top 8, processor time in
 * alternated rounds: the inner loop is 16 fma and 10 loads, no spills, at
 * about 100 GFLOP/s a core (226 for fma alone; the same loop in C with the
 * ground rows in L1 ran 150); HC 2048 took 103-110 ms against 86-91, HC
 * 512 and 768 were no faster, blocks of 4 x 4 and 8 x 3 took 86-95 ms
 * against 81-99 (the noise). */
#define LAYOUT_GROUNDED_MB(tm) ((tm) < 8 ? (tm) : 8)
#define LAYOUT_GROUNDED_RN 2
#define LAYOUT_GROUNDED_HC 1024
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
 * chunk of ground rows from L2 (on pocl at 8192 x 4096 x 128, 29.8-31.1 ms
 * of processor time against 33.3-41.4 for 8),
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

/* ---- grounded_router_splitk: TM tokens x TN experts x TK hidden ------- */

/* A work-group of wg work-items: 32 lanes along the hidden index for each
 * of wg / 32 expert rows at once (all wg lanes below 32). Local memory:
 * the tokens' chunk of hidden values (TM x TK) and the lanes' partial sums
 * (a row of 33 per expert row and token), then, in the same floats, the
 * last work-group's rows of g (TM x the experts padded to blocks of 8).
 * Its gating by teams (TEAM 32, ROWS wg / 32) adds top-k's team rows,
 * LAYOUT_TOPK_TEAM_LOCAL_BYTES. */
#define LAYOUT_SPLITK_LANES(wg) ((wg) < 32 ? (wg) : 32)
#define LAYOUT_SPLITK_ROWS(wg) ((wg) / LAYOUT_SPLITK_LANES(wg))
#define LAYOUT_SPLITK_FLOATS(tm, tk, wg, experts)                                                  \
    LAYOUT_MAX((tm) * (tk) + LAYOUT_SPLITK_ROWS(wg) * (tm) * (LAYOUT_SPLITK_LANES(wg) + 1),          \
               (tm) * LAYOUT_ROWS_BLOCKS(experts) * LAYOUT_ROWS_BLOCK)
#define LAYOUT_GROUNDED_SPLITK_LOCAL_BYTES(tm, tk, wg, experts) (4 * LAYOUT_SPLITK_FLOATS(tm, tk, wg, experts) + 4)
/* Scratch words: a ticket per block of TM tokens, then (from a multiple of
 * 16 words) the partial dot products part[chunk][token][expert]. */
#define LAYOUT_SPLITK_PARTS_AT(blocks) (((blocks) + 15) / 16 * 16)
#define LAYOUT_SPLITK_SCRATCH_WORDS(blocks, chunks, tokens, experts)                               \
    (LAYOUT_SPLITK_PARTS_AT(blocks) + (chunks) * (tokens) * (experts))

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
/* The parallel fused kernel: three arrays of E + 1 words sized at launch
 * (totals, starts, running positions); compiled in, the partial sums and
 * the tile of FUSED_WG columns (none with 1). */
#define LAYOUT_ALIGN_PARALLEL_STATIC_BYTES(fused_wg) (4 * (fused_wg) + ((fused_wg) > 1 ? 4 * (fused_wg) : 0))

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
    LAYOUT_U64 gating_off, bias_off, weights_off, ids_off, counts_off, load_off, valid_off;
    LAYOUT_U64 captured_off, scale_off; /* moecl_topk_gating_ex's captured_ids, expert_scale */
    LAYOUT_U32 num_tokens;
    float scaling_factor;
} layout_topk_args;
typedef char layout_topk_args_size_check[sizeof(layout_topk_args) == 80 ? 1 : -1];

/* The replay kernels (cl/replay.cl): offsets in elements of gating, of
 * the ids (the given topk_ids, or hash routing's input_ids), of the hash
 * table, of topk_weights and of the written topk_ids (hash routing), then
 * the tokens, the hash table's rows and the factor; one argument. */
typedef struct layout_replay_args {
    LAYOUT_U64 gating_off, ids_off, table_off, weights_off, out_ids_off;
    LAYOUT_U32 num_tokens, vocab_size;
    float scaling_factor;
    LAYOUT_U32 unused;
} layout_replay_args;
typedef char layout_replay_args_size_check[sizeof(layout_replay_args) == 56 ? 1 : -1];

/* moecl_route_dispatch's kernel (topk_gating_team built with
 * ROUTE_DISPATCH): moe_align's offsets (in elements) and scalars, one
 * argument as above. */
typedef struct layout_dispatch_args {
    LAYOUT_U64 counts_off, sorted_off, blocks_off, post_off, slots_off, invalid_off;
    LAYOUT_U32 block_size, has_slots, has_invalid, unused;
} layout_dispatch_args;
typedef char layout_dispatch_args_size_check[sizeof(layout_dispatch_args) == 64 ? 1 : -1];
/* The one kernel passes each slot's column and its rank in its chunk to
 * the last work-group in one word: rank << LAYOUT_DISPATCH_COLUMN_BITS |
 * column, so the host takes it only where a column (at most E + 1) and a
 * rank (below a work-group's ROWS * top_k slots) fit. */
#define LAYOUT_DISPATCH_COLUMN_BITS 13

/* ---- permute and combine (cl/permute.cl), one argument each ---------- */

/* Offsets in elements, then the shape: hidden columns, num_padded rows,
 * the slots (num_tokens * top_k) or the tokens, top_k, and the launch
 * shape: tpr work-items a row, rpg rows a work-group. */
typedef struct layout_permute_args {
    LAYOUT_U64 in_off, ids_off, post_off, out_off;
    LAYOUT_U32 hidden, num_padded, num_slots, top_k, tpr, rpg;
} layout_permute_args;
typedef char layout_permute_args_size_check[sizeof(layout_permute_args) == 56 ? 1 : -1];

/* permute_scatter: offsets in elements, then the shape (num_tokens rows
 * of hidden_states scattered, then num_padded rows checked for padding,
 * zero_rows of them a launch row), the launch shape, and wide: 1 where
 * every row start is 16-byte aligned, so that same-dtype rows move as
 * uint4 words. */
typedef struct layout_scatter_args {
    LAYOUT_U64 in_off, ids_off, post_off, pos_off, out_off;
    LAYOUT_U32 hidden, num_padded, num_tokens, top_k, tpr, rpg, wide, zero_rows;
} layout_scatter_args;
typedef char layout_scatter_args_size_check[sizeof(layout_scatter_args) == 72 ? 1 : -1];

typedef struct layout_combine_args {
    LAYOUT_U64 in_off, weights_off, pos_off, shared_off, out_off;
    LAYOUT_U32 hidden, num_padded, num_tokens, top_k, tpr, rpg;
} layout_combine_args;
typedef char layout_combine_args_size_check[sizeof(layout_combine_args) == 64 ? 1 : -1];

#endif
