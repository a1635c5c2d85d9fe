"""Every rung of the cache-blocking ladder computes A @ B; the command runs end to end.

Correctness only: timings belong to ``tilegemm ladder`` itself, never to tests.
"""
import numpy as np
import pytest
from guard import GUARD_PAGES, guarded_empty

from tilegemm import ladder
from tilegemm.tuning.blocking import blocking

RUNGS = [r.number for r in ladder.RUNGS]

# Primes and sizes that are not multiples of MR (6), NR (64 / 32) or KC, including 1.
SHAPES = [(1, 1, 1), (7, 37, 67), (67, 131, 37), (131, 7, 1), (1, 67, 131), (37, 200, 131),
          (37, 131, 300)]  # n past rung 4's NC (256 with 2 MiB L2)


def _operands(m, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(dtype),
            rng.standard_normal((k, n)).astype(dtype))


def _check(c, a, b):
    ref = a.astype(np.float64) @ b.astype(np.float64)
    eps = np.finfo(a.dtype).eps
    # Each entry sums k products of standard normals: error grows about like k * eps.
    tol = 8 * eps * max(1, a.shape[1]) * max(1.0, np.abs(ref).max())
    err = np.abs(c.astype(np.float64) - ref)
    i, j = np.unravel_index(np.argmax(err), err.shape) if err.size else (0, 0)
    assert err.size == 0 or err[i, j] <= tol, (
        f"C[{i}, {j}] = {c[i, j]}, expected {ref[i, j]} (tol {tol:.2e}), "
        f"shape {a.shape} @ {b.shape}")


@pytest.mark.parametrize("number", RUNGS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rung_default_blocking(number, shape):
    a, b = _operands(*shape, np.float32)
    c = np.full((shape[0], shape[2]), np.nan, np.float32)  # every rung must overwrite C
    _check(ladder.compute(number, a, b, c), a, b)


# Small KC, MC, NC so that the jc, pc and ic loops all take several steps and end on
# partial blocks even on small matrices (MR and NR stay the library's: rung 5 needs them).
@pytest.mark.parametrize("number", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(67, 131, 137), (131, 67, 7), (13, 43, 211)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rung_small_blocks(number, dtype, shape):
    base = blocking(dtype)
    blk = blocking(dtype, kc=16, mc=2 * base.mr, nc=2 * base.nr)
    a, b = _operands(*shape, dtype, seed=1)
    _check(ladder.compute(number, a, b, blk=blk), a, b)


@pytest.mark.skipif(not GUARD_PAGES, reason="guard pages need mmap + mprotect")
@pytest.mark.parametrize("number", RUNGS)
def test_rung_against_guard_pages(number):
    """No rung reads past A or B, or writes past C, when each ends (or starts) at a
    guard page; the operands are left as they were."""
    m, k, n = 37, 131, 67
    a_vals, b_vals = _operands(m, k, n, np.float32, seed=2)
    for where in ("after", "before"):
        a = guarded_empty((m, k), np.float32, where=where)
        b = guarded_empty((k, n), np.float32, where=where)
        c = guarded_empty((m, n), np.float32, where=where)
        a[...], b[...], c[...] = a_vals, b_vals, np.nan
        _check(ladder.compute(number, a, b, c), a_vals, b_vals)
        assert np.array_equal(a, a_vals) and np.array_equal(b, b_vals)


@pytest.mark.parametrize("number", RUNGS)
def test_rung_k_zero(number):
    a = np.ones((7, 0), np.float32)
    b = np.ones((0, 5), np.float32)
    c = np.full((7, 5), np.nan, np.float32)
    assert (ladder.compute(number, a, b, c) == 0).all()


def test_compute_rejects_bad_input():
    a = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError):
        ladder.compute(1, a, np.ones((5, 2), np.float32))
    with pytest.raises(ValueError):
        ladder.compute(9, a, np.ones((4, 2), np.float32))
    with pytest.raises(TypeError):
        ladder.compute(1, a.astype(np.int32), np.ones((4, 2), np.int32))


def test_command_end_to_end(tmp_path, capsys):
    assert ladder.main(["--n", "48", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for r in ladder.RUNGS:
        assert f"| {r.number} | {r.title} |" in out
    assert (tmp_path / "ladder.md").read_text().startswith("| rung |")
    pytest.importorskip("matplotlib")
    png = (tmp_path / "ladder.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_rejects_bad_n(capsys):
    with pytest.raises(SystemExit):
        ladder.main(["--n", "0"])


def _result(number, gflops, n=1024, threads=1, peak=100.0, spread=0.02):
    return ladder.Result(ladder.RUNGS[number], n, threads, gflops, 0.1, 50.0, peak, spread)


def test_slower_rung_gets_a_note_saying_why():
    climbing = [_result(2, 20.0), _result(3, 30.0), _result(4, 29.0)]
    assert ladder.slower_notes(climbing) == []          # 0.97x: within the margin
    within = [_result(2, 20.0, spread=0.1), _result(3, 18.5, spread=0.1)]
    (note,) = ladder.slower_notes(within)
    assert note.startswith("rung 3 ran 0.93x rung 2 (within their runs' spread) here:")
    (note,) = ladder.slower_notes([_result(2, 30.0), _result(3, 20.0)])
    assert note.startswith("rung 3 ran 0.67x rung 2 here:")


def test_blocking_note_says_whether_b_fits_in_l3():
    (note,) = ladder.slower_notes([_result(1, 25.0), _result(2, 21.0)], l3_bytes=32 << 20)
    assert "B (4 MiB) sits in this CPU's L3 (32 MiB)" in note
    assert "sits in" not in ladder.blocking_reason(4096, 32 << 20)
    assert "sits in" not in ladder.blocking_reason(1024, 0)


def test_blocking_note_carries_the_rates_measured_past_l3():
    results = [_result(1, 25.0), _result(2, 21.0)]
    assert ladder.past_l3_quarter(1024, 32 << 20) == 2048
    assert ladder.past_l3_quarter(4096, 32 << 20) is None
    assert ladder.past_l3_quarter(1024, 0) is None
    assert ladder.blocking_check_n(results, 32 << 20) == 2048
    assert ladder.blocking_check_n(results, 0) is None
    assert ladder.blocking_check_n([_result(1, 25.0), _result(2, 24.5)], 32 << 20) is None
    assert ladder.blocking_check_n([_result(1, 0.5), _result(2, 0.4)], 32 << 20) is None  # too slow
    check = ladder.BlockingCheck(n=2048, loop_gflops=9.0, blocked_gflops=21.6)
    (note,) = ladder.slower_notes(results, l3_bytes=32 << 20, check=check)
    assert "(n = 2048) they ran 9.0 and 21.6 GFLOPS, rung 2 2.40x rung 1" in note


def test_measure_blocking_check_times_rungs_1_and_2():
    check = ladder.measure_blocking_check(96, rounds=1)
    assert check.n == 96 and check.loop_gflops > 0 and check.blocked_gflops > 0


def test_rung_below_n_gets_a_note():
    notes = ladder.smaller_n_notes([_result(0, 1.0, n=512), _result(1, 10.0)], 1024)
    assert len(notes) == 1 and notes[0].startswith("rung 0 ran at n = 512:")


def test_width_note_only_when_plain_numba_vectors_are_narrower(monkeypatch):
    from tilegemm.ladder import register_tile
    blk = blocking(np.float32)
    peak_bits = blk.lanes * 32
    results = [_result(4, 30.0, peak=100.0)]
    monkeypatch.setattr(register_tile, "vector_bits", lambda: peak_bits)
    assert ladder.width_notes(results) == []
    monkeypatch.setattr(register_tile, "vector_bits", lambda: peak_bits // 2)
    (note,) = ladder.width_notes(results)
    assert "50% of the peak" in note and "60% of that ceiling" in note
    assert ladder.width_notes([_result(3, 30.0)]) == []


def test_vector_bits_reads_the_compiled_tile():
    assert ladder.vector_bits() in (128, 256, 512)


def test_busy_machine_warnings():
    quiet = [_result(5, 80.0), _result(6, 150.0, threads=2, peak=200.0)]
    assert ladder.busy_machine_warning(quiet) is None
    assert "above the measured peak" in ladder.busy_machine_warning([_result(5, 120.0)])
    assert "apart" in ladder.busy_machine_warning([_result(5, 80.0, spread=0.5)])
    poor = [_result(5, 80.0), _result(6, 100.0, threads=2, peak=200.0)]
    assert "ran only 1.25x rung 5" in ladder.busy_machine_warning(poor)


def test_contention_note_sets_rung_6_beside_independent_products():
    contention = ladder.Contention(threads=2, n=1024, alone_gflops=80.0, together_gflops=136.0)
    assert contention.scaling == pytest.approx(1.7)
    results = [_result(5, 80.0), _result(6, 144.0, threads=2, peak=200.0)]
    (note,) = ladder.contention_notes(results, contention)
    assert note.startswith("rung 6 ran 1.80x rung 5 on 2 threads; 2 independent")
    assert "1.70x one alone (n = 1024)" in note
    assert ladder.contention_notes(results, None) == []
    assert ladder.contention_notes(results[:1], contention) == []


def test_measure_contention_times_products_alone_and_at_once():
    contention = ladder.measure_contention(64, 2, rounds=1)
    assert (contention.threads, contention.n) == (2, 64)
    assert contention.alone_gflops > 0 and contention.together_gflops > 0
