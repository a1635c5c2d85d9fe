"""The convolution benchmark suite: real network layers, each algorithm, torch beside.

Figures are *effective* GFLOPS: the direct convolution's flop count
(2·N·K·Ho·Wo·(C/groups)·kh·kw) over the time, whatever the algorithm, so the
columns compare speed.  % of peak uses the algorithm's own flop count (Winograd
F(2×2,3×3) multiplies 2.25× less, F(4×4,3×3) 4×), so it says how well the hardware
is used.
"""
import math
import threading
import time
import tracemalloc
from dataclasses import dataclass

import numba
import numpy as np

from tilegemm.tools import timing

#: Algorithms benchmarked, in table order.  "auto" is tilegemm's own choice.  Where
#: Winograd applies, each of its output tile sizes is timed as its own party
#: (:func:`winograd_label`), so that ``auto`` can be held against every one.
ALGORITHMS = ("im2col", "winograd", "direct", "auto")

#: Below this fraction of the fastest algorithm timed, ``auto``'s choice is reported.
AUTO_WITHIN = 0.9


def winograd_label(tile):
    """The party name of Winograd F(m x m, 3x3): ``"winograd F(4x4)"``."""
    return f"winograd F({tile}x{tile})"


def split_algorithm(algorithm):
    """``(algorithm, tile)``: ``("winograd", 4)`` for ``"winograd F(4x4)"``, else
    ``(algorithm, None)`` (plain ``"winograd"`` runs the tile the plan picks)."""
    head = "winograd F("
    if algorithm.startswith(head):
        return "winograd", int(algorithm[len(head):].split("x")[0])
    return algorithm, None

#: An algorithm estimated (``conv_plan``'s ``estimates``) or first measured more than
#: this many times slower than the layer's best is not timed further: the report
#: gives it a footnote instead of a row.  Direct convolution runs 15-90x behind on
#: dense layers, Winograd 7-140x on grouped and depthwise ones; timing them cost
#: most of a run and said nothing a reader could use.
COMPETITIVE_FACTOR = 8.0


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


#: The benchmark layers, for the report and for ``bench/`` alike: ResNet-18's
#: 3x3 stages, VGG-16 conv1_2, a ResNet-50 1x1, ResNet-18's conv4_1 (a stride-2 3x3), a
#: MobileNet depthwise layer, where direct convolution applies, ResNeXt-50's grouped
#: 3x3 (32 groups of 8 channels), then ResNet-18's 7x7 stride-2 stem, MobileNetV2's
#: depthwise 3x3 (144 channels at 56x56; 96 at 112x112, stride 2), a small 1x1
#: (32 -> 16 channels at 112x112) and ResNet-18's conv4_1 downsampling shortcut (a
#: stride-2 1x1).
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
    ConvLayer("resnet18_stem", 3, 224, 224, 64, 7, 7, 2, 3),
    ConvLayer("mobilenetv2_dw", 144, 56, 56, 144, 3, 3, 1, 1, groups=144),
    ConvLayer("mobilenetv2_dw_s2", 96, 112, 112, 96, 3, 3, 2, 1, groups=96),
    ConvLayer("mobilenet_1x1_small", 32, 112, 112, 16, 1, 1, 1, 0),
    ConvLayer("resnet18_downsample", 128, 28, 28, 256, 1, 1, 2, 0),
)

#: ``--quick`` keeps one layer per path: Winograd-able 3x3, 1x1, stride-2 3x3.
QUICK_LAYERS = ("resnet18_conv2_x", "resnet50_1x1", "resnet18_3x3_s2")

#: Batch of the full suite and of ``--quick``.
BATCH, QUICK_BATCH = 8, 1


@dataclass(frozen=True)
class ConvCase:
    """One layer at one batch size, dtype, thread count and data layout."""

    layer: ConvLayer
    batch: int
    dtype: str
    threads: int
    layout: str = "NCHW"

    @property
    def flops(self):
        """Direct-convolution flops: the basis of effective GFLOPS."""
        ly = self.layer
        ho, wo = ly.out_hw
        return 2.0 * self.batch * ly.k * ho * wo * (ly.c // ly.groups) * ly.kh * ly.kw

    @property
    def min_bytes(self):
        """Bytes a call must move at least: input, weights and output, each once."""
        ly = self.layer
        ho, wo = ly.out_hw
        elements = (self.batch * ly.c * ly.h * ly.w + ly.k * (ly.c // ly.groups) * ly.kh * ly.kw
                    + self.batch * ly.k * ho * wo)
        return elements * np.dtype(self.dtype).itemsize

    def algorithm_flops(self, algorithm):
        """Multiply-add flops the algorithm itself performs (for % of peak).

        Winograd F(m x m,3x3) (``"winograd F(4x4)"``; plain ``"winograd"``: the tile
        the plan runs) does (m+2)^2 products per m x m output tile instead of 9 m^2
        (F(2x2): 16 instead of 36); transforms are not counted.  Other algorithms do
        the direct count.
        """
        name, tile = split_algorithm(algorithm)
        if name != "winograd":
            return self.flops
        from tilegemm import conv_plan
        from tilegemm.conv.params import conv_params
        ly = self.layer
        shapes = ((self.batch, ly.c, ly.h, ly.w), (ly.k, ly.c // ly.groups, ly.kh, ly.kw))
        p = conv_params(*shapes, ly.stride, ly.padding, 1, ly.groups)
        if tile is None:
            x_shape = (shapes[0] if self.layout == "NCHW"
                       else (self.batch, ly.h, ly.w, ly.c))
            tile = conv_plan(x_shape, shapes[1], ly.stride, ly.padding, 1, ly.groups,
                             layout=self.layout, dtype=self.dtype,
                             threads=self.threads).winograd_tile
        return float(p.winograd_flops_of(tile))

    def title(self):
        layout = f" {self.layout}" if self.layout != "NCHW" else ""
        return (f"conv {self.layer.name} N={self.batch} {self.dtype}{layout} "
                f"{timing.threads_text(self.threads)}")


def conv_cases(dtypes, threads, quick=False, layers=None, batch=None, layout="NCHW"):
    """Cases for every (dtype, thread count, layer).

    Parameters
    ----------
    layers : sequence of str, optional
        Layer names from :data:`LAYERS`; default all (``quick``: :data:`QUICK_LAYERS`).
    batch : int, optional
        Default :data:`BATCH` (``quick``: :data:`QUICK_BATCH`).
    layout : {"NCHW", "NHWC"}
        Layout of the input and output of every call.
    """
    names = layers or (QUICK_LAYERS if quick else [ly.name for ly in LAYERS])
    by_name = {ly.name: ly for ly in LAYERS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown layer(s) {unknown}; known: {sorted(by_name)}")
    batch = batch or (QUICK_BATCH if quick else BATCH)
    return [ConvCase(by_name[n], batch, d, t, layout)
            for d in dtypes for t in threads for n in names]


def operands(case, seed=0):
    """Random (x, w) for a case; x C-contiguous in the case's layout."""
    ly = case.layer
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((case.batch, ly.c, ly.h, ly.w)).astype(case.dtype)
    if case.layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    w = rng.standard_normal((ly.k, ly.c // ly.groups, ly.kh, ly.kw)).astype(case.dtype)
    return x, w


def tilegemm_party(x, w, layer, algorithm, layout="NCHW"):
    """A zero-argument call of ``tilegemm.conv2d`` with ``algorithm`` (or a Winograd
    tile's label, :func:`winograd_label`) on ``layout`` data."""
    import tilegemm
    name, tile = split_algorithm(algorithm)
    extra = {} if tile is None else {"winograd_tile": tile}
    return lambda: tilegemm.conv2d(x, w, None, layer.stride, layer.padding, 1, layer.groups,
                                   algorithm=name, layout=layout, **extra)


def torch_party(x, w, layer, layout="NCHW"):
    """A zero-argument call of torch's conv2d (None without torch).

    NHWC data is handed over as the same memory seen as NCHW with channels-last
    strides, and the weight as channels-last, so torch runs its channels-last kernels.
    """
    torch = timing.torch_module()
    if torch is None:
        return None
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    if layout == "NHWC":
        tx, tw = tx.permute(0, 3, 1, 2), tw.contiguous(memory_format=torch.channels_last)
    f = torch.nn.functional.conv2d
    return lambda: f(tx, tw, None, layer.stride, layer.padding, 1, layer.groups)


#: Largest patch matrix the numpy peer builds; above it the peer sits the layer out
#: (VGG conv1_2 at batch 8 would need 0.9 GiB).
NUMPY_PEER_MAX_BYTES = 256 << 20


def im2col_numpy(x, w, stride=1, padding=0, groups=1, layout="NCHW"):
    """Convolution as explicit im2col and one ``numpy.matmul``: the peer that is always there.

    The patch matrix (groups x N·Ho·Wo x C/groups·kh·kw) is built in full from a
    strided window view of the padded image, then multiplied by the weights as
    one batched product per group, through numpy's BLAS.

    Parameters
    ----------
    x : ndarray
        (N, C, H, W), or (N, H, W, C) when ``layout`` is ``"NHWC"``.
    w : ndarray
        (K, C/groups, kh, kw).

    Returns
    -------
    ndarray
        (N, K, Ho, Wo), or (N, Ho, Wo, K) for NHWC.
    """
    nchw = x if layout == "NCHW" else x.transpose(0, 3, 1, 2)
    n, c, _, _ = nchw.shape
    k, cg, kh, kw = w.shape
    padded = np.pad(nchw, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (kh, kw), axis=(2, 3))
    windows = windows[:, :, ::stride, ::stride]          # N, C, Ho, Wo, kh, kw (a view)
    ho, wo = windows.shape[2:4]
    cols = (windows.reshape(n, groups, cg, ho, wo, kh, kw).transpose(1, 0, 3, 4, 2, 5, 6)
            .reshape(groups, n * ho * wo, cg * kh * kw))  # the copy: the patch matrix
    weights = w.reshape(groups, k // groups, cg * kh * kw).transpose(0, 2, 1)
    out = np.matmul(cols, weights).reshape(groups, n, ho, wo, k // groups)
    if layout == "NHWC":
        return out.transpose(1, 2, 3, 0, 4).reshape(n, ho, wo, k)
    return out.transpose(1, 0, 4, 2, 3).reshape(n, k, ho, wo)


def numpy_party(x, w, layer, layout="NCHW"):
    """A zero-argument call of :func:`im2col_numpy` (None when its patch matrix is too large)."""
    ho, wo = layer.out_hw
    patch_bytes = x.shape[0] * ho * wo * layer.c * layer.kh * layer.kw * x.itemsize
    if patch_bytes > NUMPY_PEER_MAX_BYTES:
        return None
    return lambda: im2col_numpy(x, w, layer.stride, layer.padding, layer.groups, layout)


def probe(fn):
    """First call of ``fn``: (seconds, output) or (None, reason) when it does not apply."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except (ValueError, NotImplementedError) as exc:
        return None, str(exc)
    return time.perf_counter() - t0, np.asarray(result)


def case_plan(case, x, w):
    """``tilegemm.conv_plan`` for this case: what ``algorithm="auto"`` picks, and the estimates."""
    import tilegemm
    ly = case.layer
    return tilegemm.conv_plan(x.shape, w.shape, ly.stride, ly.padding, 1, ly.groups,
                              layout=case.layout, dtype=np.dtype(case.dtype),
                              threads=case.threads)


def screen(seconds, how, keep=(), factor=COMPETITIVE_FACTOR):
    """The algorithms too slow to time further: ``{algorithm: footnote}``.

    Parameters
    ----------
    seconds : dict of str -> float
        Estimated or measured seconds per call of each algorithm.
    how : {"estimated", "measured"}
        Which kind ``seconds`` are, for the footnote.
    keep : sequence of str
        Algorithms never screened out (the one ``auto`` picks).
    factor : float
        More than ``factor`` times the fastest is too slow.

    Returns
    -------
    dict of str -> str
        E.g. ``{"direct": "skipped, estimated 32x slower than winograd"}``.
    """
    if not seconds:
        return {}
    best = min(seconds, key=seconds.get)
    return {a: f"skipped, {how} {t / seconds[best]:.0f}x slower than {best}"
            for a, t in seconds.items() if t > factor * seconds[best] and a not in keep}


def auto_result(results, chosen):
    """The ``tilegemm:auto`` row: the row of the algorithm ``auto`` picks, timed once.

    ``conv2d(algorithm="auto")`` runs the same path as the algorithm it picks, so
    timing it apart only added a row that differed by noise.  Returns a copy of
    ``results["tilegemm:<chosen>"]`` with ``chose`` and ``timed_as`` set, or None
    when that algorithm was not timed.
    """
    row = results.get(f"tilegemm:{chosen}")
    if row is None:
        return None
    return dict(row, chose=chosen, timed_as=f"tilegemm:{chosen}")


def gather_parties(case, x, w, peers=("numpy", "torch"), algorithms=ALGORITHMS):
    """The callables to time for ``case``: the peers in ``peers`` (numpy's explicit
    im2col when its patch matrix fits :data:`NUMPY_PEER_MAX_BYTES`, torch when
    installed) and every algorithm in ``algorithms`` that applies, each probed once.

    Returns
    -------
    (parties, first, outputs, not_applicable)
        ``{name: call}``; each tilegemm party's first-call seconds and result;
        ``{algorithm: reason}`` for those that do not apply.
    """
    ly = case.layer
    parties, first, outputs, not_applicable = {}, {}, {}, {}
    makers = {"numpy": numpy_party, "torch": torch_party}
    for peer in [p for p in makers if p in peers]:
        fn = makers[peer](x, w, ly, case.layout)
        if fn is not None:
            parties[peer] = fn
    for algo in algorithms:
        fn = tilegemm_party(x, w, ly, algo, case.layout)
        seconds, result = probe(fn)
        if seconds is None:
            not_applicable[algo] = result
            continue
        name = f"tilegemm:{algo}"
        parties[name], first[name], outputs[name] = fn, seconds, result
    return parties, first, outputs, not_applicable


def _per_call(fn, min_time, samples=2):
    """Seconds per call of ``fn``: the best of ``samples`` samples of at least ``min_time``."""
    best = None
    for _ in range(samples):
        calls, seconds = timing.calibrate(fn, min_time)
        best = seconds / calls if best is None else min(best, seconds / calls)
    return best


def _competitive_parties(case, x, w, peers, algorithms, min_time):
    """:func:`gather_parties` for the algorithms worth timing, and the footnotes of the rest.

    Screened first on ``conv_plan``'s estimates (a skipped algorithm is never
    compiled), then on a first measurement of each (:func:`_per_call`).  ``auto`` is probed once (its result
    is checked) but not timed: :func:`auto_result` gives its row.

    Returns
    -------
    (parties, first, outputs, not_applicable, skipped, chosen)
    """
    plan = case_plan(case, x, w)
    estimates, named = _party_estimates(plan, algorithms)
    chosen = None
    if "auto" in algorithms:
        chosen = (winograd_label(plan.winograd_tile) if plan.algorithm == "winograd"
                  else plan.algorithm)
    keep = (chosen,) if chosen else ()
    skipped = screen(estimates, "estimated", keep)
    timed = [a for a in named if a not in skipped]
    timed += [chosen] if chosen and chosen not in timed else []
    parties, first, outputs, not_applicable = gather_parties(case, x, w, peers, timed)
    warm = {a: _per_call(parties[f"tilegemm:{a}"], min_time) for a in timed
            if f"tilegemm:{a}" in parties}
    measured = screen(warm, "measured", keep)
    for algo in measured:
        del parties[f"tilegemm:{algo}"], first[f"tilegemm:{algo}"]
    skipped.update(measured)
    if chosen:
        seconds, result = probe(tilegemm_party(x, w, case.layer, "auto", case.layout))
        outputs["tilegemm:auto"] = result if seconds is not None else np.empty(0)
    return parties, first, outputs, not_applicable, skipped, chosen


def _party_estimates(plan, algorithms):
    """``(estimates, names)``: the plan's estimated seconds per party, and the parties of
    ``algorithms`` (but auto) in table order, Winograd as one party per tile size
    where it applies."""
    estimates, names = {}, []
    for algo in algorithms:
        if algo == "winograd" and plan.winograd_estimates:
            for tile, seconds in sorted(plan.winograd_estimates.items()):
                estimates[winograd_label(tile)] = seconds
                names.append(winograd_label(tile))
        elif algo != "auto":
            names.append(algo)
            if algo in plan.estimates:
                estimates[algo] = plan.estimates[algo]
    return estimates, names


def mark_auto(results, auto):
    """Add to the ``auto`` row ``vs_best`` (its GFLOPS over the fastest algorithm timed)
    and ``best`` (that algorithm)."""
    ours = {name.split(":", 1)[1]: row["gflops"] for name, row in results.items()
            if name.startswith("tilegemm:") and name != "tilegemm:auto"}
    best = max(ours, key=ours.get)
    auto.update(vs_best=auto["gflops"] / ours[best], best=best)
    return auto


def run_conv_case(case, reps=5, min_time=0.05, algorithms=ALGORITHMS, peers=("numpy", "torch"),
                  budget=10.0):
    """Time one layer: each applicable, competitive algorithm and the peers, interleaved.

    Returns
    -------
    dict
        JSON-ready row: the layer, ``results`` per party (``"numpy"``, ``"torch"``
        and ``"tilegemm:<algorithm>"``) with GFLOPS (effective), ``pct_peak`` (on
        the algorithm's own flops), ``ratio`` (ours / torch) and ``ratio_numpy``
        (ours / numpy); ``tilegemm:auto`` is the row of the algorithm it picks
        (:func:`auto_result`: ``chose``, ``timed_as``; :func:`mark_auto`: ``vs_best``,
        ``best``).  Winograd is timed per tile size (``"tilegemm:winograd F(4x4)"``,
        :func:`winograd_label`) where it applies. ``not_applicable`` maps an
        algorithm that raised ValueError to the error message, ``skipped`` an
        algorithm more than :data:`COMPETITIVE_FACTOR` times slower than the best to
        its footnote (:func:`screen`); ``check`` holds each algorithm's max relative
        error against a float64 result (:func:`im2col_numpy` on float64 operands).
        ``budget`` caps the seconds of timed samples per party (slow algorithms get
        fewer repetitions).
    """
    x, w = operands(case)
    ly = case.layer
    with timing.pinned_threads(case.threads):
        parties, first, outputs, not_applicable, skipped, chosen = _competitive_parties(
            case, x, w, peers, algorithms, min_time)
        timings = timing.interleaved(parties, reps=reps, min_time=min_time,
                                     settle=timing.settle_time(case.threads),
                                     ramp=timing.ramp_time(case.threads), budget=budget,
                                     first_calls=first)
        peak = timing.peak_gflops(case.dtype, case.threads)
    results = timing.summarise(timings, case.flops, peak)
    for name, row in results.items():
        algo = name.split(":", 1)[1] if ":" in name else None
        if algo and peak:
            own = timing.gflops(case.algorithm_flops(algo), row["best_s"])
            row["pct_peak"] = 100.0 * own / peak
        if algo and "torch" in results:
            row["ratio"] = row["gflops"] / results["torch"]["gflops"]
        if algo and "numpy" in results:
            row["ratio_numpy"] = row["gflops"] / results["numpy"]["gflops"]
    auto = auto_result(results, chosen) if chosen else None
    if auto:
        results["tilegemm:auto"] = mark_auto(results, auto)
    return {
        "op": "conv", "layer": ly.name, "shape": ly.describe(), "batch": case.batch,
        "dtype": case.dtype, "threads": case.threads, "layout": case.layout, "flops": case.flops,
        "min_bytes": case.min_bytes, "peak_gflops": peak, "reps": reps, "results": results,
        "not_applicable": not_applicable, "skipped": skipped,
        "check": _check(x, w, ly, outputs, case.layout),
    }


def _check(x, w, layer, outputs, layout="NCHW"):
    """Max relative error of every algorithm against a float64 reference.

    The reference is :func:`im2col_numpy` on float64 operands (tests check it
    against a direct loop and torch), so results are checked with or without torch.
    """
    if not outputs:
        return {}
    ref = im2col_numpy(x.astype(np.float64), w.astype(np.float64), layer.stride,
                       layer.padding, layer.groups, layout)
    from tilegemm.tools.gemm_suite import max_rel_error
    tol = 1e-3 if x.dtype == np.float32 else 1e-9  # Winograd's transforms cost some digits
    checks = {}
    for name, out in outputs.items():
        err = max_rel_error(out, ref) if out.shape == ref.shape else float("inf")
        ok = bool(err <= tol)  # False for NaN too
        checks[name] = {"max_rel_error": err if math.isfinite(err) else None,
                        "tolerance": tol, "ok": ok}
    return checks


#: The layer whose im2col memory ``--memory`` measures: the largest patch matrix.
MEMORY_LAYER = "vgg16_conv1_2"


def im2col_memory(dtype="float32", layout="NCHW", layer=MEMORY_LAYER):
    """Peak extra bytes of implicit im2col on one batch-1 layer, and the explicit matrix's.

    The call runs on 1 thread.  It is compiled first, then traced (``tracemalloc``) with its weights
    prepared again and in a new Python thread, whose scratch buffers are new too,
    so everything the call allocates is counted; the output is subtracted.

    Returns
    -------
    dict
        ``layer``, ``dtype``, ``layout``, ``extra_bytes`` and ``explicit_bytes``
        (C/groups·kh·kw·Ho·Wo elements: the patch matrix explicit im2col would build).
    """
    ly = {x.name: x for x in LAYERS}[layer]
    x, w = operands(ConvCase(ly, 1, dtype, 1, layout))
    call = tilegemm_party(x, w, ly, "im2col", layout)
    call()                            # compiles
    w = w.copy()                      # a new weight array: prepared again, inside the trace
    call = tilegemm_party(x, w, ly, "im2col", layout)
    peak = []

    def traced():
        numba.set_num_threads(1)
        tracemalloc.start()
        try:
            call()
            peak.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()

    worker = threading.Thread(target=traced)
    worker.start()
    worker.join()
    ho, wo = ly.out_hw
    out_bytes = ly.k * ho * wo * x.itemsize
    explicit = (ly.c // ly.groups) * ly.kh * ly.kw * ho * wo * x.itemsize
    return {"layer": layer, "dtype": dtype, "layout": layout,
            "extra_bytes": peak[0] - out_bytes, "explicit_bytes": explicit}
