"""``python -m tilegemm dask``, the LocalCluster benchmark, on small sizes: every
party timed, the report written, bad options refused."""
import json

from tilegemm.tools import cli


def test_the_benchmark_command_reports_every_party(tmp_path):
    assert cli.main(["dask", "--n", "300", "--batch", "2", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "dask.json").read_text())
    assert set(report["gemm"]) == {"dask A @ B (numpy blocks)", "tilegemm.dask.matmul, same chunks",
                                   "tilegemm.dask.matmul, rechunk=True",
                                   "tilegemm.matmul, one local call"}
    for row in list(report["gemm"].values()) + list(report["conv"].values()):
        assert row["seconds"] > 0 and row["gflops"] > 0
        if row["shares"] is not None:
            assert 0 < row["shares"]["compute"] <= 1.0 + 1e-6
    assert len(report["64^3 call us"]["workers"]) == 2
    text = (tmp_path / "dask.md").read_text()
    assert "300^3 float32 product" in text and "x dask numpy" in text
    assert cli.main(["dask", "--n", "0"]) == 2
