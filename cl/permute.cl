/* Permute and combine around the expert GEMMs (docs/routing.md, "Permute
 * and combine"): memory-bound row copies and weighted row sums.
 *
 * Build-time defines (src/permute.c):
 *   IN_DTYPE, OUT_DTYPE  0 f32, 1 f16, 2 bf16: the rows read and written
 *   SHARED_DTYPE         combine's shared expert rows, where HAS_SHARED
 *   HAS_SHARED           0 or 1
 * The launch shape is an argument: tpr work-items share a row (1 on CPUs,
 * up to the work-group on GPUs), rpg rows a work-group. A row goes in
 * vectors of four columns (vload4 needs only the element's alignment, so
 * every row start serves), then a scalar tail of hidden % 4. OpenCL C 1.2,
 * no extensions: 16-bit values travel as ushort words, f16 through
 * vload_half and vstore_half_rte. */

/* Products and sums are rounded one by one, as the documented order says:
 * no contraction into fma. The pragma is not enough: Intel's CPU runtime
 * fuses the product into the sum regardless. So each product is
 * fma(w, y, +0), which is the rounded product and which no compiler may
 * fold into the sum after it (fma(w, y, +0) turns a -0 product into +0;
 * the sum never holds -0, since it starts at +0, so the bits agree). */
#pragma OPENCL FP_CONTRACT OFF

#ifndef IN_DTYPE
#define IN_DTYPE 0
#endif
#ifndef OUT_DTYPE
#define OUT_DTYPE 0
#endif
#ifndef SHARED_DTYPE
#define SHARED_DTYPE 0
#endif
#ifndef HAS_SHARED
#define HAS_SHARED 0
#endif

/* bf16 of f: the upper half of its bits rounded to nearest even; a NaN
 * keeps its sign and upper payload and is made quiet (cl/gating.cl's
 * STORE_WEIGHT rounds the same way). */
static inline ushort pm_bf16_of(float f)
{
    const uint u = as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (ushort)((u >> 16) | 0x0040u);
    return (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline ushort4 pm_bf16_of4(float4 f)
{
    return (ushort4)(pm_bf16_of(f.x), pm_bf16_of(f.y), pm_bf16_of(f.z), pm_bf16_of(f.w));
}

/* Element types and widening loads of each dtype (exact), one and four. */
#define PM_TYPE_0 float
#define PM_TYPE_1 ushort
#define PM_TYPE_2 ushort
#define PM_TYPE_(d) PM_TYPE_##d
#define PM_TYPE(d) PM_TYPE_(d)
#define PM_VTYPE_0 float4
#define PM_VTYPE_1 ushort4
#define PM_VTYPE_2 ushort4
#define PM_VTYPE_(d) PM_VTYPE_##d
#define PM_VTYPE(d) PM_VTYPE_(d)

#define PM_LOAD1_0(p, i) ((p)[i])
#define PM_LOAD1_1(p, i) vload_half((i), (__global const half *)(p))
#define PM_LOAD1_2(p, i) as_float((uint)(p)[i] << 16)
#define PM_LOAD4_0(p, v) vload4((v), (p))
#define PM_LOAD4_1(p, v) vload_half4((v), (__global const half *)(p))
#define PM_LOAD4_2(p, v) as_float4(convert_uint4(vload4((v), (p))) << 16)
#define PM_LOAD1_(d, p, i) PM_LOAD1_##d(p, i)
#define PM_LOAD4_(d, p, v) PM_LOAD4_##d(p, v)
#define PM_LOAD1(d, p, i) PM_LOAD1_(d, p, i)
#define PM_LOAD4(d, p, v) PM_LOAD4_(d, p, v)

/* Narrowing stores, to nearest even. */
#define PM_STORE1_0(p, i, x) ((p)[i] = (x))
#define PM_STORE1_1(p, i, x) vstore_half_rte((x), (i), (__global half *)(p))
#define PM_STORE1_2(p, i, x) ((p)[i] = pm_bf16_of(x))
#define PM_STORE4_0(p, v, x) vstore4((x), (v), (p))
#define PM_STORE4_1(p, v, x) vstore_half4_rte((x), (v), (__global half *)(p))
#define PM_STORE4_2(p, v, x) vstore4(pm_bf16_of4(x), (v), (p))
#define PM_STORE1_(d, p, i, x) PM_STORE1_##d(p, i, x)
#define PM_STORE4_(d, p, v, x) PM_STORE4_##d(p, v, x)
#define PM_STORE1(d, p, i, x) PM_STORE1_(d, p, i, x)
#define PM_STORE4(d, p, v, x) PM_STORE4_(d, p, v, x)

typedef PM_TYPE(IN_DTYPE) pm_in_t;
typedef PM_TYPE(OUT_DTYPE) pm_out_t;
typedef PM_TYPE(SHARED_DTYPE) pm_shared_t;

/* The row this work-item serves and its lane among the row's tpr. */
#define PM_ROW(a) ((uint)get_group_id(0) * (a).rpg + (uint)get_local_id(0) / (a).tpr)
#define PM_LANE(a) ((uint)get_local_id(0) % (a).tpr)

/* ---------------------------------------------------------------------- */
/* permute_rows: out[p] = hidden_states[sorted_token_ids[p] / top_k]       */
/* ---------------------------------------------------------------------- */

__kernel void permute_rows(__global const pm_in_t *x, __global const int *sorted, __global const int *post,
                           __global pm_out_t *out, layout_permute_args a)
{
    const uint row = PM_ROW(a), lane = PM_LANE(a);
    /* The rows moe_align filled; those past them are left as they are. */
    const int n = post[a.post_off];
    const uint limit = n < 0 ? 0u : min((uint)n, a.num_padded);
    if (row >= limit)
        return;
    const uint slot = (uint)sorted[a.ids_off + row];
    __global pm_out_t *o = out + a.out_off + (size_t)row * a.hidden;
    const uint nv = a.hidden / 4;
    if (slot >= a.num_slots) { /* padding: the sentinel, or any other non-slot */
        for (uint v = lane; v < nv; v += a.tpr)
            vstore4((PM_VTYPE(OUT_DTYPE))(0), v, o);
        for (uint i = nv * 4 + lane; i < a.hidden; i += a.tpr)
            o[i] = 0;
        return;
    }
    __global const pm_in_t *src = x + a.in_off + (size_t)(slot / a.top_k) * a.hidden;
#if IN_DTYPE == OUT_DTYPE
    /* The same dtype: the words themselves, as integers, so that no device
     * touches a NaN's payload. */
#if IN_DTYPE == 0
    __global const uint *from = (__global const uint *)src;
    __global uint *to = (__global uint *)o;
#else
    __global const ushort *from = src;
    __global ushort *to = o;
#endif
    for (uint v = lane; v < nv; v += a.tpr)
        vstore4(vload4(v, from), v, to);
    for (uint i = nv * 4 + lane; i < a.hidden; i += a.tpr)
        to[i] = from[i];
#else
    for (uint v = lane; v < nv; v += a.tpr)
        PM_STORE4(OUT_DTYPE, o, v, PM_LOAD4(IN_DTYPE, src, v));
    for (uint i = nv * 4 + lane; i < a.hidden; i += a.tpr)
        PM_STORE1(OUT_DTYPE, o, i, PM_LOAD1(IN_DTYPE, src, i));
#endif
}

/* ---------------------------------------------------------------------- */
/* permute_scatter: permute_rows' result, each hidden row read once         */
/* ---------------------------------------------------------------------- */

/* Rows [0, num_tokens) of the launch are tokens: token t's row is read
 * once, a unit at a time, and each unit written to every position
 * slot_positions[t][j] below n. The rows after them take zero_rows rows p
 * of out each (most are slots: a launch row each would be mostly idle
 * work-groups): zeroed where p < n and sorted_token_ids[p] is not a slot,
 * as permute_rows pads. Where slot_positions is the inverse of
 * sorted_token_ids (moe_align's outputs of one call) every row below n has
 * exactly one writer, and its bits are permute_rows'. A unit is a uint4
 * (16 bytes) where a.wide says every row start is 16-byte aligned, else
 * four elements (vload4 needs only the element's alignment) and a scalar
 * tail. */

/* Row p (< n) of out: zero. */
static void ps_zero_row(__global pm_out_t *o, layout_scatter_args a, uint lane)
{
    if (a.wide) {
        __global uint4 *to = (__global uint4 *)o;
        const uint nw = a.hidden * (uint)sizeof(pm_out_t) / 16;
        for (uint v = lane; v < nw; v += a.tpr)
            to[v] = (uint4)(0);
        return;
    }
    const uint nv = a.hidden / 4;
    for (uint v = lane; v < nv; v += a.tpr)
        vstore4((PM_VTYPE(OUT_DTYPE))(0), v, o);
    for (uint i = nv * 4 + lane; i < a.hidden; i += a.tpr)
        o[i] = 0;
}

/* Position j of the token (p: its top_k positions) as a row of out, or
 * limit where it names none below n (an invalid slot's -1, anything out
 * of range). */
#define PS_AT(p, j, limit) ((uint)(p)[j] < (limit) ? (uint)(p)[j] : (limit))

#if IN_DTYPE == OUT_DTYPE
/* The same dtype: the words themselves, as integers, so that no device
 * touches a NaN's payload. */
#if IN_DTYPE == 0
typedef uint pm_word_t;
#define PM_WORD4 uint4
#else
typedef ushort pm_word_t;
#define PM_WORD4 ushort4
#endif

static void ps_scatter_row(__global const pm_in_t *src, __global const int *p, uint limit, __global pm_out_t *out,
                           layout_scatter_args a, uint lane)
{
    if (a.wide) {
        __global const uint4 *from = (__global const uint4 *)src;
        const uint nw = a.hidden * (uint)sizeof(pm_in_t) / 16;
        for (uint v = lane; v < nw; v += a.tpr) {
            const uint4 w = from[v];
            for (uint j = 0; j < a.top_k; j++) {
                const uint at = PS_AT(p, j, limit);
                if (at < limit)
                    ((__global uint4 *)(out + (size_t)at * a.hidden))[v] = w;
            }
        }
        return;
    }
    __global const pm_word_t *from = (__global const pm_word_t *)src;
    const uint nv = a.hidden / 4;
    for (uint v = lane; v < nv; v += a.tpr) {
        const PM_WORD4 w = vload4(v, from);
        for (uint j = 0; j < a.top_k; j++) {
            const uint at = PS_AT(p, j, limit);
            if (at < limit)
                vstore4(w, v, (__global pm_word_t *)(out + (size_t)at * a.hidden));
        }
    }
    for (uint i = nv * 4 + lane; i < a.hidden; i += a.tpr) {
        const pm_word_t w = from[i];
        for (uint j = 0; j < a.top_k; j++) {
            const uint at = PS_AT(p, j, limit);
            if (at < limit)
                ((__global pm_word_t *)(out + (size_t)at * a.hidden))[i] = w;
        }
    }
}
#else
/* Another dtype: widened once, narrowed at each store (to nearest even,
 * as permute_rows). */
static void ps_scatter_row(__global const pm_in_t *src, __global const int *p, uint limit, __global pm_out_t *out,
                           layout_scatter_args a, uint lane)
{
    const uint nv = a.hidden / 4;
    for (uint v = lane; v < nv; v += a.tpr) {
        const float4 f = PM_LOAD4(IN_DTYPE, src, v);
        for (uint j = 0; j < a.top_k; j++) {
            const uint at = PS_AT(p, j, limit);
            if (at < limit)
                PM_STORE4(OUT_DTYPE, out + (size_t)at * a.hidden, v, f);
        }
    }
    for (uint i = nv * 4 + lane; i < a.hidden; i += a.tpr) {
        const float f = PM_LOAD1(IN_DTYPE, src, i);
        for (uint j = 0; j < a.top_k; j++) {
            const uint at = PS_AT(p, j, limit);
            if (at < limit)
                PM_STORE1(OUT_DTYPE, out + (size_t)at * a.hidden, i, f);
        }
    }
}
#endif

__kernel void permute_scatter(__global const pm_in_t *x, __global const int *sorted, __global const int *post,
                              __global const int *positions, __global pm_out_t *out, layout_scatter_args a)
{
    const uint row = PM_ROW(a), lane = PM_LANE(a);
    const int n = post[a.post_off];
    const uint limit = n < 0 ? 0u : min((uint)n, a.num_padded);
    if (row < a.num_tokens) {
        ps_scatter_row(x + a.in_off + (size_t)row * a.hidden, positions + a.pos_off + (size_t)row * a.top_k, limit,
                       out + a.out_off, a, lane);
        return;
    }
    const uint first = (row - a.num_tokens) * a.zero_rows;
    if (first >= limit)
        return;
    const uint last = min(limit - first, a.zero_rows) + first;
    for (uint p = first; p < last; p++) /* a slot's row is its token's to write */
        if ((uint)sorted[a.ids_off + p] >= a.num_tokens * a.top_k)
            ps_zero_row(out + a.out_off + (size_t)p * a.hidden, a, lane);
}

/* ---------------------------------------------------------------------- */
/* combine_rows: out[t] = sum_j w[t][j] * expert_out[pos[t][j]] (+ shared) */
/* ---------------------------------------------------------------------- */

__kernel void combine_rows(__global const pm_in_t *y, __global const float *weights, __global const int *pos,
                           __global const pm_shared_t *shared, __global pm_out_t *out, layout_combine_args a)
{
    const uint row = PM_ROW(a), lane = PM_LANE(a);
    if (row >= a.num_tokens)
        return;
    __global const float *w = weights + a.weights_off + (size_t)row * a.top_k;
    __global const int *p = pos + a.pos_off + (size_t)row * a.top_k;
    __global pm_out_t *o = out + a.out_off + (size_t)row * a.hidden;
#if HAS_SHARED
    __global const pm_shared_t *s = shared + a.shared_off + (size_t)row * a.hidden;
#else
    (void)shared;
#endif
    const uint nv = a.hidden / 4;
    for (uint v = lane; v < nv; v += a.tpr) {
        float4 acc = (float4)(0.0f);
        for (uint j = 0; j < a.top_k; j++) {
            const uint at = (uint)p[j];
            if (at < a.num_padded) {
                const float4 prod = fma((float4)(w[j]), PM_LOAD4(IN_DTYPE, y + a.in_off + (size_t)at * a.hidden, v),
                                        (float4)(0.0f));
                acc = acc + prod;
            }
        }
#if HAS_SHARED
        acc = acc + PM_LOAD4(SHARED_DTYPE, s, v);
#endif
        PM_STORE4(OUT_DTYPE, o, v, acc);
    }
    for (uint i = nv * 4 + lane; i < a.hidden; i += a.tpr) {
        float acc = 0.0f;
        for (uint j = 0; j < a.top_k; j++) {
            const uint at = (uint)p[j];
            if (at < a.num_padded) {
                const float prod = fma(w[j], PM_LOAD1(IN_DTYPE, y + a.in_off + (size_t)at * a.hidden, i), 0.0f);
                acc = acc + prod;
            }
        }
#if HAS_SHARED
        acc = acc + PM_LOAD1(SHARED_DTYPE, s, i);
#endif
        PM_STORE1(OUT_DTYPE, o, i, acc);
    }
}
