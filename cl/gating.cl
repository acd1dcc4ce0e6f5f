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
 *   RENORM_EPS                 (absent: none) divide by sum + eps
 *   GROUP_FILL                 0 (absent): dropped groups never selected;
 *                              1: their selection score is 0.0 (below)
 *   WEIGHTS_DTYPE, IDS_DTYPE,  (absent: 0) the element types of the
 *   BIAS_DTYPE                 weights and ids the kernel stores and of
 *                              the bias it loads (below)
 *   SHARED, SHARED_WEIGHT      (absent: 0) shared experts after the routed
 *                              slots of a row (below)
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
/* CPU_DEVICE (set by the host for CPU devices): the rows kernels' softmax
 * fast path is only taken there (cl/topk_gating.cl says why). */
#ifndef CPU_DEVICE
#define CPU_DEVICE 0
#endif
#ifndef WEIGHTS_DTYPE
#define WEIGHTS_DTYPE 0
#endif
#ifndef IDS_DTYPE
#define IDS_DTYPE 0
#endif
#ifndef BIAS_DTYPE
#define BIAS_DTYPE 0
#endif
/* SHARED shared experts (docs/routing.md, "Shared experts"): an output row
 * is ROW_SLOTS wide, the TOPK routed slots, then slot TOPK + j (j <
 * SHARED) with id NUM_EXPERTS + j and weight SHARED_WEIGHT times the
 * routed scaling factor; ids then range over ID_EXPERTS experts. */
#ifndef SHARED
#define SHARED 0
#endif
#ifndef SHARED_WEIGHT
#define SHARED_WEIGHT 0.0f
#endif
#define ROW_SLOTS (TOPK + SHARED)
#define ID_EXPERTS (NUM_EXPERTS + SHARED)

/* The types of the outputs and the bias (moecl_dtype, moecl_index_dtype):
 * weight_t and STORE_WEIGHT(p, i, w), ids_t and STORE_ID(p, i, id),
 * bias_t and LOAD_BIAS(p, i). 16-bit values travel as ushort words, as the
 * inputs do (cl/common.cl): no cl_khr_fp16. Both roundings are to nearest
 * even in integer or core-library operations, so every device stores the
 * same bits for the same f32 weight. */
#if WEIGHTS_DTYPE == 0
typedef float weight_t;
#define STORE_WEIGHT(p, i, w) ((p)[i] = (w))
#elif WEIGHTS_DTYPE == 1
typedef ushort weight_t;
/* NaN stays NaN; beyond the f16 range becomes inf (rounding, not a clamp). */
#define STORE_WEIGHT(p, i, w) vstore_half_rte((w), (i), (__global half *)(p))
#elif WEIGHTS_DTYPE == 2
typedef ushort weight_t;
/* bf16 of f: the upper half of its bits rounded to nearest even, which
 * carries into the exponent as it should (up to inf); a NaN keeps its sign
 * and upper payload and is made quiet, since rounding could carry it into
 * inf. Integer tests only: isnan can fold away under relaxed math. */
static inline ushort bf16_of_float(float f)
{
    const uint u = as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (ushort)((u >> 16) | 0x0040u);
    return (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#define STORE_WEIGHT(p, i, w) ((p)[i] = bf16_of_float(w))
#else
#error "WEIGHTS_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif
#if IDS_DTYPE == 0
typedef int ids_t;
#elif IDS_DTYPE == 1
typedef long ids_t;
#else
#error "IDS_DTYPE must be 0 (int32) or 1 (int64)"
#endif
#define STORE_ID(p, i, id) ((p)[i] = (ids_t)(id))
#if BIAS_DTYPE == 0
typedef float bias_t;
#define LOAD_BIAS(p, i) ((p)[i])
#elif BIAS_DTYPE == 1
typedef ushort bias_t;
#define LOAD_BIAS(p, i) vload_half((i), (__global const half *)(p))
#elif BIAS_DTYPE == 2
typedef ushort bias_t;
#define LOAD_BIAS(p, i) as_float((uint)(p)[i] << 16)
#else
#error "BIAS_DTYPE must be 0 (f32), 1 (f16) or 2 (bf16)"
#endif

/* The optional outputs of a routing kernel (top-k gating, the router),
 * each absent (0) unless the host sets it:
 *   HAS_COUNTS  an int histogram of the chosen ids, `counts`, which the
 *               host has zeroed (moecl_topk_gating_with_counts)
 *   HAS_LOAD    likewise `load`, which the host does not zero: every call
 *               adds its ids to it (a runtime's load counter)
 *   HAS_VALID   the rows that are tokens, an int read from memory (a
 *               runtime replays one enqueued shape for any batch up to
 *               it); the rows past it are padding: ids -1, weights 0,
 *               counted nowhere
 * Integer sums: the histograms are the same in any order. */
#ifndef HAS_COUNTS
#define HAS_COUNTS 0
#endif
#ifndef HAS_LOAD
#define HAS_LOAD 0
#endif
#ifndef HAS_VALID
#define HAS_VALID 0
#endif
#if HAS_COUNTS
#define COUNT_INTO_COUNTS(e) atomic_inc(counts + (e))
#else
#define COUNT_INTO_COUNTS(e) ((void)0)
#endif
/* LOAD_MAP (cl/topk_gating.cl; absent, 0: the load is by expert id): the
 * number of local experts; the load is by local expert, load[map[id]]
 * where that is in [0, LOAD_MAP). */
#ifndef LOAD_MAP
#define LOAD_MAP 0
#endif
#if HAS_LOAD && LOAD_MAP
#define COUNT_INTO_LOAD(e)                                                                         \
    do {                                                                                           \
        const uint local_ = (uint)load_map[e];                                                     \
        if (local_ < LOAD_MAP)                                                                     \
            atomic_inc(load + local_);                                                             \
    } while (0)
#elif HAS_LOAD
#define COUNT_INTO_LOAD(e) atomic_inc(load + (e))
#else
#define COUNT_INTO_LOAD(e) ((void)0)
#endif
#define COUNT_ID(id)                                                                               \
    do {                                                                                           \
        const uint id_ = (uint)(id);                                                               \
        if (id_ < ID_EXPERTS) {                                                                    \
            COUNT_INTO_COUNTS(id_);                                                                \
            COUNT_INTO_LOAD(id_);                                                                  \
        }                                                                                          \
    } while (0)
#if HAS_VALID
/* The rows that are tokens: num_valid[off] clamped to [0, num_tokens]. */
static inline uint valid_rows(__global const int *num_valid, ulong off, uint num_tokens)
{
    const int n = num_valid[off];
    return n <= 0 ? 0u : min((uint)n, num_tokens);
}
#endif
/* The dispatch epilogue (cl/moe_align.cl) reads the ids as int32; the host
 * refuses other ids there. */
#if defined(ROUTE_DISPATCH) && ROUTE_DISPATCH && IDS_DTYPE != 0
#error "ROUTE_DISPATCH needs IDS_DTYPE 0 (int32 ids)"
#endif

#define GROUP_SIZE (NUM_GROUPS > 0 ? NUM_EXPERTS / NUM_GROUPS : NUM_EXPERTS)

/* Before step 1, the router's logit as the model has it (the grounded
 * router's defines; top-k gating sets neither): LOGIT_ROUND 2 rounds it to
 * bf16, 1 to f16 (to nearest, ties to even, as a bf16 or f16 gate GEMM
 * writes it), then SOFTCAP caps it, SOFTCAP * tanh(x / SOFTCAP). */
#ifndef LOGIT_ROUND
#define LOGIT_ROUND 0
#endif
static inline float logit_of(float x)
{
#if LOGIT_ROUND == 2
    /* NaN kept (a carry could make it inf); the carry of a tie's odd half
     * rounds up, an even one down. */
    const uint u = as_uint(x);
    x = isnan(x) ? x : as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
#elif LOGIT_ROUND == 1
    ushort h;
    vstore_half_rte(x, 0, (half *)&h);
    x = vload_half(0, (const half *)&h);
#endif
#ifdef SOFTCAP
    x = SOFTCAP * tanh(x / SOFTCAP);
#endif
    return x;
}

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
static inline float selection_score(float score, __global const bias_t *bias, uint e)
{
#if HAS_BIAS
    return score + LOAD_BIAS(bias, e);
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
 * by 1 either way. With RENORM_EPS the divisor is the models' `sum + eps`
 * as it stands, NaN included. */
#if defined(RENORM_EPS)
#define RENORM_DIVISOR(s) ((s) + RENORM_EPS)
#elif defined(RENORM_FLOOR)
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

/* ---- The CPU fast path's softmax (cl/topk_gating.cl, topk_rows_softmax;
 * replayed by cl/replay.cl): the row's max and sum and the chosen scores,
 * one definition each, so that replayed weights are the same bits. ---- */
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

/* Pass 1: each lane's largest logit (padding -inf); their max is the row's. */
static inline float16 fast_lane_max(__global const in_t *x)
{
    float16 lane_max = (float16)(-INFINITY);
    for (uint b = 0; b < BLOCKS16; b++) {
        const float16 v = load_block16(x, b * V16, -INFINITY);
        lane_max = v > lane_max ? v : lane_max;
    }
    return lane_max;
}

/* Pass 2, pair p of blocks: their logits (padding -inf) and exp(x - max),
 * added to the lanes' sums in acc. */
static inline void fast_sum_pair(__global const in_t *x, uint p, float row_max, float16 *acc, float16 *v0,
                                 float16 *v1, float16 *p0, float16 *p1)
{
    const uint e0 = 2 * p * V16, e1 = e0 + V16;
    *v0 = load_block16(x, e0, -INFINITY);
    *v1 = load_block16(x, e1, -INFINITY);
    *p0 = exp_nonpos16(*v0 - row_max);
    *p1 = exp_nonpos16(*v1 - row_max);
    *acc += *p0;
    *acc += *p1;
}

/* The row's sum from the lanes' sums, in a fixed order. */
static inline float fast_row_sum(float16 acc)
{
    const float8 s8 = acc.lo + acc.hi;
    const float4 s4 = s8.lo + s8.hi;
    return (s4.s0 + s4.s1) + (s4.s2 + s4.s3);
}

/* Step 5: the scores exp(x - max) / sum of the chosen logits
 * chosen_x[TOPK16] (past TOPK: -inf), into weights[TOPK16]. */
static inline void fast_chosen_scores(const float *chosen_x, float row_max, float row_sum, float *weights)
{
    for (uint j = 0; j < TOPK16; j += V16)
        vstore16(exp_nonpos16(vload16(0, chosen_x + j) - row_max) / row_sum, 0, weights + j);
}
#endif


static inline float8 load_bias_block(__global const bias_t *bias, uint e0)
{
#if HAS_BIAS
#if BIAS_DTYPE == 0
    if (e0 + BLOCK <= NUM_EXPERTS)
        return vload8(0, bias + e0);
#endif
    float t[BLOCK];
    for (uint l = 0; l < BLOCK; l++)
        t[l] = e0 + l < NUM_EXPERTS ? LOAD_BIAS(bias, e0 + l) : 0.0f;
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

/* Step 1 for the elementwise scorings, a block at a time (the replay
 * scores the chosen experts' blocks alone with it: the same bits). */
static inline float8 rows_elementwise_scores(float8 logit)
{
#if SCORING == 1
    return 1.0f / (1.0f + exp(-logit));
#else
    float t[BLOCK];
    vstore8(logit, 0, t);
    for (uint l = 0; l < BLOCK; l++)
        t[l] = elementwise_score(t[l]);
    return vload8(0, t);
#endif
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
#else
    for (uint b = 0; b < BLOCKS; b++)
        score[b] = rows_elementwise_scores(logit[b]);
#endif
}

/* Step 2: selection ranks (padding: RANK_NONE), and each block's largest. */
static inline void rows_selection_ranks(const float8 *score, __global const bias_t *bias, uint8 *rank,
                                        uint *block_max)
{
    for (uint b = 0; b < BLOCKS; b++) {
        rank[b] = select(select_rank8(score[b] + load_bias_block(bias, b * BLOCK)), (uint8)(RANK_NONE), past_end(b));
        block_max[b] = block_max_of(rank[b]);
    }
}

#if NUM_GROUPS > 0
/* Step 3: the TOPK_GROUP-th largest of the groups' keys: keys are unique,
 * so a group is kept exactly when its key is at least that. */
static inline ulong group_threshold(const ulong *group_key)
{
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

/* Step 3: keep the TOPK_GROUP groups of largest group score. Each group's
 * key goes to group_key[g]; the result is group_threshold's. */
static inline ulong rows_group_limit(const float8 *score, __global const bias_t *bias, ulong *group_key)
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
    return group_threshold(group_key);
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
static inline void rows_pipeline(const float8 *logit, __global const bias_t *bias, float scaling_factor,
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
static inline void team_selection_ranks(const float *value, bool active, uint lane, __global const bias_t *bias,
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
