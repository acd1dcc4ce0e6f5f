#!/usr/bin/env python3
"""instrument.py IN OUT (bench/ep_phase/ep_phase.c says how to use it): cl/ep_layout.cl with per-work-group phase clocks
(lane 0, clock64 and globaltimer) written over physical_ids[c*16..] at the end."""
import sys
s = open(sys.argv[1]).read()
def rep(old, new, count=1):
    global s
    assert s.count(old) >= 1, old
    s = s.replace(old, new, count)
rep("static void rank_chunk_fused(const ep_in *in,", """static inline ulong clk(void) { ulong t; asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)); return t; }
static inline ulong gtm(void) { ulong t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
static void rank_chunk_fused(ulong *tk, const ep_in *in,""")
# The keys phase ends at a barrier of its own after chunk_keys_fused's call
# (one more than the kernel has where a barrier follows the call already).
i = s.index("    chunk_keys_fused(in, tok0, tok_end, phys, kr")
i = s.index(";\n", i) + 2
s = s[:i] + "    barrier(CLK_LOCAL_MEM_FENCE);\n    *tk = clk();\n" + s[i:]
rep("""    if (lid == 0 && !alone())
        ticket(word, F_STARTED);""", """    ulong T[8], G0 = gtm(), G3, G4;
    T[0] = clk();
    if (lid == 0 && !alone())
        ticket(word, F_STARTED);""")
rep("rank_chunk_fused(&in,", "rank_chunk_fused(&T[1], &in,")
rep("""    for (uint i = lid; i < cols; i += FWG)
        peer_store(&matrix[(size_t)c * cols + i], cnt[i]);""", """    T[2] = clk();
    for (uint i = lid; i < cols; i += FWG)
        peer_store(&matrix[(size_t)c * cols + i], cnt[i]);""")
rep("""    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    if (lid == 0) {
        uint mode""", """    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    T[3] = clk(); G3 = gtm();
    if (lid == 0) {
        uint mode""")
rep("""    const bool wait = flag[0] == MODE_WAIT, alone_last = !wait && flag[1];
""", """    const bool wait = flag[0] == MODE_WAIT, alone_last = !wait && flag[1];
    T[4] = clk(); G4 = gtm();
""")
rep("""expert_counts, cnt, base, tile);
""", """expert_counts, cnt, base, tile);
    T[5] = clk();
""")
# after the starts: find the small-outputs/starts block end: the barrier before "for (uint i = lid; i < (tok1 - tok0)"
i = s.index("    for (uint i = lid; i < (tok1 - tok0) * in.top_k && wait; i += FWG) {")
s = s[:i] + "    T[6] = clk();\n" + s[i:]
rep("""    if (lid == 0 && !alone()) {
        const uint w = ticket(word, F_ENDED);""", """    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    T[7] = clk();
    const ulong G7 = gtm();
    if (lid == 0 && wait) {
        __global uint *o = (__global uint *)phys + (size_t)c * 16;
        for (int q = 1; q < 8; q++)
            o[q] = (uint)(T[q] - T[0]);
        o[8] = (uint)G0; o[9] = (uint)G3; o[10] = (uint)G4; o[11] = (uint)G7;
        uint sm; asm volatile("mov.u32 %0, %%smid;" : "=r"(sm)); o[12] = sm;
    }
    if (lid == 0 && !alone()) {
        const uint w = ticket(word, F_ENDED);""")
open(sys.argv[2], "w").write(s)
