"""The convolution benchmark suite: real network layers, each algorithm, torch beside.

Figures are *effective* GFLOPS: the direct convolution's flop count
(2·N·K·Ho·Wo·(C/groups)·kh·kw) over the time, whatever the algorithm, so the
columns compare speed.  % of peak uses the algorithm's own flop count (Winograd
F(2×2,3×3) multiplies 2.25× less), so it says how well the hardware is used.

When ``tilegemm.conv2d`` does not exist yet, :func:`conv_available` says so and
the CLI reports convolution as not available instead of failing.
"""
import math
import time
from dataclasses import dataclass

import numpy as np

from tilegemm import bench

#: Algorithms benchmarked, in table order.  "auto" is tilegemm's own choice.
ALGORITHMS = ("im2col", "winograd", "direct", "auto")


@dataclass(frozen=True)
class ConvLayer:
    """A convolution layer: C input channels at H x W, K filters of kh x kw."""

    name: str
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    stride: int = 1
    padding: int = 0
    groups: int = 1

    @property
    def out_hw(self):
        ho = (self.h + 2 * self.padding - self.kh) // self.stride + 1
        wo = (self.w + 2 * self.padding - self.kw) // self.stride + 1
        return ho, wo

    def describe(self):
        g = f" g{self.groups}" if self.groups > 1 else ""
        return (f"{self.c}->{self.k} {self.kh}x{self.kw}/s{self.stride}{g} "
                f"@{self.h}x{self.w}")


#: The benchmark layers, for the report and for ``bench/bench_conv.py`` alike: ResNet-18's
#: 3x3 stages, VGG-16 conv1_2, a ResNet-50 1x1, ResNet-18's conv4_1 (a stride-2 3x3), a
#: MobileNet depthwise layer, where direct convolution applies, and ResNeXt-50's grouped
#: 3x3 (32 groups of 8 channels).
LAYERS = (
    ConvLayer("resnet18_conv2_x", 64, 56, 56, 64, 3, 3, 1, 1),
    ConvLayer("resnet18_conv3_x", 128, 28, 28, 128, 3, 3, 1, 1),
    ConvLayer("resnet18_conv4_x", 256, 14, 14, 256, 3, 3, 1, 1),
    ConvLayer("resnet18_conv5_x", 512, 7, 7, 512, 3, 3, 1, 1),
    ConvLayer("vgg16_conv1_2", 64, 224, 224, 64, 3, 3, 1, 1),
    ConvLayer("resnet50_1x1", 256, 56, 56, 64, 1, 1, 1, 0),
    ConvLayer("resnet18_3x3_s2", 128, 28, 28, 256, 3, 3, 2, 1),
    ConvLayer("mobilenet_dw", 256, 28, 28, 256, 3, 3, 1, 1, groups=256),
    ConvLayer("resnext50_grouped", 256, 28, 28, 256, 3, 3, 1, 1, groups=32),
)

#: ``--quick`` keeps one layer per path: Winograd-able 3x3, 1x1, stride-2 3x3.
QUICK_LAYERS = ("resnet18_conv2_x", "resnet50_1x1", "resnet18_3x3_s2")

#: Batch of the full suite (issue 3) and of ``--quick``.
BATCH, QUICK_BATCH = 8, 1


def conv_available():
    """(True, "") when ``tilegemm.conv2d`` exists, else (False, reason)."""
    import tilegemm
    if callable(getattr(tilegemm, "conv2d", None)):
        return True, ""
    return False, "tilegemm.conv2d is not available in this build (convolution not implemented yet)"


@dataclass(frozen=True)
class ConvCase:
    """One layer at one batch size, dtype and thread count."""

    layer: ConvLayer
    batch: int
    dtype: str
    threads: int

    @property
    def flops(self):
        """Direct-convolution flops: the basis of effective GFLOPS."""
        ly = self.layer
        ho, wo = ly.out_hw
        return 2.0 * self.batch * ly.k * ho * wo * (ly.c // ly.groups) * ly.kh * ly.kw

    def algorithm_flops(self, algorithm):
        """Multiply-add flops the algorithm itself performs (for % of peak).

        Winograd F(2x2,3x3) does 16 products per 2x2 output tile instead of 36;
        transforms are not counted.  Other algorithms do the direct count.
        """
        if algorithm != "winograd":
            return self.flops
        from tilegemm.conv.params import conv_params
        ly = self.layer
        p = conv_params((self.batch, ly.c, ly.h, ly.w), (ly.k, ly.c // ly.groups, ly.kh, ly.kw),
                        ly.stride, ly.padding, 1, ly.groups)
        return float(p.winograd_flops)

    def title(self):
        return (f"conv {self.layer.name} N={self.batch} {self.dtype} "
                f"{bench.threads_text(self.threads)}")


def conv_cases(dtypes, threads, quick=False, layers=None, batch=None):
    """Cases for every (dtype, thread count, layer).

    Parameters
    ----------
    layers : sequence of str, optional
        Layer names from :data:`LAYERS`; default all (``quick``: :data:`QUICK_LAYERS`).
    batch : int, optional
        Default :data:`BATCH` (``quick``: :data:`QUICK_BATCH`).
    """
    names = layers or (QUICK_LAYERS if quick else [ly.name for ly in LAYERS])
    by_name = {ly.name: ly for ly in LAYERS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown layer(s) {unknown}; known: {sorted(by_name)}")
    batch = batch or (QUICK_BATCH if quick else BATCH)
    return [ConvCase(by_name[n], batch, d, t) for d in dtypes for t in threads for n in names]


def _operands(case, seed=0):
    ly = case.layer
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((case.batch, ly.c, ly.h, ly.w)).astype(case.dtype)
    w = rng.standard_normal((ly.k, ly.c // ly.groups, ly.kh, ly.kw)).astype(case.dtype)
    return x, w


def _ours(x, w, layer, algorithm):
    import tilegemm
    return lambda: tilegemm.conv2d(x, w, None, layer.stride, layer.padding, 1, layer.groups,
                                   algorithm=algorithm)


def _torch_party(x, w, layer):
    torch = bench.torch_module()
    if torch is None:
        return None
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    f = torch.nn.functional.conv2d
    return lambda: f(tx, tw, None, layer.stride, layer.padding, 1, layer.groups)


def _probe(fn):
    """First call of ``fn``: (seconds, output) or (None, reason) when it does not apply."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except (ValueError, NotImplementedError) as exc:
        return None, str(exc)
    return time.perf_counter() - t0, np.asarray(result)


def auto_choice(case, x, w):
    """The algorithm ``algorithm="auto"`` picks for this case (None if not inspectable)."""
    import tilegemm
    plan = getattr(tilegemm, "conv_plan", None)
    if plan is None:
        return None
    ly = case.layer
    return plan(x.shape, w.shape, ly.stride, ly.padding, 1, ly.groups,
                dtype=np.dtype(case.dtype), threads=case.threads).algorithm


def run_conv_case(case, reps=5, min_time=0.05, algorithms=ALGORITHMS, peers=("torch",),
                  budget=10.0):
    """Time one layer: every applicable algorithm and torch, interleaved.

    Returns
    -------
    dict
        JSON-ready row: the layer, ``results`` per party (``"torch"`` and
        ``"tilegemm:<algorithm>"``) with GFLOPS (effective), ``pct_peak`` (on the
        algorithm's own flops), ``ratio`` (ours / torch) and, for auto, ``chose``
        (from ``tilegemm.conv_plan``); ``not_applicable``
        maps an algorithm that raised ValueError to the error message; ``check``
        holds each algorithm's max relative error against torch's float64 result
        (empty without torch).  ``budget`` caps the seconds of timed samples per
        party (slow algorithms get fewer repetitions).
    """
    x, w = _operands(case)
    ly = case.layer
    parties, first, outputs, not_applicable = {}, {}, {}, {}
    with bench.pinned_threads(case.threads):
        torch_fn = _torch_party(x, w, ly) if "torch" in peers else None
        if torch_fn is not None:
            parties["torch"] = torch_fn
        for algo in algorithms:
            fn = _ours(x, w, ly, algo)
            seconds, result = _probe(fn)
            if seconds is None:
                not_applicable[algo] = result
                continue
            name = f"tilegemm:{algo}"
            parties[name], first[name], outputs[name] = fn, seconds, result
        timings = bench.interleaved(parties, reps=reps, min_time=min_time,
                                    settle=bench.settle_time(case.threads),
                                    ramp=bench.ramp_time(case.threads), budget=budget,
                                    first_calls=first)
        peak = bench.peak_gflops(case.dtype, case.threads)
        chosen = auto_choice(case, x, w) if "tilegemm:auto" in parties else None
    results = bench.summarise(timings, case.flops, peak)
    for name, row in results.items():
        algo = name.split(":", 1)[1] if ":" in name else None
        if algo == "auto" and chosen:
            row["chose"] = chosen
            algo = chosen
        if algo and peak:
            own = bench.gflops(case.algorithm_flops(algo), row["best_s"])
            row["pct_peak"] = 100.0 * own / peak
        if algo and "torch" in results:
            row["ratio"] = row["gflops"] / results["torch"]["gflops"]
    return {
        "op": "conv", "layer": ly.name, "shape": ly.describe(), "batch": case.batch,
        "dtype": case.dtype, "threads": case.threads, "flops": case.flops,
        "peak_gflops": peak, "reps": reps, "results": results,
        "not_applicable": not_applicable, "check": _check(x, w, ly, outputs),
    }


def _check(x, w, layer, outputs):
    """Max relative error of every algorithm against a float64 reference (torch)."""
    torch = bench.torch_module()
    if torch is None or not outputs:
        return {}
    f = torch.nn.functional.conv2d
    ref = f(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(w.astype(np.float64)),
            None, layer.stride, layer.padding, 1, layer.groups).numpy()
    from tilegemm.bench_gemm import max_rel_error
    tol = 1e-3 if x.dtype == np.float32 else 1e-9  # Winograd's transforms cost some digits
    checks = {}
    for name, out in outputs.items():
        err = max_rel_error(out, ref) if out.shape == ref.shape else float("inf")
        ok = bool(err <= tol)  # False for NaN too
        checks[name] = {"max_rel_error": err if math.isfinite(err) else None,
                        "tolerance": tol, "ok": ok}
    return checks
