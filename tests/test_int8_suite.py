"""The int8 benchmark suite: its cases, its exact check and its table."""
import numpy as np

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
    assert "not the exact product" in title and rows[0][5] == "1*"
