"""Prepared-weight cache under pressure: calls with more plain weight arrays in rotation
than the cache keeps, against the same calls with one array (always a cache hit).

Usage::

    python bench/bench_rotating_weights.py [--arrays 64] [--repeat 5] [--limit 1.5]

Each rotating call misses the cache and prepares its weights again (packing,
Winograd's transform), so the ratio is what preparing costs against the layer.
Layers: a 64-channel 7x7 depthwise layer at 28x28 (whose packing once cost 50x the
layer) on each algorithm and layout that serves it, and ResNet-18 conv3_x at batch 1
(Winograd, im2col).  Exits 1 when a ratio exceeds ``--limit``.
"""
import argparse
import sys
import time

import numba
import numpy as np

import tilegemm
from tilegemm.tuning.machine import detect

LAYERS = {
    "depthwise 7x7 64ch @28": ((1, 64, 28, 28), (64, 1, 7, 7), dict(padding=3, groups=64)),
    "resnet18 conv3_x @28": ((1, 128, 28, 28), (128, 128, 3, 3), dict(padding=1)),
}


def best_per_call(fn, weights, repeat):
    """Best over ``repeat`` rounds of the mean time of one call per weight array."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrays", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--limit", type=float, default=1.5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    machine = detect()
    print(f"{machine.brand}, ISA {machine.isa}, {numba.get_num_threads()} thread(s), "
          f"{args.arrays} weight arrays in rotation")
    print(f"{'layer':26} {'algorithm':9} {'layout':6} {'cached ms':>10} {'rotating ms':>12} "
          f"{'ratio':>6}")
    worst = 0.0
    for name, (xs, ws, kw) in LAYERS.items():
        for layout in ("NCHW", "NHWC"):
            x = rng.standard_normal(xs if layout == "NCHW" else
                                    (xs[0], xs[2], xs[3], xs[1])).astype(np.float32)
            weights = [rng.standard_normal(ws).astype(np.float32) for _ in range(args.arrays)]
            for algorithm in ("auto", "im2col", "winograd", "direct"):
                try:
                    tilegemm.conv2d(x, weights[0], layout=layout, algorithm=algorithm, **kw)
                except ValueError:
                    continue                       # the algorithm does not apply
                if algorithm == "direct" and kw.get("groups", 1) == 1:
                    continue                       # minutes, and nothing is prepared

                def call(w):
                    tilegemm.conv2d(x, w, layout=layout, algorithm=algorithm, **kw)

                cached = best_per_call(call, [weights[0]] * args.arrays, args.repeat)
                rotating = best_per_call(call, weights, args.repeat)
                ratio = rotating / cached
                worst = max(worst, ratio)
                print(f"{name:26} {algorithm:9} {layout:6} {cached * 1e3:10.3f} "
                      f"{rotating * 1e3:12.3f} {ratio:6.2f}")
    print(f"largest ratio {worst:.2f} (limit {args.limit})")
    return 1 if worst > args.limit else 0


if __name__ == "__main__":
    sys.exit(main())
