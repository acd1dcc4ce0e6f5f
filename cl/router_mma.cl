/* Grounded router on tensor cores (docs/routing.md, section 4): the GEMM
 * hidden @ ground^T through mma.sync with fp32 accumulation, then the same
 * g = router_logits + alpha * dot, top-k and softmax as grounded_router.cl
 * (whose helpers this file uses: it comes after it in the program).
 * Specialised at build time, besides grounded_router.cl's defines:
 *   KERNEL == 3                     this kernel
 *   PRECISION                       f32 only: 1 TF32, 2 3xTF32
 *   MMA_MI, MMA_NT                  a warp's m16 tiles and n8 tiles
 *   MMA_WM, MMA_WN                  warps along the tokens and the experts
 *   MMA_KW                          32-bit words of a row per k step
 *   MMA_EMULATE                     1: every mma instruction is replaced by
 *                                   a function that does what the PTX ISA
 *                                   says it does with the same per-lane
 *                                   fragments (portable; the default
 *                                   without MOECL_PTX)
 * A work-group of MMA_WM x MMA_WN warps computes TM = 16 MMA_MI MMA_WM
 * tokens by TN = 8 MMA_NT MMA_WN >= NUM_EXPERTS experts in one pass, so a
 * token's row of g is whole in local memory at the end. The hidden
 * dimension is streamed through two local stages, with the global loads
 * of the next two steps in registers while the current one is multiplied
 * (one barrier a step). Local memory holds 32-bit words: two f16/bf16
 * elements, or one f32; then the fragment of every lane is the same word
 * pattern for
 * m16n8k16 (16-bit) and m16n8k8 (tf32). */

#if KERNEL == 3

#ifndef MMA_EMULATE
#define MMA_EMULATE (!MOECL_PTX)
#endif
#if !MMA_EMULATE && !MOECL_PTX
#error "grounded_router_mma without MMA_EMULATE needs MOECL_PTX"
#endif
#ifndef PRECISION
#define PRECISION 0
#endif
#if IN_DTYPE == 0 && PRECISION != 1 && PRECISION != 2
#error "grounded_router_mma on f32 needs PRECISION 1 (TF32) or 2 (3xTF32)"
#endif

#define MMA_TM (16 * MMA_MI * MMA_WM)
#define MMA_TN (8 * MMA_NT * MMA_WN)
#define MMA_WG (32 * MMA_WM * MMA_WN)
#define MMA_EPW (IN_DTYPE == 0 ? 1 : 2) /* elements a word */
#define MMA_KS (MMA_KW + 4)             /* row stride in words: lanes 4g + t hit distinct banks */
#define MMA_STEP (MMA_KW * MMA_EPW)     /* hidden elements a k step */
#define MMA_KSTEPS ((HIDDEN_DIM + MMA_STEP - 1) / MMA_STEP)
#define MMA_VEC_ROW (MMA_KW / 4)        /* 4-word vectors a row of a stage */
#define MMA_VECS ((MMA_TM + MMA_TN) * MMA_VEC_ROW)
#define MMA_VPT ((MMA_VECS + MMA_WG - 1) / MMA_WG)
#define MMA_GS (MMA_TN + 1) /* stride of the g rows */

#if MMA_TN < NUM_EXPERTS
#error "grounded_router_mma: the experts must fit one pass (MMA_TN >= NUM_EXPERTS)"
#endif

/* ---- the instructions ------------------------------------------------ */

#if MMA_EMULATE
/* A warp's scratch: A (16 x 16) and B (16 x 8, k-major) as floats. */
#define MMA_EMU_FLOATS LAYOUT_MMA_EMU_FLOATS
#define MMA_EMU_ARGS , emu, lane
#define MMA_EMU_PARAMS , __local float *emu, uint lane

/* The float a 16-bit word stands for. */
static inline float mma_half_value(uint bits)
{
#if IN_DTYPE == 1
    const ushort h = (ushort)bits;
    return vload_half(0, (const half *)&h);
#else
    return as_float(bits << 16);
#endif
}

/* D = A B + C for the warp: each lane scatters its fragment registers to
 * where the PTX ISA's layout puts them (lane = 4 groupID + threadID),
 * then computes its four elements of D from the whole A and B, summing in
 * k order with fp32 roundings (the products are exact in fp32). Every
 * work-item of the work-group calls this in lockstep: it holds barriers. */
static inline void mma_emulated(float c[4], const uint a[4], const uint b[2], uint ksize MMA_EMU_PARAMS)
{
    const uint g = lane >> 2, t = lane & 3;
    __local float *A = emu;            /* [16][ksize] */
    __local float *B = emu + 16 * 16;  /* [ksize][8] */
    if (ksize == 16) {
        /* m16n8k16: a0 (g, 2t..2t+1), a1 (g+8, ..), a2 (g, 2t+8..), a3
         * (g+8, 2t+8..), the lower half the lower index; b0 (k 2t..2t+1,
         * n g), b1 (k 2t+8..). */
        for (uint i = 0; i < 4; i++) {
            const uint row = g + (i & 1) * 8, col = 2 * t + (i >> 1) * 8;
            A[row * 16 + col] = mma_half_value(a[i] & 0xffffu);
            A[row * 16 + col + 1] = mma_half_value(a[i] >> 16);
        }
        for (uint i = 0; i < 2; i++) {
            const uint k = 2 * t + i * 8;
            B[k * 8 + g] = mma_half_value(b[i] & 0xffffu);
            B[(k + 1) * 8 + g] = mma_half_value(b[i] >> 16);
        }
    } else {
        /* m16n8k8 tf32: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8,
         * t+4); b0 (k t, n g), b1 (k t+4, n g). */
        for (uint i = 0; i < 4; i++)
            A[(g + (i & 1) * 8) * 8 + t + (i >> 1) * 4] = as_float(a[i]);
        for (uint i = 0; i < 2; i++)
            B[(t + i * 4) * 8 + g] = as_float(b[i]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    /* c0, c1 (g, 2t..2t+1), c2, c3 (g+8, ..). */
    for (uint i = 0; i < 4; i++) {
        const uint row = g + (i >> 1) * 8, col = 2 * t + (i & 1);
        float d = c[i];
        for (uint k = 0; k < ksize; k++)
            d = fma(A[row * ksize + k], B[k * 8 + col], d);
        c[i] = d;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

/* cvt.rna.tf32.f32: round to nearest, ties away from zero (the magnitude
 * bits plus half of the dropped unit), 13 low mantissa bits cleared; inf
 * and NaN kept. */
static inline uint tf32_of(float x)
{
    const uint u = as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u)
        return u;
    return (u + 0x1000u) & 0xffffe000u;
}

#define MMA_K16(c, a, b) mma_emulated(c, a, b, 16 MMA_EMU_ARGS)
#define MMA_K8(c, a, b) mma_emulated(c, a, b, 8 MMA_EMU_ARGS)

#else /* the instructions themselves (MOECL_PTX) */
#define MMA_EMU_ARGS
#define MMA_EMU_PARAMS

#if IN_DTYPE == 1
#define MMA_K16_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#else
#define MMA_K16_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#endif

/* D = A B + C with the instruction op; the accumulators are separate
 * outputs and inputs (no read-write operands). */
#define MMA_DEFINE(name, op)                                                                       \
    static inline void name(float c[4], const uint a[4], const uint b[2])                          \
    {                                                                                              \
        float d0, d1, d2, d3;                                                                      \
        asm volatile(op " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"     \
                     : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)                                      \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), \
                       "f"(c[1]), "f"(c[2]), "f"(c[3]));                                           \
        c[0] = d0;                                                                                 \
        c[1] = d1;                                                                                 \
        c[2] = d2;                                                                                 \
        c[3] = d3;                                                                                 \
    }
MMA_DEFINE(mma_k16, MMA_K16_OP)
MMA_DEFINE(mma_k8, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")

static inline uint tf32_of(float x)
{
    uint r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

#define MMA_K16(c, a, b) mma_k16(c, a, b)
#define MMA_K8(c, a, b) mma_k8(c, a, b)
#endif

/* ---- the steps ------------------------------------------------------- */

/* 3xTF32's split: x = hi + lo with hi the tf32 of x and lo the tf32 of
 * the (exact) residual. A hi that rounds a finite x to inf is taken
 * truncated instead, and an infinite x has no residual, so that neither
 * turns a finite or infinite product into NaN. */
static inline void tf32_split(uint x, uint *hi, uint *lo)
{
    const float f = as_float(x);
    uint h = tf32_of(f);
    if (isinf(as_float(h)) && !isinf(f))
        h = x & 0xffffe000u;
    *hi = h;
    *lo = isinf(f) ? 0u : tf32_of(f - as_float(h));
}

/* Four words of row `row` (of `rows`) at word w of the step at element
 * k0: hidden elements k0 + w EPW .. , zero past the row count and the
 * hidden size. TF32 rounds here, once per element. aligned: the rows
 * start on 16 bytes (then one 16-byte load; vload's alignment is only the
 * element's, which NVIDIA's compiler splits into element loads). */
static inline uint4 mma_load4(__global const in_t *src, uint row, uint rows, uint k0, uint w, bool aligned)
{
    uint4 v = (uint4)(0u);
    const uint k = k0 + w * MMA_EPW;
    if (row >= rows || k >= HIDDEN_DIM)
        return v;
    __global const in_t *p = src + (size_t)row * HIDDEN_DIM;
    if (aligned && k + 4 * MMA_EPW <= HIDDEN_DIM) {
        v = *(__global const uint4 *)(p + k);
    } else if (k + 4 * MMA_EPW <= HIDDEN_DIM) {
#if IN_DTYPE == 0
        v = as_uint4(vload4(0, p + k));
#else
        v = as_uint4(vload8(0, p + k));
#endif
    } else {
        uint word[4] = {0u, 0u, 0u, 0u};
        for (uint e = 0; e < 4 * MMA_EPW && k + e < HIDDEN_DIM; e++)
#if IN_DTYPE == 0
            word[e] = as_uint(p[k + e]);
#else
            word[e / 2] |= (uint)p[k + e] << (16 * (e % 2));
#endif
        v = (uint4)(word[0], word[1], word[2], word[3]);
    }
#if IN_DTYPE == 0 && PRECISION == 1
    v = (uint4)(tf32_of(as_float(v.x)), tf32_of(as_float(v.y)), tf32_of(as_float(v.z)), tf32_of(as_float(v.w)));
#endif
    return v;
}

/* A step's hidden rows (TM) then ground rows (TN) from global memory into
 * registers: vector i of the step is row i / VEC_ROW, words 4 (i % VEC_ROW). */
static inline void mma_fetch(uint4 staged[MMA_VPT], __global const in_t *hidden, __global const in_t *ground,
                             uint row0, uint num_tokens, uint k0, uint lid, bool aligned)
{
    UNROLL
    for (uint v = 0; v < MMA_VPT; v++) {
        const uint i = lid + v * MMA_WG;
        const uint r = i / MMA_VEC_ROW, w = (i % MMA_VEC_ROW) * 4;
        if (i >= MMA_VECS)
            staged[v] = (uint4)(0u);
        else if (r < MMA_TM)
            staged[v] = mma_load4(hidden, row0 + r, num_tokens, k0, w, aligned);
        else
            staged[v] = mma_load4(ground, r - MMA_TM, NUM_EXPERTS, k0, w, aligned);
    }
}

/* The registers into a stage: rows 0..TM-1 hidden, then TN ground rows. */
static inline void mma_stage(const uint4 staged[MMA_VPT], __local uint *stage, uint lid)
{
    UNROLL
    for (uint v = 0; v < MMA_VPT; v++) {
        const uint i = lid + v * MMA_WG;
        if (i < MMA_VECS)
            vstore4(staged[v], 0, stage + (i / MMA_VEC_ROW) * MMA_KS + (i % MMA_VEC_ROW) * 4);
    }
}

/* One lane's fragment words of a 16-row (A) or 8-row (B) block at word w:
 * the same pattern for both instructions (see the file's comment). */
static inline void mma_frag_a(__local const uint *rows, uint w, uint g, uint t, uint a[4])
{
    a[0] = rows[g * MMA_KS + w + t];
    a[1] = rows[(g + 8) * MMA_KS + w + t];
    a[2] = rows[g * MMA_KS + w + t + 4];
    a[3] = rows[(g + 8) * MMA_KS + w + t + 4];
}

static inline void mma_frag_b(__local const uint *rows, uint w, uint g, uint t, uint b[2])
{
    b[0] = rows[g * MMA_KS + w + t];
    b[1] = rows[g * MMA_KS + w + t + 4];
}

/* The warp's tile of a stage: MMA_MI x MMA_NT mma per 8 words. */
static inline void mma_multiply(float acc[MMA_MI][MMA_NT][4], __local const uint *stage, uint wm, uint wn, uint g,
                                uint t MMA_EMU_PARAMS)
{
    __local const uint *arows = stage + wm * MMA_MI * 16 * MMA_KS;
    __local const uint *brows = stage + (MMA_TM + wn * MMA_NT * 8) * MMA_KS;
    for (uint w = 0; w < MMA_KW; w += 8) {
        uint a[MMA_MI][4];
        UNROLL
        for (uint i = 0; i < MMA_MI; i++)
            mma_frag_a(arows + i * 16 * MMA_KS, w, g, t, a[i]);
#if IN_DTYPE == 0 && PRECISION == 2
        /* 3xTF32: each fragment split once, not once per tile it meets
         * (inside the tile loops the splits keep the ALU pipe 74.8% busy
         * against 14% for the tensor pipe; split once: 789 against 1162 us
         * under ncu on the H200). */
        uint ah[MMA_MI][4], al[MMA_MI][4];
        UNROLL
        for (uint i = 0; i < MMA_MI; i++)
            UNROLL
            for (uint q = 0; q < 4; q++)
                tf32_split(a[i][q], &ah[i][q], &al[i][q]);
#endif
        UNROLL
        for (uint j = 0; j < MMA_NT; j++) {
            uint b[2];
            mma_frag_b(brows + j * 8 * MMA_KS, w, g, t, b);
#if IN_DTYPE == 0 && PRECISION == 2
            uint bh[2], bl[2];
            UNROLL
            for (uint q = 0; q < 2; q++)
                tf32_split(b[q], &bh[q], &bl[q]);
#endif
            UNROLL
            for (uint i = 0; i < MMA_MI; i++) {
#if IN_DTYPE != 0
                MMA_K16(acc[i][j], a[i], b);
#elif PRECISION == 1
                MMA_K8(acc[i][j], a[i], b);
#else
                /* The small products first, then hi * hi. */
                MMA_K8(acc[i][j], al[i], bh);
                MMA_K8(acc[i][j], ah[i], bl);
                MMA_K8(acc[i][j], ah[i], bh);
#endif
            }
        }
    }
}

/* Step s of the hidden loop: multiply the stage cur; stage step s + 1
 * (in the registers r) into next; fetch step s + 3 into r. A macro: as a
 * function taking r, Intel's CPU runtime gives wrong 3xTF32 ids
 * (emulated: 37 of 37 rows at 37 x 100 x 20) where pocl and oclgrind
 * agree with the reference. */
#define MMA_STEP_AT(cur, next, r, s)                                                               \
    do {                                                                                           \
        mma_multiply(acc, cur, wm, wn, g, t MMA_EMU_ARGS);                                         \
        if ((s) + 1 < MMA_KSTEPS)                                                                  \
            mma_stage(r, next, lid);                                                               \
        if ((s) + 3 < MMA_KSTEPS)                                                                  \
            mma_fetch(r, hidden, ground, row0, num_tokens, ((s) + 3) * MMA_STEP, lid, aligned);    \
        barrier(CLK_LOCAL_MEM_FENCE);                                                              \
    } while (0)

/* g = logits + alpha * dot of the warp's accumulators into the g rows
 * (c0, c1: row g, columns 2t, 2t+1; c2, c3: row g + 8). */
static inline void mma_store_g(const float acc[MMA_MI][MMA_NT][4], __local float *g_rows, __global const float *logits,
                               uint row0, uint num_tokens, float alpha, uint wm, uint wn, uint g, uint t)
{
    UNROLL
    for (uint i = 0; i < MMA_MI; i++)
        UNROLL
        for (uint j = 0; j < MMA_NT; j++)
            UNROLL
            for (uint q = 0; q < 4; q++) {
                const uint m = (wm * MMA_MI + i) * 16 + g + (q >> 1) * 8;
                const uint e = (wn * MMA_NT + j) * 8 + 2 * t + (q & 1);
                const uint tok = row0 + m;
                if (tok < num_tokens && e < NUM_EXPERTS)
                    g_rows[m * MMA_GS + e] = G_OF(LOGIT_AT(tok, e), acc[i][j][q]);
            }
}

__kernel __attribute__((reqd_work_group_size(MMA_WG, 1, 1))) void
grounded_router_mma(__global const in_t *hidden, ulong hidden_off, __global const float *logits, ulong logits_off,
                    __global const in_t *ground, ulong ground_off, OUTPUT_PARAMS)
{
    /* Two stages, and after the hidden loop the g rows in the same words. */
    __local uint stages[LAYOUT_MMA_WORDS(MMA_TM, MMA_TN, MMA_KW)];
#if MMA_EMULATE
    __local float emu_all[MMA_WM * MMA_WN * MMA_EMU_FLOATS];
#endif
    const uint lid = get_local_id(0);
    const uint lane = lid % 32, warp = lid / 32;
    const uint wm = warp / MMA_WN, wn = warp % MMA_WN;
    const uint g = lane >> 2, t = lane & 3;
    const uint row0 = get_group_id(0) * MMA_TM;
#if MMA_EMULATE
    __local float *emu = emu_all + warp * MMA_EMU_FLOATS;
#endif
    OFFSET_OUTPUTS();
    ROUTE_EXTRAS(extras);
    /* Rows of a multiple of 16 bytes from 16-byte aligned bases (the
     * caller's offsets decide). */
    const bool aligned = (HIDDEN_DIM * sizeof(in_t)) % 16 == 0 && ((size_t)hidden & 15) == 0 &&
                         ((size_t)ground & 15) == 0;

    float acc[MMA_MI][MMA_NT][4];
    UNROLL
    for (uint i = 0; i < MMA_MI; i++)
        UNROLL
        for (uint j = 0; j < MMA_NT; j++)
            UNROLL
            for (uint q = 0; q < 4; q++)
                acc[i][j][q] = 0.0f;

    /* Two steps in flight from global memory: registers r0 and r1 take
     * the even and odd steps, and at step s the one holding step s + 1 is
     * staged into the local stage free since step s - 1, then reloaded
     * with step s + 3. The loop goes two steps at a time so that neither
     * set of registers is indexed at run time. */
    uint4 r0[MMA_VPT], r1[MMA_VPT];
    __local uint *const l0 = stages, *const l1 = stages + (MMA_TM + MMA_TN) * MMA_KS;
    mma_fetch(r0, hidden, ground, row0, num_tokens, 0, lid, aligned);
    mma_stage(r0, l0, lid);
    if (MMA_KSTEPS > 1)
        mma_fetch(r1, hidden, ground, row0, num_tokens, MMA_STEP, lid, aligned);
    if (MMA_KSTEPS > 2)
        mma_fetch(r0, hidden, ground, row0, num_tokens, 2 * MMA_STEP, lid, aligned);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = 0; s < MMA_KSTEPS; s += 2) {
        MMA_STEP_AT(l0, l1, r1, s);
        if (s + 1 < MMA_KSTEPS)
            MMA_STEP_AT(l1, l0, r0, s + 1);
    }

    __local float *g_rows = (__local float *)stages;
    mma_store_g(acc, g_rows, logits, row0, num_tokens, alpha, wm, wn, g, t);
    barrier(CLK_LOCAL_MEM_FENCE);
    /* The gating of each token's row, whole in local memory (every expert
     * of a token is in the tile; cl/grounded_router.cl). */
    gate_local_rows(g_rows, MMA_GS, MMA_TM, row0, num_tokens, lid, hidden, bias, scaling_factor, pairs, weights, ids,
                    &extras);
}
#endif
