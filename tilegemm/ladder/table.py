"""``tilegemm ladder``: the ladder's table, its notes, its chart and the command."""
import argparse
import os
import sys
import textwrap
import time

import numba
import numpy as np

from tilegemm.ladder.runner import (CALL_BUDGET, measure_blocking_check, measure_contention,
                                    run_ladder)
from tilegemm.tuning.blocking import blocking


def format_table(results):
    """The ladder as a Markdown table (prints well in a terminal, pastes into docs)."""
    head = ("| rung | what | n | threads | GFLOPS | % of peak | x prev | x rung 0 "
            "| numpy GFLOPS | first call s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(results):
        prev = f"{r.gflops / results[i - 1].gflops:.2f}" if i else "-"
        base = f"{r.gflops / results[0].gflops:.1f}"
        lines.append(f"| {r.rung.number} | {r.rung.title} | {r.n} | {r.threads} | {r.gflops:.1f} "
                     f"| {100 * r.gflops / r.peak_gflops:.1f} | {prev} | {base} "
                     f"| {r.numpy_gflops:.1f} | {r.first_call_s:.2f} |")
    return "\n".join(lines)


#: Why a rung may not beat the one before it on some hosts, printed under the table
#: when it does not.
SLOWER_BECAUSE = {
    3: "like rung 2 it stores every sum to memory at every k step (its local array here, "
       "a row of C there), and that store traffic bounds both; packing only makes the reads "
       "cheaper (rung 4 keeps the sums in registers)",
    4: "plain Numba's vectors here are as wide as LLVM's preferred width for this CPU, "
       "and each sum is reduced across its vector once per tile",
}
#: Repeats of one rung further apart than this (slowest over fastest, minus 1) mean
#: another program shared the cores.
SPREAD_WARNING = 0.25
#: A thread rung scaling less than this fraction of its thread count over rung 5 also does.
SCALING_WARNING = 0.75


#: A rung running below this fraction of the one before it gets a line saying why.
SLOWER_MARGIN = 0.95


#: Longest one call of rung 1 may be predicted to take (at its measured rate) for
#: :func:`blocking_check_n` to time rungs 1 and 2 past a quarter of L3.
CHECK_BUDGET = 1.0


def past_l3_quarter(n, l3_bytes, itemsize=4):
    """The first size ``n * 2**i`` whose B is past a quarter of L3 (``l3_bytes``), its
    share on a VM with neighbours; None when L3 is unknown or B is past it already."""
    if not l3_bytes or n * n * itemsize > l3_bytes // 4:
        return None
    past = n
    while past * past * itemsize <= l3_bytes // 4:
        past *= 2
    return past


def blocking_check_n(results, l3_bytes):
    """The size at which to time rungs 1 and 2 again (:func:`measure_blocking_check`),
    or None: only when rung 2 ran below :data:`SLOWER_MARGIN` times rung 1 because B
    sits in L3, and rung 1's call there is predicted under :data:`CHECK_BUDGET`."""
    rates = {r.rung.number: r for r in results}
    if 1 not in rates or 2 not in rates or rates[2].n != rates[1].n:
        return None
    loop = rates[1]
    if rates[2].gflops >= SLOWER_MARGIN * loop.gflops:
        return None
    past = past_l3_quarter(loop.n, l3_bytes)
    if past is None or 2 * past ** 3 / (loop.gflops * 1e9) > CHECK_BUDGET:
        return None
    return past


def blocking_reason(n, l3_bytes, itemsize=4, check=None):
    """Why rung 2 may not beat rung 1 at size ``n``: rung 1 waits on memory only once
    B outgrows a quarter of L3 (``l3_bytes``; 0 when unknown), its share on a VM with
    neighbours (on a 32 MiB Zen 3 L3, float32: rung 1 20-27 GFLOPS from n = 128 to
    1024, 8-11 at n = 2048, where rung 2 held 20-23).  ``check``, a
    :class:`~tilegemm.ladder.runner.BlockingCheck`, adds the two rungs' rates there."""
    b_bytes = n * n * itemsize
    past = past_l3_quarter(n, l3_bytes, itemsize)
    if past is None:
        return ("both store a sum to memory per multiply-add, and on this CPU that bounds "
                "them more than where B comes from")
    reason = (f"B ({b_bytes / 2 ** 20:.0f} MiB) sits in this CPU's L3 "
              f"({l3_bytes / 2 ** 20:.0f} MiB), so rung 1 does not wait on memory and "
              f"blocking has nothing to save yet; with B past a quarter of it (n = {past}) ")
    if check is None:
        return reason + "rung 1 falls and rung 2 holds (docs/cache-blocking.md)"
    return reason + (f"they ran {check.loop_gflops:.1f} and {check.blocked_gflops:.1f} GFLOPS, "
                     f"rung 2 {check.blocked_gflops / check.loop_gflops:.2f}x rung 1 (measured "
                     f"now, n = {check.n})")


def slower_notes(results, l3_bytes=0, check=None):
    """One line for each rung below :data:`SLOWER_MARGIN` times the one before it,
    saying why (:data:`SLOWER_BECAUSE`, :func:`blocking_reason` with ``check``) and
    whether the repeats' spread covers the gap."""
    notes = []
    for prev, r in zip(results, results[1:]):
        ratio = r.gflops / prev.gflops
        if ratio >= SLOWER_MARGIN:
            continue
        if r.rung.number == 2:
            reason = blocking_reason(r.n, l3_bytes, check=check)
        else:
            reason = SLOWER_BECAUSE.get(r.rung.number, "see the rung's docstring")
        within = r.gflops * (1 + max(r.spread, prev.spread)) >= prev.gflops
        spread = " (within their runs' spread)" if within else ""
        notes.append(f"rung {r.rung.number} ran {ratio:.2f}x rung {prev.rung.number}{spread} "
                     f"here: {reason}.")
    return notes


def smaller_n_notes(results, n):
    """One line for each rung measured below ``n``, saying why."""
    return [f"rung {r.rung.number} ran at n = {r.n}: one call at n = {2 * r.n} would take more "
            f"than {CALL_BUDGET} s; GFLOPS are rates, so the ratios still compare"
            for r in results if r.n < n]


def width_notes(results, dtype=np.float32):
    """A line when rung 4's plain-Numba vectors are narrower than the peak's FMAs (its
    ceiling is then that fraction of the peak), else none."""
    from tilegemm.ladder.register_tile import vector_bits
    rung4 = next((r for r in results if r.rung.number == 4), None)
    if rung4 is None:
        return []
    peak_bits = blocking(dtype).lanes * np.dtype(dtype).itemsize * 8
    bits = vector_bits()
    if bits >= peak_bits:
        return []
    ceiling = rung4.peak_gflops * bits / peak_bits
    return [f"rung 4 is plain Numba, and LLVM vectorised it {bits} bits wide on this CPU (its "
            f"tuning for the CPU prefers that width) against the peak's {peak_bits}-bit FMAs: "
            f"its ceiling here is {100 * bits / peak_bits:.0f}% of the peak, and it ran at "
            f"{100 * rung4.gflops / ceiling:.0f}% of that ceiling."]


def contention_notes(results, contention):
    """A line setting the thread rung's scaling over rung 5 beside the host's
    (:func:`~tilegemm.ladder.runner.measure_contention`), when both were measured."""
    single = {r.rung.number: r for r in results if r.threads == 1}
    threaded = [r for r in results if r.threads > 1]
    if contention is None or 5 not in single or not threaded:
        return []
    r = threaded[-1]
    return [f"rung {r.rung.number} ran {r.gflops / single[5].gflops:.2f}x rung 5 on {r.threads} "
            f"threads; {contention.threads} independent rung-5 products at once ran "
            f"{contention.scaling:.2f}x one alone (n = {contention.n}): what this host's cores "
            "lose running together (shared L3, memory, clock), not the threading's."]


def busy_machine_warning(results):
    """A warning when the figures show another program sharing the cores, else None."""
    # (An n-thread peak below n x the 1-thread peak is not a sign of this by itself:
    # cores may share an FMA unit or drop their clock when all of them run 512-bit code.)
    for r in results:
        if r.gflops > r.peak_gflops:
            return (f"warning: rung {r.rung.number} ran above the measured peak, so the peak "
                    "was measured while another program used the cores; rerun when it is quiet")
    for r in results:
        if r.spread > SPREAD_WARNING:
            return (f"warning: rung {r.rung.number}'s runs were {100 * r.spread:.0f}% apart: "
                    "another program is probably using the cores; rerun when it is quiet")
    single = {r.rung.number: r for r in results}
    for r in results:
        if r.threads > 1 and 5 in single:
            scaling = r.gflops / single[5].gflops
            if scaling < SCALING_WARNING * r.threads:
                return (f"warning: rung {r.rung.number} on {r.threads} threads ran only "
                        f"{scaling:.2f}x rung 5: another program is probably using a core; "
                        "rerun when it is quiet")
    return None


def plot(results, path, machine_label="", contention=None):
    """A bar chart of the ladder (log scale: the rungs span two orders of magnitude),
    with independent products at once over the thread rung when they were measured."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    x = np.arange(len(results))
    colors = ["tab:orange" if r.rung.parallel else "tab:blue" for r in results]
    bars = ax.bar(x, [r.gflops for r in results], color=colors, width=0.65)
    for bar, r in zip(bars, results):
        ax.annotate(f"{r.gflops:.1f}\nn={r.n}", (bar.get_x() + bar.get_width() / 2, r.gflops),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")
    ax.scatter(x, [r.numpy_gflops for r in results], marker="_", s=900, color="black",
               zorder=3, label="numpy, same n and threads")
    rung5 = next((r for r in results if r.rung.number == 5), None)
    if contention is not None and rung5 is not None and results[-1].rung.parallel:
        ax.scatter([x[-1]], [rung5.gflops * contention.scaling], marker="v", s=60,
                   color="tab:red", zorder=3,
                   label=f"{contention.threads} independent rung-5 products at once")
    for threads, style in ((1, "--"), (max(r.threads for r in results), ":")):
        peak = next((r.peak_gflops for r in results if r.threads == threads), None)
        if peak:
            ax.axhline(peak, color="gray", linestyle=style, linewidth=1,
                       label=f"measured FMA peak, {threads} thread{'s' if threads > 1 else ''}")
    ax.set_yscale("log")
    ax.set_ylim(top=max(r.peak_gflops for r in results) * 2.5)
    ax.set_xticks(x, [f"{r.rung.number}\n" + textwrap.fill(r.rung.title, 14) for r in results],
                  fontsize=8)
    ax.set_ylabel("GFLOPS (log scale)")
    ax.set_title(f"The cache-blocking ladder {machine_label}".strip(), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    """``tilegemm ladder``: measure the ladder, print the table, write the chart.

    Returns the process exit status.
    """
    parser = argparse.ArgumentParser(
        prog="tilegemm ladder",
        description="Measure seven GEMMs, from the naive loop to the library's threaded "
                    "engine, on this machine (float32, square n x n).")
    parser.add_argument("--n", type=int, default=1024,
                        help="matrix size (default 1024); a slow rung uses n halved until one "
                             f"call takes under {CALL_BUDGET} s")
    parser.add_argument("--out", default=".",
                        help="directory for ladder.png and ladder.md (default: current)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be positive")

    from tilegemm.tuning.machine import detect
    m = detect()
    blk = blocking(np.float32)
    print(f"{m.brand}: {m.isa}, L1d {m.l1d_bytes // 1024} KiB, L2 {m.l2_bytes // 1024} KiB "
          f"per core, {numba.get_num_threads()} threads")
    print(f"float32 blocking: MR={blk.mr} NR={blk.nr} KC={blk.kc} MC={blk.mc} NC={blk.nc}")
    print("measuring (compiles on first use) ...", flush=True)
    t0 = time.perf_counter()
    results = run_ladder(args.n, np.float32, log=lambda s: print(s, flush=True))
    contention = None
    if results[-1].threads > 1:
        contention = measure_contention(results[-1].n, results[-1].threads)
        print(f"  {contention.threads} rung-5 products at once: "
              f"{contention.together_gflops:.1f} GFLOPS, {contention.scaling:.2f}x one alone",
              flush=True)
    check_n = blocking_check_n(results, m.l3_bytes)
    check = measure_blocking_check(check_n) if check_n else None
    if check:
        print(f"  rungs 1 and 2 at n={check.n}: {check.loop_gflops:.1f} and "
              f"{check.blocked_gflops:.1f} GFLOPS", flush=True)
    table = format_table(results)
    print()
    print(table)
    notes = (slower_notes(results, m.l3_bytes, check) + smaller_n_notes(results, args.n)
             + width_notes(results) + contention_notes(results, contention))
    for note in notes:
        print(note)
    print(f"\nGFLOPS = 2n^3 / best time; % of peak against the measured FMA peak for the "
          f"thread count; ladder took {time.perf_counter() - t0:.0f} s.")
    if any(np.isnan(r.numpy_gflops) for r in results):
        print("numpy column empty: pip install threadpoolctl to limit numpy's threads",
              file=sys.stderr)
    warning = busy_machine_warning(results)
    if warning:
        print(warning, file=sys.stderr)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ladder.md"), "w") as f:
        f.write(table + "\n" + "".join(f"\n{note}\n" for note in notes))
    try:
        plot(results, os.path.join(args.out, "ladder.png"), f"({m.isa}, {m.brand})", contention)
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
    else:
        print(f"wrote {os.path.join(args.out, 'ladder.png')} and ladder.md")
    return 0
