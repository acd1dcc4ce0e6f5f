/* Kernel memory sizes for the host, from the same description the kernels
 * are compiled with (cl/layout.h; src/layout.c). Bytes; "local" is a
 * work-group's __local memory compiled into the kernel, "private" the large
 * private arrays of one work-item. */
#ifndef MOECL_KERNEL_LAYOUT_H
#define MOECL_KERNEL_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The kernels' argument records (layout_topk_args), the same type on both
 * sides. */
#include "../cl/layout.h"

/* One row's team top-k scratch (cl/common.cl team_topk), ept experts a lane. */
size_t moecl_layout_team_topk_row(unsigned team, unsigned ept, unsigned k);

/* topk_gating_team: rows rows of team lanes; softmax: SCORING 0 (sigmoid
 * needs less; true is a safe bound for either); shuffle: TEAM_SHUFFLE. */
size_t moecl_layout_topk_team_local(unsigned team, unsigned rows, unsigned experts, unsigned k, unsigned groups,
                                    bool softmax, bool shuffle);
size_t moecl_layout_topk_team_private(unsigned team, unsigned experts);
/* topk_gating_rows, the generic loop (the CPU fast path keeps less). */
size_t moecl_layout_topk_rows_private(unsigned experts, unsigned k, unsigned groups);

/* grounded_router_team, ept experts a lane. */
size_t moecl_layout_grounded_team_local(unsigned hidden, unsigned team, unsigned ept, unsigned rows, unsigned k);
size_t moecl_layout_grounded_team_private(unsigned ept);
/* grounded_router_tiled: tm tokens x tn experts, hidden steps of tk,
 * vectors of vec, db: two stages. */
size_t moecl_layout_grounded_tiled_local(unsigned tm, unsigned tn, unsigned tk, unsigned vec, unsigned db, unsigned k);
/* grounded_router_rows, tm tokens a work-item. */
size_t moecl_layout_grounded_rows_private(unsigned tm, unsigned experts, unsigned k);

/* moe_align: the __local arguments (count, scan and scatter take one
 * array of cols bytes; the one-group kernel two of cols and the slot
 * columns; the fused kernel two of cols) and the local memory compiled into each kernel. */
size_t moecl_layout_moe_align_cols(unsigned experts);
size_t moecl_layout_moe_align_slot_cols(uint64_t slots, bool warp_match);
size_t moecl_layout_moe_align_scan_static(unsigned scan_wg);
size_t moecl_layout_moe_align_scatter_static(unsigned wg);
size_t moecl_layout_moe_align_one_group_static(unsigned one_wg, bool warp_match);
size_t moecl_layout_moe_align_fused_static(unsigned fused_wg);
/* The fused kernel's whole local memory. */
size_t moecl_layout_moe_align_fused_local(unsigned experts, unsigned fused_wg);
/* The parallel fused kernel's (three arrays of cols) compiled-in and
 * whole local memory. */
size_t moecl_layout_moe_align_parallel_static(unsigned fused_wg);
size_t moecl_layout_moe_align_parallel_local(unsigned experts, unsigned fused_wg);
/* The expert-parallel layout's fused kernel: its launch-sized array (cols
 * count columns, ranks, chunk_slots slots a chunk, rows a pass) and its
 * compiled-in bytes (cl/layout.h). */
size_t moecl_layout_ep_fused_lm(unsigned fwg, size_t cols, unsigned ranks, size_t chunk_slots, unsigned top_k,
                                unsigned rows);
size_t moecl_layout_ep_fused_static(unsigned fwg);
/* The one-group kernel's whole local memory for a routing of slots slots. */
size_t moecl_layout_moe_align_one_group_local(unsigned experts, uint64_t slots, unsigned one_wg, bool warp_match);

#endif
