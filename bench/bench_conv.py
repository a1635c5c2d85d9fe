"""Convolution benchmark: each algorithm and auto against torch, interleaved in one run.

Usage (hold the machine's bench lock)::

    flock /tmp/tilegemm-bench.lock python bench/bench_conv.py [--threads 1] [--batch 8]
        [--layers resnet18_conv2_x,...] [--repeat 5] [--no-memory] [--scaling]
        [--layout NHWC]

For every layer it prints effective GFLOPS (direct-convolution flops / time) of
``torch.nn.functional.conv2d`` and of each tilegemm algorithm, our speed as a
ratio of torch's, and % of the measured peak on the algorithm's *own* flop count
(Winograd F(2x2,3x3) multiplies 2.25x less).  Calls are interleaved round by
round (torch, im2col, winograd, ...) and the best round is kept, so the ratios
survive a noisy machine.  ``--memory`` (default on) compares the peak extra
memory of implicit im2col with the explicit patch matrix on VGG conv1_2.
``--layout NHWC`` runs every party on channels-last data: ours with
``layout="NHWC"``, torch on a channels-last input and weight (its own NHWC kernels).

``--scaling`` instead times every party at 1 thread and at ``--threads`` threads
in the same rounds (1 thread, then N, per party, best of ``--repeat``) and prints
the speed-up: on a shared machine, figures from separate runs drift more than
the speed-up being measured.  Each layer's ``apart`` row runs ``--threads``
independent 1-thread calls at once against one alone: the speed-up the machine
gives work that shares nothing but the hardware (see :func:`bench_apart`).

:func:`conv_layers` returns the layer list for other tools to reuse.
"""
import argparse
import threading
import time
import tracemalloc

import numba
import numpy as np

import tilegemm
import tilegemm.conv.plan
from tilegemm import bench, bench_conv
from tilegemm.conv import engine
from tilegemm.conv.params import conv_params

ALGORITHMS = ("im2col", "winograd", "direct", "auto")


def conv_layers():
    """The benchmark layers (``tilegemm.bench_conv.LAYERS``, shared with the report) as dicts.

    Keys: name, C, H, W, K, kh, kw, stride, padding, groups; the batch is the caller's.
    """
    return [dict(name=ly.name, C=ly.c, H=ly.h, W=ly.w, K=ly.k, kh=ly.kh, kw=ly.kw,
                 stride=ly.stride, padding=ly.padding, groups=ly.groups)
            for ly in bench_conv.LAYERS]


def operands(ly, batch, dtype=np.float32, seed=0, layout="NCHW"):
    """Random (x, w, b) for a layer, x in ``layout`` (C-contiguous)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, ly["C"], ly["H"], ly["W"])).astype(dtype)
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w = rng.standard_normal((ly["K"], ly["C"] // ly["groups"], ly["kh"], ly["kw"])).astype(dtype)
    b = rng.standard_normal(ly["K"]).astype(dtype)
    return x, w, b


def parties(ly, x, w, b, layout="NCHW"):
    """{name: zero-argument callable} for torch (if installed) and every applicable algorithm."""
    args = dict(stride=ly["stride"], padding=ly["padding"], groups=ly["groups"])
    out = {}
    try:
        import torch
        import torch.nn.functional as F
        xt, wt, bt = (torch.from_numpy(a) for a in (x, w, b))
        if layout == "NHWC":
            # The same memory seen as NCHW with channels-last strides; torch then
            # runs its channels-last kernels and returns channels-last.
            xt = xt.permute(0, 3, 1, 2)
            wt = wt.contiguous(memory_format=torch.channels_last)
        out["torch"] = lambda: F.conv2d(xt, wt, bt, **args)
    except ImportError:
        pass
    p = conv_params(x.shape, w.shape, ly["stride"], ly["padding"], 1, ly["groups"], layout)
    estimates = tilegemm.conv.plan.estimates(p, x.dtype)
    for alg in ALGORITHMS:
        if alg == "winograd" and not p.winograd_ok:
            continue
        if alg == "direct" and estimates["direct"] > 10 * min(estimates.values()):
            continue  # dense layers: direct would take minutes and is never chosen
        out[alg] = (lambda a: lambda: tilegemm.conv2d(x, w, b, algorithm=a, layout=layout,
                                                      **args))(alg)
    return out, p


def interleaved_best(fns, repeat, min_time=0.05, settle=0.0, ramp=0.0):
    """Best seconds per callable, calling each once per round (after one warm-up call).

    ``settle``: seconds to sleep before each sample, so that a peer's spinning worker
    threads (OpenMP, OpenBLAS) have gone idle (see ``tilegemm.bench.settle_time``);
    ``ramp``: seconds of untimed calls after it (``tilegemm.bench.ramp_time``).
    """
    for f in fns.values():
        f()
    calls = {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        f()
        calls[name] = max(1, int(min_time / max(time.perf_counter() - t0, 1e-9)))
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, f in fns.items():
            bench.before_sample(f, settle, ramp)
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                f()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls[name])
    return best


def own_flops(p, algorithm):
    """The flops an algorithm actually performs in its multiplies (for % of peak)."""
    if algorithm == "winograd":
        return p.winograd_flops
    return p.flops


def bench_layer(ly, batch, threads, repeat, peak, layout="NCHW"):
    x, w, b = operands(ly, batch, layout=layout)
    fns, p = parties(ly, x, w, b, layout)
    best = interleaved_best(fns, repeat, settle=bench.settle_time(threads),
                            ramp=bench.ramp_time(threads))
    plan = tilegemm.conv_plan(x.shape, w.shape, ly["stride"], ly["padding"], 1, ly["groups"],
                              layout=layout, threads=threads)
    rows = []
    torch_t = best.get("torch")
    for name, t in best.items():
        alg = plan.algorithm if name == "auto" else name
        rows.append(dict(layer=ly["name"], party=name, seconds=t, gflops=p.flops / t / 1e9,
                         vs_torch=(torch_t / t) if torch_t else None,
                         pct_peak=(100 * own_flops(p, alg) / t / 1e9 / peak
                                   if name != "torch" else 100 * p.flops / t / 1e9 / peak),
                         algorithm=alg))
    return rows


def bench_scaling(ly, batch, threads, repeat, layout="NCHW"):
    """Rows of (party, seconds at 1 thread, seconds at ``threads``), timed in the same rounds."""
    x, w, b = operands(ly, batch, layout=layout)
    fns, _ = parties(ly, x, w, b, layout)

    torch = bench.torch_module()

    def at(n, f):
        def call():
            # Set directly: threadpoolctl's limits (bench.pinned_threads) cost
            # milliseconds per entry, inside the timed loop.
            numba.set_num_threads(n)
            if torch is not None:
                torch.set_num_threads(n)
            return f()
        return call

    timed = {}
    for name, f in fns.items():
        timed[(name, 1)] = at(1, f)
        timed[(name, threads)] = at(threads, f)
    best = interleaved_best(timed, repeat, settle=bench.settle_time(threads),
                            ramp=bench.ramp_time(threads))
    return [dict(layer=ly["name"], party=name, one=best[(name, 1)], many=best[(name, threads)])
            for name in fns]


def bench_apart(ly, batch, threads, repeat, min_time=0.05, layout="NCHW"):
    """Seconds per call of auto on 1 thread alone, and with ``threads`` such calls at once.

    Each of ``threads`` Python threads runs its own 1-thread calls on its own
    operands, started together; the slowest one's time per call is the "together"
    figure.  ``threads * alone / together`` is then the speed-up the machine gives
    independent work on this layer (sharing caches, memory and the host's cores):
    the yardstick for the speed-up of one call split between threads, which can
    beat it where its threads share reads (the weights).  Alone and together are
    alternated round by round, best of ``repeat``.
    """
    args = dict(stride=ly["stride"], padding=ly["padding"], groups=ly["groups"], layout=layout)
    ops = [operands(ly, batch, seed=i, layout=layout) for i in range(threads)]

    def calls(i, n):
        numba.set_num_threads(1)
        x, w, b = ops[i]
        t0 = time.perf_counter()
        for _ in range(n):
            tilegemm.conv2d(x, w, b, **args)
        return (time.perf_counter() - t0) / n

    calls(0, 1)                        # compiles, packs the weights
    n = max(1, int(min_time / max(calls(0, 1), 1e-9)))
    for i in range(1, threads):
        calls(i, 1)
    best_alone = best_together = float("inf")
    for _ in range(repeat):
        best_alone = min(best_alone, calls(0, n))
        start = threading.Barrier(threads)
        times = [0.0] * threads

        def worker(i):
            start.wait()
            times[i] = calls(i, n)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        best_together = min(best_together, max(times))
    return best_alone, best_together


def im2col_memory(ly, batch=1, layout="NCHW"):
    """Peak bytes allocated during implicit im2col (output excluded) and the explicit matrix."""
    x, w, b = operands(ly, batch, layout=layout)
    p = conv_params(x.shape, w.shape, ly["stride"], ly["padding"], 1, ly["groups"], layout)
    engine.clear_prepared()
    engine._workspace.__dict__.clear()  # fresh pack buffers, so they are counted
    out_bytes = np.prod(p.output_shape()) * x.itemsize
    tracemalloc.start()
    tilegemm.conv2d(x, w, b, stride=ly["stride"], padding=ly["padding"], algorithm="im2col",
                    layout=layout)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    explicit = p.Cg * p.kh * p.kw * p.Ho * p.Wo * x.itemsize
    return peak - out_bytes, explicit


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", default=None, help="comma-separated layer names")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--scaling", action="store_true",
                    help="speed-up of --threads threads over 1, timed in the same rounds")
    ap.add_argument("--layout", choices=("NCHW", "NHWC"), default="NCHW")
    args = ap.parse_args(argv)
    wanted = set(args.layers.split(",")) if args.layers else None
    layers = [ly for ly in conv_layers() if not wanted or ly["name"] in wanted]
    if args.scaling:
        print(f"float32, batch {args.batch}, {args.layout}: 1 thread against {args.threads}, "
              f"same rounds")
        print(f"{'layer':18s} {'party':9s} {'1 thread ms':>11s} {f'{args.threads} threads ms':>13s} "
              f"{'speed-up':>8s}")
        for ly in layers:
            for r in bench_scaling(ly, args.batch, args.threads, args.repeat, args.layout):
                print(f"{r['layer']:18s} {r['party']:9s} {r['one'] * 1e3:11.2f} "
                      f"{r['many'] * 1e3:13.2f} {r['one'] / r['many']:7.2f}x", flush=True)
            alone, together = bench_apart(ly, args.batch, args.threads, args.repeat,
                                          layout=args.layout)
            print(f"{ly['name']:18s} {'apart':9s} {alone * 1e3:11.2f} {together * 1e3:13.2f} "
                  f"{args.threads * alone / together:7.2f}x  ({args.threads} independent "
                  f"1-thread auto calls at once)", flush=True)
        return
    numba.set_num_threads(args.threads)
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    from tilegemm.tuning.peak import measured_peak_gflops
    peak = measured_peak_gflops(np.float32, args.threads)
    print(f"float32, batch {args.batch}, {args.layout}, {args.threads} thread(s), "
          f"measured peak {peak:.0f} GFLOPS")
    print(f"{'layer':18s} {'party':9s} {'algorithm':9s} {'ms':>9s} {'eff GF':>8s} "
          f"{'vs torch':>8s} {'% peak':>7s}")
    for ly in layers:
        for r in bench_layer(ly, args.batch, args.threads, args.repeat, peak, args.layout):
            vs = f"{r['vs_torch']:.2f}x" if r["vs_torch"] else "-"
            print(f"{r['layer']:18s} {r['party']:9s} {r['algorithm']:9s} {r['seconds'] * 1e3:9.2f} "
                  f"{r['gflops']:8.1f} {vs:>8s} {r['pct_peak']:6.1f}%", flush=True)
    if not args.no_memory:
        vgg = next(ly for ly in conv_layers() if ly["name"] == "vgg16_conv1_2")
        extra, explicit = im2col_memory(vgg, layout=args.layout)
        print(f"im2col extra memory on vgg16_conv1_2 (batch 1, {args.layout}): "
              f"{extra / 2**20:.1f} MiB implicit "
              f"vs {explicit / 2**20:.1f} MiB explicit patch matrix ({100 * extra / explicit:.1f}%)")


if __name__ == "__main__":
    main()
