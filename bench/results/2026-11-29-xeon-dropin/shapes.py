"""Square and deep products, tilegemm against numpy in the same process, timed by
tilegemm's own rules (``tilegemm.tools.timing``: both parties pinned to the same
thread count, numpy's BLAS through threadpoolctl; best of 7 interleaved samples of
at least 50 ms each, on two threads each after a pause and a ramp of untimed calls,
as ``python -m tilegemm bench`` times them).

Usage: python shapes.py square THREADS DTYPE N...   (n x n x n products)
       python shapes.py deep THREADS                (small m and n, long k: DEEP)
"""
import sys

import numpy as np

import tilegemm
from tilegemm.tools.timing import interleaved, pinned_threads, ramp_time, settle_time

DEEP = ((32, 32, 32768), (64, 64, 32768), (16, 16, 65536), (48, 48, 20000),
        (32, 64, 30000), (64, 64, 4096), (20, 50, 40000), (64, 64, 1024))


def compare(threads, dtype, m, n, k, rng):
    """One line: tilegemm's and numpy's best time for an m x n x k product."""
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    c = np.empty((m, n), dtype)
    with pinned_threads(threads):
        t = interleaved({"tilegemm": lambda: tilegemm.matmul(a, b, out=c),
                         "numpy": lambda: np.matmul(a, b, out=c)}, reps=7,
                        settle=settle_time(threads), ramp=ramp_time(threads))
    ours, theirs = t["tilegemm"].best_s, t["numpy"].best_s
    flops = 2 * m * n * k
    return (f"{threads}T {np.dtype(dtype).name:8s} {m}x{n}x{k:<6d} tilegemm {ours * 1e6:9.1f} us"
            f" ({flops / ours / 1e9:6.1f} GF)  numpy {theirs * 1e6:9.1f} us"
            f" ({flops / theirs / 1e9:6.1f} GF)  ratio {theirs / ours:.2f}")


def main(argv):
    rng = np.random.default_rng(0)
    mode, threads = argv[0], int(argv[1])
    if mode == "square":
        cases = [(np.dtype(argv[2]), n, n, n) for n in map(int, argv[3:])]
    else:
        cases = [(np.dtype(d), *shape) for d in ("float32", "float64") for shape in DEEP]
    for dtype, m, n, k in cases:
        print(compare(threads, dtype, m, n, k, rng), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
