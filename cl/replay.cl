/* Routing replay and hash routing (docs/routing.md, section 11): the
 * weights that top-k gating's convention gives ids chosen elsewhere. Built
 * after cl/gating.cl with top-k gating's defines (the shape, SCORING,
 * WEIGHTING, renormalisation, the launch shape and CPU_DEVICE: the
 * variant top-k gating would run for the descriptor) and:
 *   REPLAY  1: the ids are given (topk_ids, read);
 *           2: hash routing, the ids of row t are tid2eid[input_ids[t]]
 *              (written to topk_ids)
 * The scores are computed by gating.cl's own functions in the layout the
 * top-k kernel of the same variant uses (its softmax sum in its order),
 * so that replaying the ids top-k gating chose gives its weights bit for
 * bit. Groups and a bias steer selection only, and replay selects
 * nothing: an expert weighs what it would weigh had it been chosen.
 * An id outside [0, NUM_EXPERTS) weighs 0 and is left out of the sum. */

#ifndef REPLAY
#define REPLAY 1
#endif

#if REPLAY == 2
#define IDS_PARAMS __global const int *input_ids, __global const int *tid2eid, __global float *topk_weights, \
                   __global int *topk_ids
#else
#define IDS_PARAMS __global const int *topk_ids, __global float *topk_weights
#endif

/* Expert j of row `row`: the given id, or the table's entry for the row's
 * token (-1 for a token outside [0, vocab_size): the table is read only
 * in range). */
static inline int replay_id(IDS_PARAMS, layout_replay_args args, uint row, uint j)
{
#if REPLAY == 2
    (void)topk_weights;
    (void)topk_ids;
    const uint token = (uint)input_ids[args.ids_off + row];
    return token < args.vocab_size ? tid2eid[args.table_off + (size_t)token * TOPK + j] : -1;
#else
    (void)topk_weights;
    return topk_ids[args.ids_off + (size_t)row * TOPK + j];
#endif
}

static inline bool replay_valid(int id)
{
    return (uint)id < NUM_EXPERTS;
}

/* What an id that is not an expert holds until its weight is set to 0:
 * nothing a softmax over the chosen logits counts. */
#define REPLAY_NONE (WEIGHTING == 1 ? -INFINITY : 0.0f)

/* Step 5 after the values (the chosen scores, or logits for WEIGHTING 1
 * and 2): the weighting, renormalise and scale, as rows_final and
 * team_final_weights do, with the slots that hold no expert set to 0
 * before the sum and after. */
static inline void replay_final(float *w, ulong valid, float scaling_factor)
{
    chosen_weights_of(w, TOPK);
    for (uint j = 0; j < TOPK; j++)
        if (!((valid >> j) & 1))
            w[j] = 0.0f;
    float divisor;
    WEIGHTS_DIVISOR(divisor, w, TOPK);
    for (uint j = 0; j < TOPK; j++)
        w[j] = ((valid >> j) & 1) ? w[j] / divisor * scaling_factor : 0.0f;
}

#if TEAM == 1
/* ---------------------------------------------------------------------- */
/* One work-item per row (CPU devices): topk_gating_rows's layout.         */
/* ---------------------------------------------------------------------- */

/* The chosen values of a row, WEIGHTING 0: the scores of the ids. Softmax
 * takes the row's terms as the top-k kernel does (the fast path's on CPU
 * devices, else the generic loop's blocks); the elementwise scorings
 * score each id's block as rows_scores does. */
static inline void replay_rows_scores(__global const in_t *x, const int *ids, float *w)
{
#if ROWS_FAST
    const float row_max = hmax16(fast_lane_max(x));
    float16 acc = (float16)(0.0f);
    for (uint p = 0; p < PAIRS16; p++) {
        float16 v0, v1, p0, p1;
        fast_sum_pair(x, p, row_max, &acc, &v0, &v1, &p0, &p1);
    }
    const float row_sum = fast_row_sum(acc);
    float chosen_x[TOPK16];
    for (uint j = 0; j < TOPK16; j++)
        chosen_x[j] = j < TOPK && replay_valid(ids[j]) ? LOAD_IN(x, ids[j]) : -INFINITY;
    float scores[TOPK16];
    fast_chosen_scores(chosen_x, row_max, row_sum, scores);
    for (uint j = 0; j < TOPK; j++)
        w[j] = scores[j];
#elif SCORING == 0
    float8 logit[BLOCKS], score[BLOCKS];
    for (uint b = 0; b < BLOCKS; b++)
        logit[b] = load_block(x, b * BLOCK, 0.0f);
    rows_scores(logit, score);
    for (uint j = 0; j < TOPK; j++) {
        float t[BLOCK];
        const uint e = replay_valid(ids[j]) ? (uint)ids[j] : 0;
        vstore8(score[e / BLOCK], 0, t);
        w[j] = t[e % BLOCK];
    }
#else
    for (uint j = 0; j < TOPK; j++) {
        float t[BLOCK];
        const uint e = replay_valid(ids[j]) ? (uint)ids[j] : 0;
        vstore8(rows_elementwise_scores(load_block(x, e / BLOCK * BLOCK, 0.0f)), 0, t);
        w[j] = t[e % BLOCK];
    }
#endif
}

__kernel void replay_rows(__global const in_t *gating, IDS_PARAMS, layout_replay_args args)
{
    const uint row = (uint)get_global_id(0);
    if (row >= args.num_tokens)
        return;
    __global const in_t *x = gating + args.gating_off + (size_t)row * NUM_EXPERTS;
    int ids[TOPK];
    ulong valid = 0;
    for (uint j = 0; j < TOPK; j++) {
#if REPLAY == 2
        ids[j] = replay_id(input_ids, tid2eid, topk_weights, topk_ids, args, row, j);
#else
        ids[j] = replay_id(topk_ids, topk_weights, args, row, j);
#endif
        valid |= (ulong)replay_valid(ids[j]) << j;
    }
    float w[TOPK];
#if WEIGHTING == 0
    replay_rows_scores(x, ids, w);
#else
    for (uint j = 0; j < TOPK; j++)
        w[j] = replay_valid(ids[j]) ? LOAD_IN(x, ids[j]) : REPLAY_NONE;
#endif
    for (uint j = 0; j < TOPK; j++)
        if (!replay_valid(ids[j]))
            w[j] = REPLAY_NONE;
    replay_final(w, valid, args.scaling_factor);
    __global float *w_out = topk_weights + args.weights_off + (size_t)row * TOPK;
    for (uint j = 0; j < TOPK; j++)
        w_out[j] = w[j];
#if REPLAY == 2
    __global int *id_out = topk_ids + args.out_ids_off + (size_t)row * TOPK;
    for (uint j = 0; j < TOPK; j++)
        id_out[j] = ids[j];
#endif
}

#else
/* ---------------------------------------------------------------------- */
/* A team of TEAM work-items per row, ROWS rows a work-group (GPUs):       */
/* topk_gating_team's layout, so that softmax's max and sum are its bits.  */
/* ---------------------------------------------------------------------- */

#define REPLAY_SOFTMAX (SCORING == 0 && WEIGHTING == 0)
#if REPLAY_SOFTMAX
#define REPLAY_SLOTS_DECL GATE_FLOAT_SLOTS_DECL
#else
#define REPLAY_SLOTS_DECL
#endif

__kernel __attribute__((reqd_work_group_size(TEAM * ROWS, 1, 1))) void
replay_team(__global const in_t *gating, IDS_PARAMS, layout_replay_args args)
{
    REPLAY_SLOTS_DECL
    __local float replay_values[ROWS * TOPK];
    __local int replay_ids[ROWS * TOPK];
    const uint lane = get_local_id(0) % TEAM;
    const uint r = get_local_id(0) / TEAM;
    const uint row = get_group_id(0) * ROWS + r;
    const bool active = row < args.num_tokens;
    __global const in_t *x = gating + args.gating_off + (size_t)(active ? row : 0) * NUM_EXPERTS;

    float row_max = 0.0f, sum_term = 1.0f;
#if REPLAY_SOFTMAX
    /* The row's max and sum as topk_gating_team takes them (every
     * work-item of the work-group runs this: barriers). */
    float value[EPT];
    team_load_row(x, active, lane, value);
    team_score_terms(value, lane, GATE_FLOAT_SLOTS(r), &row_max, &sum_term);
#endif
    for (uint j = lane; j < TOPK; j += TEAM) {
        int id = -1;
        float v = REPLAY_NONE;
        if (active) {
#if REPLAY == 2
            id = replay_id(input_ids, tid2eid, topk_weights, topk_ids, args, row, j);
#else
            id = replay_id(topk_ids, topk_weights, args, row, j);
#endif
            if (replay_valid(id)) {
                v = LOAD_IN(x, id);
                if (WEIGHTING == 0)
                    v = team_score(v, row_max, sum_term);
            }
        }
        replay_values[r * TOPK + j] = v;
        replay_ids[r * TOPK + j] = id;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!active)
        return;
    float w[TOPK];
    ulong valid = 0;
    for (uint j = 0; j < TOPK; j++) {
        w[j] = replay_values[r * TOPK + j];
        valid |= (ulong)replay_valid(replay_ids[r * TOPK + j]) << j;
    }
    replay_final(w, valid, args.scaling_factor);
    __global float *w_out = topk_weights + args.weights_off + (size_t)row * TOPK;
    for (uint j = lane; j < TOPK; j += TEAM)
        w_out[j] = w[j];
#if REPLAY == 2
    __global int *id_out = topk_ids + args.out_ids_off + (size_t)row * TOPK;
    for (uint j = lane; j < TOPK; j += TEAM)
        id_out[j] = replay_ids[r * TOPK + j];
#endif
}
#endif
