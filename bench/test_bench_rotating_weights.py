"""Prepared-weight cache under pressure: a speed target, measured as a ratio in one run.

Calls whose plain weight arrays rotate through more arrays than the prepared-weight
cache keeps (every call prepares its weights again: packing, Winograd's transform)
against the same calls with one array (always a cache hit).  The ratio is what
preparing costs against the layer; the target is at most ``LIMIT``.  Layers: a
64-channel 7x7 depthwise layer at 28x28 on each algorithm and layout that serves it,
and ResNet-18 conv3_x at batch 1.  Run with ``pytest bench/test_bench_rotating_weights.py``
(``-s`` prints the table).
"""
import time

import numpy as np
import pytest

import tilegemm

#: Largest rotating/cached time per call accepted.
LIMIT = 1.5
#: Weight arrays in rotation (the cache keeps 32).
ARRAYS = 64
REPEAT = 5

LAYERS = {
    "depthwise 7x7 64ch @28": ((1, 64, 28, 28), (64, 1, 7, 7), dict(padding=3, groups=64)),
    "resnet18 conv3_x @28": ((1, 128, 28, 28), (128, 128, 3, 3), dict(padding=1)),
}
CASES = [(name, layout, algorithm) for name in LAYERS for layout in ("NCHW", "NHWC")
         for algorithm in ("auto", "im2col", "winograd", "direct")]


def best_per_call(fn, weights, repeat=REPEAT):
    """Best over ``repeat`` rounds of the mean time of one call per weight array."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


@pytest.mark.parametrize("name, layout, algorithm", CASES,
                         ids=[f"{n.split()[0]}-{l}-{a}" for n, l, a in CASES])
def test_preparing_weights_costs_at_most_half_a_layer(name, layout, algorithm):
    xs, ws, kw = LAYERS[name]
    if algorithm == "direct" and kw.get("groups", 1) == 1:
        pytest.skip("dense direct convolution prepares nothing (and takes minutes)")
    rng = np.random.default_rng(0)
    shape = xs if layout == "NCHW" else (xs[0], xs[2], xs[3], xs[1])
    x = rng.standard_normal(shape).astype(np.float32)
    weights = [rng.standard_normal(ws).astype(np.float32) for _ in range(ARRAYS)]
    try:
        tilegemm.conv2d(x, weights[0], layout=layout, algorithm=algorithm, **kw)
    except ValueError as e:
        pytest.skip(f"{algorithm} does not apply: {e}")

    def call(w):
        tilegemm.conv2d(x, w, layout=layout, algorithm=algorithm, **kw)

    cached = best_per_call(call, [weights[0]] * ARRAYS)
    rotating = best_per_call(call, weights)
    ratio = rotating / cached
    print(f"{name:26} {algorithm:9} {layout:6} cached {cached * 1e3:.3f} ms "
          f"rotating {rotating * 1e3:.3f} ms ratio {ratio:.2f}")
    assert ratio <= LIMIT, f"preparing weights costs {ratio:.2f}x the cached call"
