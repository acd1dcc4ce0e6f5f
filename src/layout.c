/* The host's view of cl/layout.h: each function is one of its macros,
 * evaluated in size_t. */
#include "kernel_layout.h"

#include "../cl/layout.h"

static unsigned ept_of(unsigned experts, unsigned team) { return (experts + team - 1) / team; }

size_t moecl_layout_team_topk_row(unsigned team, unsigned ept, unsigned k)
{
    return LAYOUT_TEAM_TOPK_BYTES((size_t)team, (size_t)ept, (size_t)k);
}

size_t moecl_layout_topk_team_local(unsigned team, unsigned rows, unsigned experts, unsigned k, unsigned groups,
                                    bool softmax, bool shuffle)
{
    const size_t ept = ept_of(experts, team);
    return LAYOUT_TOPK_TEAM_LOCAL_BYTES((size_t)team, (size_t)rows, ept, (size_t)k, (size_t)experts,
                                        (size_t)groups, softmax, shuffle);
}

size_t moecl_layout_topk_team_private(unsigned team, unsigned experts)
{
    return LAYOUT_TOPK_TEAM_PRIVATE_BYTES((size_t)ept_of(experts, team));
}

size_t moecl_layout_topk_rows_private(unsigned experts, unsigned k, unsigned groups)
{
    return LAYOUT_TOPK_ROWS_PRIVATE_BYTES((size_t)experts, (size_t)k, (size_t)groups);
}

size_t moecl_layout_grounded_team_local(unsigned hidden, unsigned team, unsigned ept, unsigned rows, unsigned k)
{
    return LAYOUT_GROUNDED_TEAM_LOCAL_BYTES((size_t)hidden, (size_t)team, (size_t)ept, (size_t)rows, (size_t)k);
}

size_t moecl_layout_grounded_team_private(unsigned ept) { return LAYOUT_GROUNDED_TEAM_PRIVATE_BYTES((size_t)ept); }

size_t moecl_layout_grounded_tiled_local(unsigned tm, unsigned tn, unsigned tk, unsigned vec, unsigned db, unsigned k)
{
    return LAYOUT_GROUNDED_TILED_LOCAL_BYTES((size_t)tm, (size_t)tn, (size_t)tk, (size_t)vec, (size_t)db, (size_t)k);
}

size_t moecl_layout_grounded_rows_private(unsigned tm, unsigned experts, unsigned k)
{
    return LAYOUT_GROUNDED_ROWS_PRIVATE_BYTES((size_t)tm, (size_t)experts, (size_t)k);
}

size_t moecl_layout_moe_align_cols(unsigned experts) { return LAYOUT_ALIGN_COLS_BYTES((size_t)experts); }

size_t moecl_layout_moe_align_slot_cols(uint64_t slots, bool warp_match)
{
    return (size_t)LAYOUT_ALIGN_SLOT_COLS_BYTES(slots, warp_match);
}

size_t moecl_layout_moe_align_scan_static(unsigned scan_wg) { return LAYOUT_ALIGN_SCAN_STATIC_BYTES((size_t)scan_wg); }

size_t moecl_layout_moe_align_scatter_static(unsigned wg) { return LAYOUT_ALIGN_SCATTER_STATIC_BYTES((size_t)wg); }

size_t moecl_layout_moe_align_one_group_static(unsigned one_wg, bool warp_match)
{
    return LAYOUT_ALIGN_ONE_GROUP_STATIC_BYTES((size_t)one_wg, warp_match);
}

size_t moecl_layout_moe_align_fused_static(unsigned fused_wg) { return LAYOUT_ALIGN_FUSED_STATIC_BYTES((size_t)fused_wg); }

size_t moecl_layout_ep_fused_lm(unsigned fwg, size_t cols, unsigned ranks, size_t chunk_slots, unsigned top_k,
                                unsigned rows)
{
    return LAYOUT_EP_FUSED_LM_BYTES((size_t)fwg, cols, (size_t)ranks, chunk_slots, (size_t)top_k, (size_t)rows);
}

size_t moecl_layout_ep_fused_static(unsigned fwg) { return LAYOUT_EP_FUSED_STATIC_BYTES((size_t)fwg); }

size_t moecl_layout_moe_align_fused_local(unsigned experts, unsigned fused_wg)
{
    return 2 * moecl_layout_moe_align_cols(experts) + moecl_layout_moe_align_fused_static(fused_wg);
}

size_t moecl_layout_moe_align_parallel_static(unsigned fused_wg)
{
    return LAYOUT_ALIGN_PARALLEL_STATIC_BYTES((size_t)fused_wg);
}

size_t moecl_layout_moe_align_parallel_local(unsigned experts, unsigned fused_wg)
{
    return 3 * moecl_layout_moe_align_cols(experts) + moecl_layout_moe_align_parallel_static(fused_wg);
}

size_t moecl_layout_moe_align_one_group_local(unsigned experts, uint64_t slots, unsigned one_wg, bool warp_match)
{
    return 2 * moecl_layout_moe_align_cols(experts) + moecl_layout_moe_align_slot_cols(slots, warp_match) +
           moecl_layout_moe_align_one_group_static(one_wg, warp_match);
}
