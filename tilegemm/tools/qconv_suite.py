"""The int8 convolution suite: ``qconv2d`` against our float32 ``conv2d`` and
onnxruntime's QLinearConv.

Each case is one layer of :data:`tilegemm.tools.conv_suite.LAYERS` at batch 1 or 8,
in one layout, as a quantized network runs it: uint8 activations with a zero point,
int8 weights with a scale per output channel (prepared once, :class:`QConvWeights`),
a bias, and the output requantized to uint8 (ONNX's QLinearConv).  Parties,
interleaved under the rules of :mod:`tilegemm.tools.timing`:

* ``tilegemm``: :func:`tilegemm.qconv2d` in the case's layout;
* ``tilegemm float32``: :func:`tilegemm.conv2d` of the same values as float32, same
  layout (the float layer the int8 one replaces);
* ``onnxruntime``: a one-node QLinearConv model (optional): ONNX's NCHW operator
  for NCHW cases, com.microsoft's ``channels_last`` one (what onnxruntime runs
  inside an NHWC-transformed model) for NHWC cases.

GOPS count a multiply and an add per product of the direct definition; % of peak
is against :func:`tilegemm.kernels.peak.measured_int8_peak_gops`.  The check
compares each int8 result with a float64 reference requantized the same way: the
codes may differ by one where the float32 scales round a value across a half.
"""
from dataclasses import dataclass

import numpy as np

from tilegemm.tools import int8_suite, timing
from tilegemm.tools.conv_suite import LAYERS

#: Layer names of the full suite and of ``--quick``.
QCONV_LAYERS = ("resnet18_conv2_x", "resnet18_conv3_x", "resnet18_conv4_x", "resnet18_conv5_x",
                "resnet18_3x3_s2", "resnet18_downsample", "resnet50_1x1", "resnet18_stem")
QUICK_LAYERS = ("resnet18_conv3_x",)
#: Batch sizes of the full suite (``--quick``: the first).
BATCHES = (1, 8)
LAYOUTS = ("NCHW", "NHWC")
#: The activations' zero point.
X_ZERO_POINT = 3
#: Largest difference in output codes the check accepts (see the module docstring).
CODE_TOLERANCE = 1


@dataclass(frozen=True)
class QConvCase:
    layer: str
    layout: str
    threads: int
    batch: int = 1
    weights: str = "int8"

    @property
    def spec(self):
        return next(ly for ly in LAYERS if ly.name == self.layer)

    @property
    def ops(self):
        ly = self.spec
        ho, wo = ly.out_hw
        return 2 * self.batch * ly.k * (ly.c // ly.groups) * ly.kh * ly.kw * ho * wo

    def title(self):
        return (f"int8 conv {self.layer} {self.layout} batch {self.batch} "
                f"{timing.threads_text(self.threads)}"
                + ("" if self.weights == "int8" else f" {self.weights} weights"))


def qconv_cases(threads, quick=False):
    """Every case: each layer in each layout at each batch size for each thread count
    and weight range (``quick``: the quick layers at batch 1 on the first thread
    count, full-range weights)."""
    names, threads = (QUICK_LAYERS, threads[:1]) if quick else (QCONV_LAYERS, threads)
    batches = BATCHES[:1] if quick else BATCHES
    ranges = list(int8_suite.WEIGHT_RANGES)[:1] if quick else list(int8_suite.WEIGHT_RANGES)
    return [QConvCase(name, layout, t, b, w) for w in ranges for t in threads for b in batches
            for name in names for layout in LAYOUTS]


def reference_sums(ly, x, w):
    """The exact sums of ``conv2d(x - X_ZERO_POINT, w)`` (NCHW x, float64 on BLAS:
    every partial sum is an integer far below 2**53)."""
    xp = np.pad(x.astype(np.float64) - X_ZERO_POINT,
                ((0, 0), (0, 0), (ly.padding,) * 2, (ly.padding,) * 2))
    ho, wo = ly.out_hw
    g, cg, kg = ly.groups, ly.c // ly.groups, ly.k // ly.groups
    out = np.empty((x.shape[0], ly.k, ho, wo))
    for n in range(x.shape[0]):
        for group in range(g):
            taps = [xp[n, group * cg:(group + 1) * cg, i:i + ly.stride * ho:ly.stride,
                       j:j + ly.stride * wo:ly.stride]
                    for i in range(ly.kh) for j in range(ly.kw)]
            patches = np.stack(taps, axis=1).reshape(cg * ly.kh * ly.kw, ho * wo)
            wg = w[group * kg:(group + 1) * kg].astype(np.float64).reshape(kg, -1)
            out[n, group * kg:(group + 1) * kg] = (wg @ patches).reshape(kg, ho, wo)
    return out


def operands(case, seed=0):
    """The case's quantized layer: a dict of the input (NCHW), weights, scales, bias,
    the output's scale and zero point, and the expected output codes (NCHW)."""
    ly = case.spec
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (case.batch, ly.c, ly.h, ly.w)).astype(np.uint8)
    low, high = int8_suite.WEIGHT_RANGES[case.weights]
    w = rng.integers(max(low, -127), high + 1, (ly.k, ly.c // ly.groups, ly.kh, ly.kw)).astype(np.int8)
    x_scale = np.float32(0.02)
    w_scale = rng.uniform(0.001, 0.004, ly.k).astype(np.float32)
    bias = rng.uniform(-1, 1, ly.k).astype(np.float32)
    y = (reference_sums(ly, x, w) * (float(x_scale) * w_scale.astype(np.float64))[:, None, None]
         + bias.astype(np.float64)[:, None, None])
    out_scale = np.float32((y.max() - y.min()) / 255)
    out_zero_point = np.uint8(np.clip(np.rint(-y.min() / out_scale), 0, 255))
    expected = np.clip(np.rint(y / np.float64(out_scale)) + int(out_zero_point), 0, 255)
    return {"x": x, "w": w, "x_scale": x_scale, "w_scale": w_scale, "bias": bias,
            "out_scale": out_scale, "out_zero_point": out_zero_point,
            "expected": expected.astype(np.uint8)}


def onnx_session(case, q):
    """An onnxruntime session of one QLinearConv node with the case's quantization:
    NCHW for NCHW cases; for NHWC ones com.microsoft's QLinearConv with
    ``channels_last=1``, the conv onnxruntime's NHWC transformer runs inside a model
    (its ONNX QLinearConv would transpose an NHWC case's input and output: 0.91-0.99x
    ours on ResNet layers against 1.02-1.12x). None when onnxruntime or onnx is
    missing; the NCHW node where the channels-last one does not load."""
    ort, onnx = timing.optional_import("onnxruntime"), timing.optional_import("onnx")
    if ort is None or onnx is None:
        return None
    if case.layout == "NHWC":
        try:
            return _ort_conv(ort, case, q, channels_last=True)
        except Exception:  # an onnxruntime without the contrib op: the standard one
            pass
    return _ort_conv(ort, case, q, channels_last=False)


def _ort_conv(ort, case, q, channels_last):
    from onnx import TensorProto, helper, numpy_helper
    ly = case.spec
    ho, wo = ly.out_hw
    bias_q = np.rint(q["bias"].astype(np.float64)
                     / (float(q["x_scale"]) * q["w_scale"].astype(np.float64)))
    consts = {"x_scale": np.float32(q["x_scale"]), "x_zero_point": np.uint8(X_ZERO_POINT),
              "w": q["w"], "w_scale": q["w_scale"], "w_zero_point": np.zeros(ly.k, np.int8),
              "y_scale": q["out_scale"], "y_zero_point": q["out_zero_point"],
              "B": bias_q.astype(np.int32)}
    extra = dict(domain="com.microsoft", channels_last=1) if channels_last else {}
    node = helper.make_node("QLinearConv", ["x"] + list(consts), ["y"],
                            kernel_shape=[ly.kh, ly.kw], strides=[ly.stride] * 2,
                            pads=[ly.padding] * 4, group=ly.groups, **extra)
    x_shape, y_shape = ((case.batch, ly.h, ly.w, ly.c), (case.batch, ho, wo, ly.k)) \
        if channels_last else ((case.batch, ly.c, ly.h, ly.w), (case.batch, ly.k, ho, wo))
    graph = helper.make_graph(
        [node], "qlinearconv",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, list(y_shape))],
        initializer=[numpy_helper.from_array(np.asarray(v), name) for name, v in consts.items()])
    opsets = [helper.make_opsetid("", 13)] + (
        [helper.make_opsetid("com.microsoft", 1)] if channels_last else [])
    session = int8_suite.ort_session(ort, helper.make_model(graph, opset_imports=opsets),
                                     case.threads)
    session.channels_last = channels_last
    return session


def qconv_parties(case, q, peers=("onnxruntime",)):
    """Zero-argument callables of the case, and where each leaves its result (NCHW
    or NHWC as the party computes it)."""
    import tilegemm
    ly = case.spec
    nhwc = case.layout == "NHWC"
    x = np.ascontiguousarray(q["x"].transpose(0, 2, 3, 1)) if nhwc else q["x"]
    xf = x.astype(np.float32)
    wf = q["w"].astype(np.float32) * np.float32(0.01)
    weights = tilegemm.QConvWeights(q["w"], q["w_scale"])
    geometry = dict(stride=ly.stride, padding=ly.padding, groups=ly.groups, layout=case.layout)
    out = {}

    def ours():
        out["tilegemm"] = tilegemm.qconv2d(
            x, q["x_scale"], weights, bias=q["bias"], x_zero_point=X_ZERO_POINT,
            out_scale=q["out_scale"], out_zero_point=q["out_zero_point"], **geometry)

    parties = {"tilegemm": ours,
               "tilegemm float32": lambda: tilegemm.conv2d(xf, wf, q["bias"], **geometry)}
    session = onnx_session(case, q) if "onnxruntime" in peers else None
    if session is not None:
        feed = {"x": x if session.channels_last else q["x"]}
        # its result as NCHW, for the check (a channels-last one transposed after timing)
        out["onnxruntime channels last"] = session.channels_last
        parties["onnxruntime"] = lambda: out.__setitem__("onnxruntime",
                                                         session.run(None, feed)[0])
    return parties, out


def check(case, out, expected):
    """Each int8 result's largest code difference from the float64 reference;
    ``ok`` is ours within :data:`CODE_TOLERANCE`, ``onnxruntime_exact`` the peer's."""
    ours = out["tilegemm"]
    if case.layout == "NHWC":
        ours = ours.transpose(0, 3, 1, 2)
    diff = int(np.abs(ours.astype(np.int32) - expected).max())
    result = {"against": "float64 reference", "max_code_diff": diff,
              "ok": ours.dtype == np.uint8 and diff <= CODE_TOLERANCE}
    if "onnxruntime" in out:
        theirs = out["onnxruntime"]
        if out.get("onnxruntime channels last"):
            theirs = theirs.transpose(0, 3, 1, 2)
        result["onnxruntime_channels_last"] = bool(out.get("onnxruntime channels last"))
        peer = int(np.abs(theirs.astype(np.int32) - expected).max())
        result["onnxruntime_max_code_diff"] = peer
        result["onnxruntime_exact"] = peer <= CODE_TOLERANCE
    return result


def layer_kernel(case, w):
    """The ``(kind, bits)`` qconv2d runs the case's layer on: the taps kernel's choice
    (``amx`` tiles where they serve it), else the weights' kernel."""
    from tilegemm.kernels.qgemm import int8_kind_for, taps_kind_for, taps_serve
    ly = case.spec
    kind, cg = int8_kind_for(w), ly.c // ly.groups
    if not taps_serve(kind, cg, ly.groups):
        return kind
    geometry = (ly.kw, 1, ly.w + 2 * ly.padding, ly.out_hw[1], ly.stride, ly.stride)
    return taps_kind_for(kind, cg, ly.groups, ly.k // ly.groups, geometry)[0]


def run_qconv_case(case, reps=5, min_time=0.05, peers=("onnxruntime",)):
    """Time one case; returns its report row (JSON-ready): GOPS, % of the int8 peak
    of the kernel it runs on, ``ratio`` (our int8 GOPS over each other party's) and
    the check."""
    q = operands(case)
    record, out = int8_suite.timed(lambda: qconv_parties(case, q, peers), case, reps, min_time,
                                   layer_kernel(case, q["w"]))
    return dict({"op": "qconv", "layer": case.layer, "shape": case.spec.describe(),
                 "layout": case.layout, "batch": case.batch, "weights": case.weights},
                **record, check=check(case, out, q["expected"]))


def qconv_table(records):
    """``(title, headers, rows)`` of the int8 convolution cases."""
    others, party_header = int8_suite.party_headers(records)
    headers = (["layer", "shape", "layout", "batch", "weights", "threads", "kernel", "int8 GOPS",
                "% int8 peak"] + party_header)
    rows = [[r["layer"], r["shape"], r["layout"], r.get("batch", 1), r.get("weights", "int8"),
             r["threads"], r["kernel"]] + int8_suite.party_cells(r, others) for r in records]
    title = ("int8 convolution (uint8 input, int8 weights per channel, requantized "
             "uint8 output): qconv2d against our float32 conv2d"
             + (" and onnxruntime's QLinearConv (NHWC cases: its channels-last conv, as "
                "in a model)"
                if "onnxruntime" in others else ""))
    if any(r["layout"] == "NHWC" and not r["check"].get("onnxruntime_channels_last", True)
           for r in records):
        title += "; its channels-last conv did not load here: NHWC cases against its NCHW one"
    if any(not r["check"].get("onnxruntime_exact", True) for r in records):
        title += (f"; * onnxruntime's codes differ from the reference by more than "
                  f"{CODE_TOLERANCE} on this host")
    return title, headers, rows


def row_text(record):
    """One line for a finished int8 convolution case."""
    res = record["results"]
    parts = "; ".join(f"{name.replace('tilegemm', 'ours')} {row['gflops']:.0f}"
                      for name, row in res.items())
    check = record["check"]
    return (f"int8 conv {record['layer']} {record['layout']} batch {record.get('batch', 1)} "
            f"{record.get('weights', 'int8')} weights "
            f"{timing.threads_text(record['threads'])} ({record['kernel']}): {parts} G(FL)OPS"
            + ("" if check["ok"] else f" WRONG RESULT (codes off by {check['max_code_diff']})")
            + ("" if check.get("onnxruntime_exact", True)
               else f" (onnxruntime's codes off by {check['onnxruntime_max_code_diff']})"))
