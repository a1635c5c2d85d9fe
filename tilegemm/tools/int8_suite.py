"""The int8 GEMM benchmark suite: ``qmatmul`` against our float32 GEMM and onnxruntime.

Each case is a square product n x n x n of uint8 activations (zero point 3) by
int8 weights, the form ONNX's MatMulInteger and quantized linear layers take: full
range, and (the full suite) 7-bit as onnxruntime's ``reduce_range`` quantizes them
for hosts without VNNI, which on AVX2 both onnxruntime's kernel and our ``maddubs``
kernel sum exactly.
Parties, interleaved under the rules of :mod:`tilegemm.tools.timing`:

* ``tilegemm``: :func:`tilegemm.qmatmul` (int32 result);
* ``tilegemm float32``: :func:`tilegemm.matmul` of the same values as float32;
* ``onnxruntime``: a one-node MatMulInteger model (when onnxruntime and onnx are
  installed), on as many intra-op threads as the case, spinning off so that its
  idle threads do not take the cores from the next party's samples.

GOPS count a multiply and an add per product; % of peak is against the int8
dot-product loop of :func:`tilegemm.kernels.peak.measured_int8_peak_gops`.  The
check compares our result with int64 numpy on a few rows, and records whether
onnxruntime's equals it too: on x86 CPUs without VNNI its uint8 x int8 kernel sums
pairs of products in saturating 16-bit lanes (``vpmaddubsw``, as its quantization
documentation warns), so full-range operands give it inexact results there; its
column is then marked.
"""
from dataclasses import dataclass

import numpy as np

from tilegemm.tools import timing

#: Square sizes of the full suite and of ``--quick``.
SIZES = (256, 512, 1024, 2048)
QUICK_SIZES = (256, 1024)
#: The activations' zero point.
A_ZERO_POINT = 3
#: The weights' ranges: full int8, and 7-bit (``reduce_range``); ``--quick`` the first.
WEIGHT_RANGES = {"int8": (-128, 127), "7-bit": (-64, 63)}


@dataclass(frozen=True)
class Int8Case:
    n: int
    threads: int
    weights: str = "int8"

    @property
    def ops(self):
        return 2.0 * self.n ** 3

    def title(self):
        return (f"int8 gemm {self.n}x{self.n}x{self.n} {timing.threads_text(self.threads)}"
                + ("" if self.weights == "int8" else f" {self.weights} b"))


def int8_cases(threads, quick=False, sizes=None):
    """Every case: each size for each thread count and weight range (``quick``: full
    range only)."""
    ranges = list(WEIGHT_RANGES)[:1] if quick else list(WEIGHT_RANGES)
    return [Int8Case(n, t, w) for w in ranges for t in threads
            for n in (sizes or (QUICK_SIZES if quick else SIZES))]


def operands(n, seed=0, weights="int8"):
    rng = np.random.default_rng(seed)
    low, high = WEIGHT_RANGES[weights]
    return (rng.integers(0, 256, (n, n)).astype(np.uint8),
            rng.integers(low, high + 1, (n, n)).astype(np.int8))


def onnx_session(n, threads):
    """An onnxruntime session of one MatMulInteger node (uint8 x int8, A's zero point
    :data:`A_ZERO_POINT`), or None when onnxruntime or onnx is missing."""
    ort, onnx = timing.optional_import("onnxruntime"), timing.optional_import("onnx")
    if ort is None or onnx is None:
        return None
    from onnx import TensorProto, helper
    inputs = [helper.make_tensor_value_info("A", TensorProto.UINT8, [n, n]),
              helper.make_tensor_value_info("B", TensorProto.INT8, [n, n])]
    zero = helper.make_tensor("a_zero_point", TensorProto.UINT8, [], [A_ZERO_POINT])
    node = helper.make_node("MatMulInteger", ["A", "B", "a_zero_point"], ["Y"])
    graph = helper.make_graph([node], "matmul_integer", inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, [n, n])],
                              initializer=[zero])
    return ort_session(ort, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]),
                       threads)


def ort_session(ort, model, threads):
    """An onnxruntime CPU session of ``model`` on ``threads`` intra-op threads, spinning
    off so that its idle threads do not take the cores from the next party's samples."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def int8_parties(case, a, b, peers=("onnxruntime",)):
    """Zero-argument callables of the case, and where each leaves its result."""
    import tilegemm
    af, bf = a.astype(np.float32), b.astype(np.float32)
    out = {"tilegemm": np.empty((case.n, case.n), np.int32),
           "tilegemm float32": np.empty((case.n, case.n), np.float32)}
    parties = {
        "tilegemm": lambda: tilegemm.qmatmul(a, b, out=out["tilegemm"], a_zero_point=A_ZERO_POINT),
        "tilegemm float32": lambda: tilegemm.matmul(af, bf, out=out["tilegemm float32"]),
    }
    session = onnx_session(case.n, case.threads) if "onnxruntime" in peers else None
    if session is not None:
        feed = {"A": a, "B": b}
        parties["onnxruntime"] = lambda: out.__setitem__("onnxruntime", session.run(None, feed)[0])
    return parties, out


def check(out, a, b):
    """Our int32 result against int64 numpy on three rows; where onnxruntime ran,
    ``onnxruntime_exact`` says whether its result equals the same rows."""
    rows = sorted({0, len(a) // 2, len(a) - 1})
    want = (a[rows].astype(np.int64) - A_ZERO_POINT) @ b.astype(np.int64)
    result = {"against": "int64 numpy, 3 rows",
              "ok": bool(np.array_equal(out["tilegemm"][rows], want))}
    if "onnxruntime" in out:
        result["onnxruntime_exact"] = bool(np.array_equal(out["onnxruntime"][rows], want))
    return result


def run_int8_case(case, reps=5, min_time=0.05, peers=("onnxruntime",)):
    """Time one case; returns its report row (JSON-ready): GOPS, % of the int8 peak,
    ``ratio`` (our int8 GOPS over each other party's) and the check."""
    from tilegemm.kernels.qgemm import matrix_kind_for
    a, b = operands(case.n, weights=case.weights)
    record, out = timed(lambda: int8_parties(case, a, b, peers), case, reps, min_time,
                        matrix_kind_for(b, 0, case.n))
    return dict({"op": "int8", "n": case.n, "weights": case.weights}, **record,
                check=check(out, a, b))


def timed(make_parties, case, reps, min_time, kernel):
    """Time the parties ``make_parties()`` returns (with where they leave their
    results) on ``case.threads`` threads; returns the record's common fields and the
    results: GOPS and % of the int8 peak per party, ``ratio`` (ours over each other).
    ``kernel``: the ``(kind, bits)`` our party runs on, whose dot-product step's
    peak the % of peak is against."""
    from tilegemm.kernels.peak import measured_int8_peak_gops
    with timing.pinned_threads(case.threads):
        parties, out = make_parties()
        timings = timing.interleaved(parties, reps=reps, min_time=min_time,
                                     settle=timing.settle_time(case.threads),
                                     ramp=timing.ramp_time(case.threads))
        peak = measured_int8_peak_gops(case.threads, kernel)
    results = timing.summarise(timings, case.ops, peak)
    ours = results["tilegemm"]["gflops"]
    for name, row in results.items():
        if name != "tilegemm":
            row["ratio"] = ours / row["gflops"]
    kind, bits = kernel
    return {"threads": case.threads, "ops": case.ops, "kernel": f"{kind} {bits}-bit",
            "peak_gops": peak, "reps": reps, "results": results}, out


#: The parties beside ours in the int8 tables.
OTHERS = ("tilegemm float32", "onnxruntime")


def party_headers(records):
    """The parties beside ours that ran in ``records``, and their table headers."""
    others = [name for name in OTHERS if any(name in r["results"] for r in records)]
    return others, ([f"{name} {'GFLOPS' if 'float' in name else 'GOPS'}" for name in others]
                    + [f"× {name}" for name in others])


def party_cells(record, others):
    """Ours (GOPS, % of the int8 peak), then each other party's rate (``*``: its
    result was not exact) and our ratio to it."""
    res = record["results"]
    ours = res["tilegemm"]
    mark = {"onnxruntime": "" if record["check"].get("onnxruntime_exact", True) else "*"}
    return ([f"{ours['gflops']:.0f}", f"{ours['pct_peak']:.0f}" if ours["pct_peak"] else "-"]
            + [f"{res[n]['gflops']:.0f}{mark.get(n, '')}" if n in res else "-" for n in others]
            + [f"{res[n]['ratio']:.2f}" if n in res else "-" for n in others])


def int8_table(records):
    """``(title, headers, rows)`` of the int8 cases."""
    others, party_header = party_headers(records)
    headers = ["n", "weights", "threads", "kernel", "int8 GOPS", "% int8 peak"] + party_header
    rows = [[r["n"], r.get("weights", "int8"), r["threads"], r["kernel"]] + party_cells(r, others)
            for r in records]
    title = ("int8 GEMM (uint8 x int8 -> int32, exact): qmatmul against our float32 GEMM"
             + (" and onnxruntime's MatMulInteger" if "onnxruntime" in others else ""))
    if any(not r["check"].get("onnxruntime_exact", True) for r in records):
        title += ("; * onnxruntime's result is not the exact product on this host "
                  "(saturating 16-bit pair sums)")
    return title, headers, rows


def row_text(record):
    """One line for a finished int8 case."""
    res = record["results"]
    parts = "; ".join(f"{name.replace('tilegemm', 'ours')} {row['gflops']:.0f}"
                      for name, row in res.items())
    return (f"int8 gemm n={record['n']} {record.get('weights', 'int8')} b "
            f"{timing.threads_text(record['threads'])} "
            f"({record['kernel']}): {parts} G(FL)OPS"
            + ("" if record["check"]["ok"] else " WRONG RESULT")
            + ("" if record["check"].get("onnxruntime_exact", True)
               else " (onnxruntime's result inexact)"))
