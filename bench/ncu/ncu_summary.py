#!/usr/bin/env python3
"""The figures of each profiled kernel, from ncu's raw page
(`ncu -i REPORT --page raw --csv`): one column a kernel, one row a metric
in the units ncu gives (time, DRAM traffic against the peak, pipe utilisation, registers,
shared memory, occupancy, waves, L2 hit rate, shared-memory bank
conflicts), then each kernel's warp stall reasons, largest first, in
cycles per issued instruction.

    python3 bench/ncu/ncu_summary.py raw.csv
"""
import csv
import sys

ROWS = [
    ("time", "gpu__time_duration.sum"),
    ("SM clock", "gpc__cycles_elapsed.avg.per_second"),
    ("DRAM read", "dram__bytes_read.sum"),
    ("DRAM write", "dram__bytes_write.sum"),
    ("DRAM throughput", "dram__bytes.sum.per_second"),
    ("DRAM % peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory % peak (SOL)", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("SM % peak (SOL)", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("tensor (hmma) pipe % active", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("fma pipe % active", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("fma pipe inst % peak", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
    ("alu pipe % active", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    ("lsu pipe inst % peak", "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active"),
    ("issue slots % busy", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("shared ld instr", "smsp__sass_inst_executed_op_shared_ld.sum"),
    ("shared st instr", "smsp__sass_inst_executed_op_shared_st.sum"),
    ("global ld instr", "smsp__sass_inst_executed_op_global_ld.sum"),
    ("local ld instr", "smsp__sass_inst_executed_op_local_ld.sum"),
    ("local st instr", "smsp__sass_inst_executed_op_local_st.sum"),
    ("L1/shared % peak", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("L2 % peak", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("shared ld bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
    ("shared st bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
    ("shared ld wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"),
    ("shared st wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"),
    ("registers/thread", "launch__registers_per_thread"),
    ("static shared B/block", "launch__shared_mem_per_block_static"),
    ("block size", "launch__block_size"),
    ("grid size", "launch__grid_size"),
    ("waves/SM", "launch__waves_per_multiprocessor"),
    ("theoretical occupancy %", "sm__maximum_warps_per_active_cycle_pct"),
    ("achieved occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("blocks/SM limit regs", "launch__occupancy_limit_registers"),
    ("blocks/SM limit shared", "launch__occupancy_limit_shared_mem"),
    ("blocks/SM limit warps", "launch__occupancy_limit_warps"),
    ("warp cycles/issued inst", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("eligible warps/scheduler", "smsp__warps_eligible.avg.per_cycle_active"),
]
STALL = "smsp__average_warps_issue_stalled_"
STALL_END = "_per_issue_active.ratio"


def number(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def main(path):
    rows = list(csv.reader(open(path, newline="")))
    # ncu's raw CSV: a header row, a units row, then a row per kernel;
    # lines before the header (==PROF== messages) are skipped.
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head, kernels = rows[start], [r for r in rows[start + 2:] if len(r) == len(rows[start])]
    col = {n: i for i, n in enumerate(head)}
    names = [r[col["Kernel Name"]].split("__")[-1].split("(")[0][:18] for r in kernels]
    print("%-30s" % "metric" + "".join("%20s" % n for n in names))
    for label, metric in ROWS:
        if metric not in col:
            print("%-30s (not collected: %s)" % (label, metric))
            continue
        vals = [number(r[col[metric]]) for r in kernels]
        unit = rows[start + 1][col[metric]]
        print("%-30s" % ("%s [%s]" % (label, unit) if unit else label) +
              "".join("%20s" % ("-" if v is None else "%.4g" % v) for v in vals))
    for r, n in zip(kernels, names):
        stalls = sorted(((number(r[i]) or 0.0, h[len(STALL):-len(STALL_END)]) for h, i in col.items()
                         if h.startswith(STALL) and h.endswith(STALL_END) and "_not_issued" not in h), reverse=True)
        total = sum(v for v, _ in stalls) or 1.0
        print("stalls %s (cycles per issued instruction, %% of all): %s" % (
            n, ", ".join("%s %.2f (%.0f%%)" % (s, v, 100 * v / total) for v, s in stalls[:7])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
