"""The int8 benchmark suite: its cases, its exact check and its table."""
import numpy as np

import tilegemm
from tilegemm.tools import int8_suite


def test_int8_case_record_and_table():
    """One small int8 case end to end: every party timed, the result checked, a table row."""
    record = int8_suite.run_int8_case(int8_suite.Int8Case(64, 1), reps=1, min_time=0.001)
    assert record["check"]["ok"] and record["op"] == "int8"
    assert {"tilegemm", "tilegemm float32"} <= set(record["results"])
    assert record["results"]["tilegemm float32"]["ratio"] > 0
    title, headers, rows = int8_suite.int8_table([record])
    assert len(rows) == 1 and len(rows[0]) == len(headers) and rows[0][0] == 64
    assert "int8 gemm n=64" in int8_suite.row_text(record)


def test_int8_seven_bit_case_runs_the_kernel_its_weights_get():
    """The 7-bit weights of the full suite: within [-64, 63], checked exact, and the
    record names the kernel that ran (``maddubs`` where the host's is ``madd``)."""
    from tilegemm.kernels.qgemm import int8_kind, runnable_int8_kinds
    case = int8_suite.Int8Case(48, 1, "7-bit")
    a, b = int8_suite.operands(48, weights="7-bit")
    assert b.min() == -64 and b.max() == 63
    record = int8_suite.run_int8_case(case, reps=1, min_time=0.001, peers=())
    assert record["check"]["ok"] and record["weights"] == "7-bit"
    kind = runnable_int8_kinds()[0]       # AMX, where the host has it, takes 48 x 48
    if kind[0] != "amx":
        kind = ("maddubs", 256) if int8_kind() == ("madd", 256) else int8_kind()
    want = "{} {}-bit".format(*kind)
    assert record["kernel"] == want
    assert {c.weights for c in int8_suite.int8_cases([1])} == set(int8_suite.WEIGHT_RANGES)
    assert {c.weights for c in int8_suite.int8_cases([1], quick=True)} == {"int8"}


def test_int8_check_is_exact_and_marks_an_inexact_peer():
    """Ours is checked against int64 numpy; a peer that differs is marked, not trusted."""
    a, b = int8_suite.operands(8)
    exact = (a.astype(np.int64) - int8_suite.A_ZERO_POINT) @ b.astype(np.int64)
    peer = exact.astype(np.int32)
    peer[0, 0] += 1
    result = int8_suite.check({"tilegemm": exact.astype(np.int32), "onnxruntime": peer}, a, b)
    assert result["ok"] and not result["onnxruntime_exact"]
    wrong = exact.astype(np.int32)
    wrong[-1, 3] -= 1
    assert not int8_suite.check({"tilegemm": wrong}, a, b)["ok"]
    record = {"n": 8, "threads": 1, "kernel": "k", "check": result,
              "results": {"tilegemm": {"gflops": 2.0, "pct_peak": 1.0},
                          "onnxruntime": {"gflops": 1.0, "ratio": 2.0}}}
    title, _, rows = int8_suite.int8_table([record])
    assert "not the exact product" in title and rows[0][6] == "1*"


def test_qconv_case_record_and_table():
    """One int8 convolution case end to end: exact codes, every party timed, a row."""
    from tilegemm.tools import qconv_suite
    case = qconv_suite.QConvCase("resnet18_conv5_x", "NHWC", 1, batch=2)
    record = qconv_suite.run_qconv_case(case, reps=1, min_time=0.001, peers=())
    assert record["check"] == {"against": "float64 reference", "max_code_diff": 0, "ok": True}
    assert set(record["results"]) == {"tilegemm", "tilegemm float32"}
    assert record["ops"] == 2 * 2 * 512 * 512 * 9 * 7 * 7
    title, headers, rows = qconv_suite.qconv_table([record])
    assert len(rows[0]) == len(headers) and rows[0][:4] == ["resnet18_conv5_x",
                                                            "512->512 3x3/s1 @7x7", "NHWC", 2]
    assert "int8 conv resnet18_conv5_x NHWC batch 2" in qconv_suite.row_text(record)
    assert {c.batch for c in qconv_suite.qconv_cases([1])} == set(qconv_suite.BATCHES)
    assert "onnxruntime" not in title  # no peer ran: the title names none


def test_qconv_reference_and_check():
    """The float64 reference sums match a direct loop; the check counts code errors."""
    from tilegemm.tools import qconv_suite
    case = qconv_suite.QConvCase("resnet18_3x3_s2", "NCHW", 1, batch=2)
    q = qconv_suite.operands(case)
    ly = case.spec
    sums = qconv_suite.reference_sums(ly, q["x"], q["w"])
    xp = np.pad(q["x"].astype(np.int64) - qconv_suite.X_ZERO_POINT, ((0, 0), (0, 0), (1, 1), (1, 1)))
    k, i, j = 5, 3, 13  # one output by the definition: stride 2, padding 1
    for n in range(2):
        direct = (xp[n, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3] * q["w"][k].astype(np.int64)).sum()
        assert sums[n, k, i, j] == direct
    assert q["expected"].std() > 10  # the output scale spreads the codes over the range
    wrong = q["expected"].copy()
    wrong[0, 1, 2, 3] ^= 4
    result = qconv_suite.check(case, {"tilegemm": wrong, "onnxruntime": q["expected"]},
                               q["expected"])
    assert not result["ok"] and result["max_code_diff"] == 4 and result["onnxruntime_exact"]


def test_qconv_case_names_the_kernel_its_layer_runs_on():
    """Each suite layer's record names the kernel qconv2d chooses for it (``amx`` tiles
    where the host has them and they serve the layer), whose peak its % is against."""
    from tilegemm.conv.qconv import PreparedQConv
    from tilegemm.kernels.qgemm import int8_kind_for, taps_serve
    from tilegemm.tools import qconv_suite
    for name in qconv_suite.QCONV_LAYERS:
        case = qconv_suite.QConvCase(name, "NHWC", 1)
        ly = case.spec
        w = np.ones((ly.k, ly.c // ly.groups, ly.kh, ly.kw), np.int8)
        layer = PreparedQConv((1, ly.h, ly.w, ly.c), np.uint8, 0.02, tilegemm.QConvWeights(w, 0.1),
                              stride=ly.stride, padding=ly.padding, groups=ly.groups,
                              layout="NHWC")
        chosen = (layer.taps_shape[0] if taps_serve(int8_kind_for(w), ly.c // ly.groups, ly.groups)
                  else int8_kind_for(w))
        assert qconv_suite.layer_kernel(case, w) == chosen, name
