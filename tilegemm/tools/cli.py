"""The ``tilegemm`` command line: ``info``, ``bench``, ``ladder``, ``run`` and ``dask``.

    python -m tilegemm info [--json]
    python -m tilegemm bench [--quick] [--op gemm|conv|int8|all] [--dtype ...] [--threads ...]
                             [--sizes ...] [--out DIR]
    python -m tilegemm bench --op conv [--layout NHWC] [--ms] [--scaling] [--memory]
    python -m tilegemm bench --compare A.json B.json
    python -m tilegemm ladder [...]          (options of tilegemm.ladder)
    python -m tilegemm run MODEL [...]       (options of tilegemm.tools.netrun)
    python -m tilegemm dask [...]            (options of tilegemm.tools.daskbench)

Exit status: 0 on success, 1 when a benchmarked result was wrong, 2 for bad
options or unreadable inputs, 130 when interrupted.
"""
import argparse
import json
import os
import shlex
import sys

from tilegemm.tools.options import UsageError

USAGE_ERROR = 2

#: ``bench`` options that only convolutions use: given without ``--op``, they mean ``--op conv``.
CONV_OPTIONS = ("layers", "batch", "layout", "ms", "scaling", "memory")


# --------------------------------------------------------------------------- parser

class _VersionAction(argparse.Action):
    """``--version``: asks git for the commit only when the flag is given."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from tilegemm.tools.provenance import version_text
        print(version_text())  # on stdout, as argparse's own "version" action does
        parser.exit(0)


def build_parser():
    """The argparse parser of the whole command line."""
    parser = argparse.ArgumentParser(
        prog="tilegemm",
        description="tilegemm: machine facts, GFLOPS reports, the cache-blocking ladder.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version and the git commit of the source, then exit")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench,ladder,run}")
    sub.required = True

    info = sub.add_parser("info", help="CPU, caches, ISA, block sizes and peak GFLOPS")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.add_argument("--no-peak", action="store_true",
                      help="leave the measured FMA peak out")
    info.add_argument("--remeasure", action="store_true",
                      help="measure the FMA peak again (about two seconds per dtype and thread "
                           "count) instead of reusing this machine's cached figures")

    b = sub.add_parser(
        "bench", help="GFLOPS report against peak, numpy and torch",
        description="Benchmark GEMM (and convolution) against the measured peak and numpy/torch; "
                    "writes report.md, report.json and PNG plots to --out.")
    b.add_argument("--op", choices=("gemm", "conv", "int8", "all"), default=None,
                   help="what to benchmark (default: all; gemm when only --sizes/--shapes are given, "
                        "conv when only convolution options are); int8: the exact int8 GEMM "
                        "and convolution against our float32 and onnxruntime")
    b.add_argument("--dtype", default="all",
                   help="float32, float64, a comma list, or all (default)")
    b.add_argument("--threads", default=None,
                   help="thread count(s), e.g. 1 or 1,2 (default: 1 and all)")
    b.add_argument("--sizes", default=None,
                   help="square sizes n, e.g. 64,128; with --sizes/--shapes only the "
                        "listed products run (no skinny shapes)")
    b.add_argument("--shapes", default=None, help="GEMM shapes MxNxK, e.g. 2048x64x2048,1x512x512")
    b.add_argument("--quick", action="store_true",
                   help="a subset of sizes, layers and repetitions (under 2 minutes)")
    b.add_argument("--reps", type=int, default=None,
                   help="repetitions, best kept (default 5, --quick 3)")
    b.add_argument("--min-time", type=float, default=None,
                   help="minimum seconds per timed sample (default 0.05, --quick 0.02)")
    b.add_argument("--layers", default=None, help="convolution layers (comma list of names)")
    b.add_argument("--batch", type=int, default=None, help="convolution batch (default 8, --quick 1)")
    b.add_argument("--layout", choices=("NCHW", "NHWC"), default=None,
                   help="convolution data layout (default NCHW); NHWC runs torch on "
                        "channels-last data")
    b.add_argument("--ms", action="store_true",
                   help="add torch's milliseconds per call to the convolution tables "
                        "(tilegemm's are always there)")
    b.add_argument("--scaling", action="store_true",
                   help="convolution: instead of the tables per thread count, time each "
                        "party at 1 thread and at the largest --threads in the same rounds")
    b.add_argument("--memory", action="store_true",
                   help="convolution: measure im2col's extra memory on vgg16_conv1_2")
    b.add_argument("--no-torch", action="store_true", help="do not time torch even if installed")
    b.add_argument("--no-first-call", action="store_true",
                   help="skip the fresh-process first-call measurement")
    b.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    b.add_argument("--out", default="tilegemm-report",
                   help="output directory (default: ./tilegemm-report)")
    b.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="compare two saved reports instead of benchmarking; exit status 1 "
                        "when a case got slower beyond --threshold and its noise")
    b.add_argument("--threshold", type=float, default=None, metavar="PCT",
                   help="with --compare: the slow-down in percent that counts as a "
                        "regression when the repeats' noise is smaller (default 10)")

    sub.add_parser("ladder", add_help=False,
                   help="the cache-blocking ladder, naive loop to micro-kernel "
                        "(options: tilegemm ladder --help)")
    sub.add_parser("dask", add_help=False,
                   help="tilegemm as dask's block kernel on a LocalCluster, against dask's "
                        "numpy blocks and one local call (options: tilegemm dask --help)")
    sub.add_parser("run", add_help=False,
                   help="run an ONNX model: latency, per-op profile, onnxruntime/torch "
                        "(options: tilegemm run --help)")
    return parser


# --------------------------------------------------------------------------- commands

def cmd_info(args):
    from tilegemm.tools.report import info_text, machine_info
    if args.no_peak and args.remeasure:
        raise UsageError("--remeasure and --no-peak contradict each other")
    info = machine_info(measure_peak=not args.no_peak, remeasure=args.remeasure)
    print(json.dumps(info, indent=1) if args.json else info_text(info))
    if args.json:
        for warning in info["warnings"]:
            print(warning, file=sys.stderr)
    return 0


def cmd_ladder(argv):
    """Forward to ``tilegemm.ladder.main`` (imported only when asked for)."""
    try:
        from tilegemm import ladder
    except ImportError as exc:
        if exc.name not in ("tilegemm.ladder", "tilegemm"):
            raise  # the module exists but something it needs is missing: show that
        print("tilegemm ladder: the cache-blocking ladder (tilegemm.ladder) is not available "
              "in this installation.", file=sys.stderr)
        return USAGE_ERROR
    status = ladder.main(list(argv))
    return 0 if status is None else int(status)


def cmd_compare(paths, threshold_pct):
    from tilegemm.tools.report import load_report
    from tilegemm.tools.compare import DEFAULT_THRESHOLD, compare_text, regressions
    threshold = DEFAULT_THRESHOLD if threshold_pct is None else threshold_pct / 100
    if not threshold >= 0:
        raise UsageError(f"--threshold must be a percentage >= 0, got {threshold_pct}")
    try:
        a, b = (load_report(p) for p in paths)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(compare_text(a, b, paths[0], paths[1], threshold))
    return 1 if regressions(a, b, threshold) else 0


def check_bench_options(args, defaults):
    """Reject ``bench`` options that would be silently ignored (:class:`UsageError`).

    ``defaults`` holds the value of every option when none is given.
    """
    given = [name for name, value in vars(args).items()
             if name in defaults and value != defaults[name]]
    flag = {name: "--" + name.replace("_", "-") for name in given}
    if args.compare:
        measuring = [flag[n] for n in given if n not in ("compare", "threshold")]
        if measuring:
            raise UsageError(f"--compare reads two saved reports and measures nothing: "
                             f"{', '.join(measuring)} cannot go with it")
        return
    if args.threshold is not None:
        raise UsageError("--threshold only applies to --compare")
    gemm_only = [flag[n] for n in given if n in ("sizes", "shapes")]
    conv_only = [flag[n] for n in given if n in CONV_OPTIONS]
    if args.op == "conv" and gemm_only:
        raise UsageError(f"{gemm_only[0]} names GEMM products and cannot go with --op conv")
    if args.op == "gemm" and conv_only:
        raise UsageError(f"{conv_only[0]} is a convolution option and cannot go with --op gemm")
    if args.op == "int8" and (gemm_only or conv_only):
        raise UsageError(f"{(gemm_only + conv_only)[0]} cannot go with --op int8 (square sizes "
                         "of its own, 256 to 2048)")


def cmd_bench(args, argv, defaults):
    check_bench_options(args, defaults)
    if args.compare:
        return cmd_compare(args.compare, args.threshold)
    from tilegemm.tools.runner import BenchPlan, run_plan
    plan = BenchPlan.from_args(args, command="python -m tilegemm " + shlex.join(argv))
    return run_plan(plan)


def main(argv=None):
    """Entry point of ``python -m tilegemm`` and the ``tilegemm`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ladder"]:
        return cmd_ladder(argv[1:])
    if argv[:1] == ["dask"]:
        from tilegemm.tools import daskbench
        return daskbench.main(argv[1:])
    if argv[:1] == ["run"]:
        from tilegemm.tools import netrun
        return netrun.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with status 2 and a message on bad options
    try:
        if args.command == "info":
            return cmd_info(args)
        return cmd_bench(args, argv, vars(parser.parse_args(["bench"])))
    except UsageError as exc:
        parser.exit(USAGE_ERROR, f"tilegemm {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours.
        sys.stdout = open(os.devnull, "w")
        return 0
