"""``python -m tilegemm bench``: turn options into a plan, run it, write the report.

The plan is a flat list of steps (measure the machine, each GEMM case, each
convolution case, the fresh-process first calls) so that the progress bar knows
its length before anything runs.
"""
import os
import sys
from dataclasses import dataclass, asdict

from tilegemm.tools import (conv_scaling, conv_suite, gemm_suite, int8_suite, qconv_suite, report,
                            timing)
from tilegemm.tools.options import (UsageError, check_out_dir, parse_dtypes, parse_shapes,
                                    parse_sizes, parse_threads)
from tilegemm.tools.progress import Progress


@dataclass
class BenchPlan:
    """What one ``bench`` run measures and where it writes."""

    ops: tuple = ("gemm", "conv", "int8")
    dtypes: tuple = ("float32", "float64")
    threads: tuple = (1,)
    sizes: tuple = gemm_suite.SQUARE_SIZES
    shapes: tuple = ()
    skinny: bool = True
    quick: bool = False
    reps: int = 5
    min_time: float = 0.05
    layers: tuple = None
    batch: int = None
    layout: str = "NCHW"
    ms: bool = False
    scaling: bool = False
    memory: bool = False
    peers: tuple = ("numpy", "torch")
    first_call: bool = True
    plots: bool = True
    out: str = "tilegemm-report"
    command: str = "python -m tilegemm bench"

    @classmethod
    def from_args(cls, args, command):
        """Validate the parsed ``bench`` options; raises :class:`UsageError` on bad input."""
        explicit = args.sizes is not None or args.shapes is not None
        sizes = parse_sizes(args.sizes) if args.sizes is not None else (
            () if explicit else
            gemm_suite.QUICK_SQUARE_SIZES if args.quick else gemm_suite.SQUARE_SIZES)
        reps = args.reps if args.reps is not None else (3 if args.quick else 5)
        min_time = args.min_time if args.min_time is not None else (0.02 if args.quick else 0.05)
        if reps < 1:
            raise UsageError(f"--reps must be at least 1, got {reps}")
        if not min_time > 0:
            raise UsageError(f"--min-time must be positive, got {min_time}")
        if args.batch is not None and args.batch < 1:
            raise UsageError(f"--batch must be at least 1, got {args.batch}")
        threads = parse_threads(args.threads) if args.threads else sorted({1, timing.max_threads()})
        layers = None
        if args.layers:
            layers = tuple(x.strip() for x in args.layers.split(","))
            known = {ly.name for ly in conv_suite.LAYERS}
            unknown = [x for x in layers if x not in known]
            if unknown:
                raise UsageError(f"--layers: unknown layer {unknown[0]!r}; known: "
                                 + ", ".join(sorted(known)))
        if args.scaling and max(threads) < 2:
            raise UsageError("--scaling compares 1 thread with more: give --threads 2 or more "
                             f"(at most {timing.max_threads()} here)")
        op = args.op or _implied_op(args)
        check_out_dir(args.out)
        return cls(
            ops=("gemm", "conv", "int8") if op == "all" else (op,),
            dtypes=tuple(parse_dtypes(args.dtype)), threads=tuple(threads),
            sizes=tuple(sizes), shapes=tuple(parse_shapes(args.shapes)) if args.shapes else (),
            skinny=not explicit, quick=args.quick, reps=reps, min_time=min_time,
            layers=layers, batch=args.batch, layout=args.layout or "NCHW", ms=args.ms,
            scaling=args.scaling, memory=args.memory,
            peers=("numpy",) if args.no_torch else ("numpy", "torch"),
            first_call=not args.no_first_call and not explicit, plots=not args.no_plots,
            out=args.out, command=command)

    def settings(self):
        return asdict(self)


def _implied_op(args):
    """The ``--op`` that the other options imply when it is not given.

    ``--sizes``/``--shapes`` name GEMM products and the convolution options
    (``--layers``, ``--batch``, ``--layout``, ``--ms``, ``--scaling``, ``--memory``)
    name convolutions: either kind alone means that op only; both or neither, all.
    """
    gemm = args.sizes is not None or args.shapes is not None
    conv = (args.layers is not None or args.batch is not None or args.layout is not None
            or args.ms or args.scaling or args.memory)
    if gemm == conv:
        return "all"
    return "gemm" if gemm else "conv"


@dataclass
class _Step:
    label: str           # shown by the progress bar
    measure: object      # callable() -> the step's record (a JSON-ready dict)
    keep: object         # callable(record) storing it in the report


def _plan_steps(plan, rep):
    """The measurement steps of ``plan``; each stores its record in ``rep``."""
    steps = []
    if "gemm" in plan.ops:
        for case in gemm_suite.gemm_cases(plan.dtypes, plan.threads, plan.sizes,
                                          plan.shapes, plan.skinny, plan.quick):
            steps.append(_Step(case.title(), lambda c=case: gemm_suite.run_gemm_case(
                c, plan.reps, plan.min_time, plan.peers), rep["gemm"].append))
    if "conv" in plan.ops:
        rep["conv"]["available"] = True
        steps += _conv_steps(plan, rep["conv"])
    if "int8" in plan.ops:
        for case in int8_suite.int8_cases(plan.threads, plan.quick):
            steps.append(_Step(case.title(), lambda c=case: int8_suite.run_int8_case(
                c, plan.reps, plan.min_time), rep["int8"].append))
        for case in qconv_suite.qconv_cases(plan.threads, plan.quick):
            steps.append(_Step(case.title(), lambda c=case: qconv_suite.run_qconv_case(
                c, plan.reps, plan.min_time), rep["qconv"].append))
    if "gemm" in plan.ops and plan.first_call:
        for dtype in plan.dtypes:
            steps.append(_Step(f"first call of matmul in a fresh process ({dtype}, empty "
                               "then warm cache)", lambda d=dtype: gemm_suite.first_call(d),
                               rep["first_call"].append))
    return steps


def _conv_steps(plan, conv):
    """The convolution steps: timings (or ``--scaling``), then ``--memory``."""
    steps = []
    peers = plan.peers
    budget = 2.0 if plan.quick else 10.0
    threads = (max(plan.threads),) if plan.scaling else plan.threads
    cases = conv_suite.conv_cases(plan.dtypes, threads, plan.quick, plan.layers, plan.batch,
                                  plan.layout)
    if plan.scaling:
        conv["scaling"] = []
        for case in cases:
            steps.append(_Step(f"{case.title()}: 1 thread against {case.threads}",
                               lambda c=case: conv_scaling.run_scaling_case(
                                   c, plan.reps, plan.min_time, peers, budget),
                               conv["scaling"].append))
    else:
        for case in cases:
            steps.append(_Step(case.title(), lambda c=case: conv_suite.run_conv_case(
                c, plan.reps, plan.min_time, peers=peers, budget=budget),
                conv["records"].append))
    if plan.memory:
        steps.append(_Step(f"im2col memory on {conv_suite.MEMORY_LAYER}",
                           lambda: conv_suite.im2col_memory(plan.dtypes[0], plan.layout),
                           lambda memory: conv.update(memory=memory)))
    return steps


def print_tables(rep, stream=sys.stdout):
    """The report's tables as plain text (what ``bench`` prints on stdout)."""
    has_torch = report.has_torch_results(rep)
    tables = report.gemm_tables(rep["gemm"], has_torch)
    tables += report.all_conv_tables(rep)
    if rep.get("int8"):
        tables.append(int8_suite.int8_table(rep["int8"]))
    if rep.get("qconv"):
        tables.append(qconv_suite.qconv_table(rep["qconv"]))
    for title, headers, rows in tables:
        print(f"\n{title}\n" + report.format_table(headers, rows), file=stream)
    notes = report.conv_notes(rep["conv"]["records"])
    if notes:
        print("\nNot timed, as too slow for the layer:\n" + "\n".join(notes), file=stream)
    summary = report.auto_summary(rep["conv"]["records"])
    if summary:
        print("\n" + "\n".join(summary), file=stream)
    if rep["first_call"]:
        headers, rows = report.first_call_table(rep["first_call"])
        print("\nFirst call of tilegemm.matmul in a fresh process\n"
              + report.format_table(headers, rows), file=stream)
    if rep["conv"].get("memory"):
        print("\n" + report.memory_text(rep["conv"]["memory"]), file=stream)


def _write_plots(rep, out_dir):
    from tilegemm.tools import plots  # imports matplotlib: only when drawing
    os.makedirs(out_dir, exist_ok=True)
    if not plots.matplotlib_available():
        rep["plots_skipped"] = plots.PLOTS_SKIPPED
        return
    try:
        rep["plots"] = plots.write_plots(rep, out_dir)
    except Exception as exc:  # a plotting problem must not cost the measurements
        rep["plots_skipped"] = f"Plots failed ({type(exc).__name__}: {exc}); the tables are complete."


def _failed_checks(rep):
    bad = [f"gemm {r['dtype']} {r['shape']} {r['threads']}t"
           for r in rep["gemm"] if not r["check"]["ok"]]
    for r in rep["conv"]["records"]:
        bad += [f"conv {r['layer']} {name} {r['dtype']} {r['threads']}t"
                for name, c in r["check"].items() if not c["ok"]]
    bad += [f"int8 gemm n={r['n']} {r['threads']}t" for r in rep.get("int8", [])
            if not r["check"]["ok"]]
    bad += [f"int8 conv {r['layer']} {r['layout']} {r['threads']}t"
            for r in rep.get("qconv", []) if not r["check"]["ok"]]
    return bad


def _measure(steps, rep, progress):
    """Run ``steps`` in order, printing each record as it finishes.

    On Ctrl-C, marks ``rep`` partial (what was measured is kept) and returns False.
    """
    done = 0
    try:
        for step in steps:
            progress.step(step.label)
            record = step.measure()
            step.keep(record)
            done += 1
            progress.write(report.row_text(record))
    except KeyboardInterrupt:
        progress.close(interrupted=True)
        rep["partial"] = {"steps_done": done, "steps_total": len(steps),
                          "reason": "interrupted (Ctrl-C)"}
        return False
    progress.close()
    return True


def run_plan(plan, stdout=None, stderr=None):
    """Run a :class:`BenchPlan`: measure, print the tables, write the report.

    Each record is printed on ``stdout`` as soon as it is measured, the full
    tables at the end.  On Ctrl-C the records measured so far are written as a
    partial report (no plots).

    Returns
    -------
    int
        Exit status: 0; 1 when a benchmarked result was wrong; 130 when interrupted.
    """
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    machine = {}
    steps = [_Step("machine: detect, measure the FMA peak",
                   lambda: report.machine_info(measure_peak=True, remeasure=True),
                   machine.update)]
    rep = report.new_report(plan.settings(), machine)
    # The roofline's sloped roof: streams through a buffer of 4x the last-level cache.
    steps.append(_Step("memory bandwidth: numpy copy of 4x the last-level cache",
                       lambda: timing.memory_bandwidth(machine.get("l3_bytes")
                                                       or machine.get("l2_bytes", 0)),
                       lambda bw: rep.update(memory_bandwidth=bw)))
    steps += _plan_steps(plan, rep)
    progress = Progress(len(steps), stderr, out=stdout)
    rep["load_average"] = {"start": timing.load_average()}
    complete = _measure(steps, rep, progress)
    rep["load_average"]["end"] = timing.load_average()
    if not complete:
        rep["plots_skipped"] = "Plots not drawn: the run was interrupted."
        json_path, md_path = report.write_report(rep, plan.out)
        print(f"interrupted: wrote the {rep['partial']['steps_done']} step(s) measured so far "
              f"to {md_path}, {json_path} (marked partial)", file=stderr)
        return 130
    note = report.busy_note(rep["load_average"], rep["machine"].get("cores", 1))
    if note:
        print(note, file=stderr)

    print_tables(rep, stdout)
    if plan.plots:
        _write_plots(rep, plan.out)
    else:
        rep["plots_skipped"] = "Plots not drawn (--no-plots)."
    json_path, md_path = report.write_report(rep, plan.out)
    print(f"\nwrote {md_path}, {json_path}" +
          "".join(f", {plan.out}/{p}" for p in rep["plots"]), file=stdout)
    if rep["plots_skipped"]:
        print(rep["plots_skipped"], file=stdout)
    bad = _failed_checks(rep)
    if bad:
        print("WRONG RESULTS (timings of these are meaningless): " + "; ".join(bad), file=stderr)
        return 1
    return 0
