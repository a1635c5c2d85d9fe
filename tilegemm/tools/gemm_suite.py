"""The GEMM benchmark suite: which shapes, which parties, one report row per case.

Cases are square products (n = 64 ... 4096), skinny ones (a row vector, a
column vector, a long inner dimension, a tall-thin product), batches of small
products and single small products (where the call's own cost is most of the
time), for each dtype and thread count.  Every case times tilegemm, numpy and (when installed) torch with
the rules of :mod:`tilegemm.tools.timing`.  Separately, :func:`first_call` measures the
first call in a fresh Python process, with an empty and with a warm Numba cache.
"""
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from tilegemm.tools import timing

#: Square sizes of the full suite and of ``--quick``.
SQUARE_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_SQUARE_SIZES = (64, 256, 1024)

#: Skinny shapes (label -> (m, n, k)): GEMV-shaped products and a tall-thin one.
SKINNY_SHAPES = {
    "m=1": (1, 4096, 4096),
    "n=1": (4096, 1, 4096),
    "k>>m*n": (32, 32, 32768),
    "tall-thin": (2048, 64, 2048),
}

#: Batches of small products (label -> (batch, m, n, k)): ``matmul`` on 3-D operands.
BATCHED_SHAPES = {
    "batch 10000x8": (10000, 8, 8, 8),
    "batch 4000x16": (4000, 16, 16, 16),
    "batch 1000x32": (1000, 32, 32, 32),
    "batch 256x64": (256, 64, 64, 64),
    "batch 64x128": (64, 128, 128, 128),
}
#: Single small products (label -> (m, n, k)): mostly the cost of a call.
SMALL_SHAPES = {"n=4": (4, 4, 4), "n=16": (16, 16, 16), "n=32": (32, 32, 32)}
#: The ones ``--quick`` keeps.
QUICK_OTHER = ("batch 4000x16", "n=16")


@dataclass(frozen=True)
class GemmCase:
    """One benchmark case: C (m x n) = A (m x k) @ B (k x n)."""

    m: int
    n: int
    k: int
    dtype: str
    threads: int
    kind: str = "square"
    batch: int = 1

    @property
    def flops(self):
        return 2.0 * self.m * self.n * self.k * self.batch

    @property
    def shape(self):
        return (f"{self.batch}x" if self.batch > 1 else "") + f"{self.m}x{self.n}x{self.k}"

    def title(self):
        """Short description for progress lines."""
        return f"gemm {self.dtype} {self.shape} ({self.kind}) {timing.threads_text(self.threads)}"


def gemm_cases(dtypes, threads, sizes=SQUARE_SIZES, shapes=None, skinny=True, quick=False):
    """The list of cases to run, grouped by dtype then thread count.

    Parameters
    ----------
    dtypes : sequence of str
        ``"float32"`` / ``"float64"``.
    threads : sequence of int
    sizes : sequence of int
        Square sizes n (m = n = k = n).
    shapes : sequence of (m, n, k), optional
        Extra explicit shapes (kind ``"custom"``).
    skinny : bool
        Add :data:`SKINNY_SHAPES`, :data:`BATCHED_SHAPES` and :data:`SMALL_SHAPES`.
    quick : bool
        Of the batched and small shapes, only :data:`QUICK_OTHER`.

    Returns
    -------
    list of GemmCase
    """
    cases = []
    for dtype in dtypes:
        for t in threads:
            cases += [GemmCase(n, n, n, dtype, t) for n in sizes]
            cases += [GemmCase(m, n, k, dtype, t, "custom") for m, n, k in (shapes or ())]
            if skinny:
                cases += [GemmCase(m, n, k, dtype, t, label)
                          for label, (m, n, k) in SKINNY_SHAPES.items()]
                other = [(label, shape) for label, shape in
                         list(BATCHED_SHAPES.items()) + list(SMALL_SHAPES.items())
                         if not quick or label in QUICK_OTHER]
                cases += [GemmCase(*shape[-3:], dtype, t, label, *shape[:-3])
                          for label, shape in other]
    return cases


def operands(case, seed=0):
    rng = np.random.default_rng(seed)
    batch = (case.batch,) if case.batch > 1 else ()
    a = rng.standard_normal(batch + (case.m, case.k)).astype(case.dtype)
    b = rng.standard_normal(batch + (case.k, case.n)).astype(case.dtype)
    return a, b


def gemm_parties(case, a, b, peers=("numpy", "torch")):
    """Zero-argument callables computing ``a @ b`` into preallocated outputs.

    Returns
    -------
    parties : dict of str -> callable
        ``"tilegemm"`` first, then the requested peers that are installed.
    outputs : dict of str -> ndarray
        Where each party writes (for the correctness check).
    """
    import tilegemm

    batch = (case.batch,) if case.batch > 1 else ()
    outputs = {"tilegemm": np.empty(batch + (case.m, case.n), case.dtype)}
    parties = {"tilegemm": lambda: tilegemm.matmul(a, b, out=outputs["tilegemm"])}
    if "numpy" in peers:
        outputs["numpy"] = np.empty_like(outputs["tilegemm"])
        parties["numpy"] = lambda: np.matmul(a, b, out=outputs["numpy"])
    torch = timing.torch_module() if "torch" in peers else None
    if torch is not None:
        outputs["torch"] = np.empty_like(outputs["tilegemm"])
        # from_numpy shares memory: torch writes straight into outputs["torch"].
        ta, tb, tc = (torch.from_numpy(x) for x in (a, b, outputs["torch"]))
        parties["torch"] = lambda: torch.matmul(ta, tb, out=tc)
    return parties, outputs


def max_rel_error(got, expected):
    """max |got - expected| / max |expected| (0 for an all-zero expectation)."""
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    diff = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
    return diff / scale if scale else diff


def check_tolerance(dtype, k):
    """Relative error accepted for a product with inner dimension ``k``."""
    eps = np.finfo(dtype).eps
    return float(16 * eps * np.sqrt(max(k, 1)))


def run_gemm_case(case, reps=5, min_time=0.05, peers=("numpy", "torch")):
    """Time one case and return its report row (a JSON-ready dict).

    The row holds the case, every party's timings and GFLOPS, % of the measured
    peak for the case's thread count, ``ratio`` of each peer (tilegemm GFLOPS /
    peer GFLOPS: above 1 means tilegemm is faster) and a correctness check of
    tilegemm's result against numpy's.
    """
    a, b = operands(case)
    with timing.pinned_threads(case.threads):
        parties, outputs = gemm_parties(case, a, b, peers)
        timings = timing.interleaved(parties, reps=reps, min_time=min_time,
                                    settle=timing.settle_time(case.threads),
                                    ramp=timing.ramp_time(case.threads))
        peak = timing.peak_gflops(case.dtype, case.threads)
    results = timing.summarise(timings, case.flops, peak)
    ours = results["tilegemm"]["gflops"]
    for name, row in results.items():
        if name != "tilegemm":
            row["ratio"] = ours / row["gflops"]
    reference = np.matmul(a.astype(np.float64), b.astype(np.float64))
    err = max_rel_error(outputs["tilegemm"], reference)
    tol = check_tolerance(case.dtype, case.k)
    return {
        "op": "gemm", "kind": case.kind, "shape": case.shape,
        "m": case.m, "n": case.n, "k": case.k, "batch": case.batch,
        "dtype": case.dtype, "threads": case.threads, "flops": case.flops,
        "peak_gflops": peak, "reps": reps, "results": results,
        # NaN compares False: a result with NaN is reported wrong, stored as null.
        "check": {"max_rel_error": err if np.isfinite(err) else None, "tolerance": tol,
                  "ok": bool(err <= tol)},
    }


# --------------------------------------------------------------------------- first call

_FIRST_CALL_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import tilegemm
t1 = time.perf_counter()
n, dtype = int(sys.argv[1]), sys.argv[2]
a = np.ones((n, n), dtype)
t2 = time.perf_counter()
tilegemm.matmul(a, a)
t3 = time.perf_counter()
tilegemm.matmul(a, a)
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t3 - t2, "second_call_s": t4 - t3}))
"""


def _fresh_process_call(n, dtype, cache_dir, threads):
    env = dict(os.environ, TILEGEMM_CACHE_DIR=cache_dir, NUMBA_CACHE_DIR=cache_dir,
               NUMBA_NUM_THREADS=str(threads))
    env.pop("TILEGEMM_NO_CACHE", None)  # the warm run must be allowed to use the cache
    proc = subprocess.run([sys.executable, "-c", _FIRST_CALL_SCRIPT, str(n), dtype],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"first-call subprocess failed:\n{proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_call(dtype="float32", n=256, threads=None):
    """First ``tilegemm.matmul`` in a fresh process, with an empty then a warm cache.

    Both runs use a private temporary directory as ``TILEGEMM_CACHE_DIR`` and
    ``NUMBA_CACHE_DIR``: the first finds it empty (everything is compiled), the
    second finds what the first stored.

    Parameters
    ----------
    dtype : str
    n : int
        Size of the square product.
    threads : int, optional
        ``NUMBA_NUM_THREADS`` of the subprocess (default: all).

    Returns
    -------
    dict
        ``{"dtype", "n", "threads", "cold": {...}, "warm": {...}}`` where each run
        has ``import_s``, ``first_call_s`` and ``second_call_s``.
    """
    threads = threads or timing.max_threads()
    with tempfile.TemporaryDirectory(prefix="tilegemm-first-call-") as cache_dir:
        cold = _fresh_process_call(n, dtype, cache_dir, threads)
        warm = _fresh_process_call(n, dtype, cache_dir, threads)
    return {"dtype": dtype, "n": n, "threads": threads, "cold": cold, "warm": warm}
