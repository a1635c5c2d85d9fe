"""Machine detection, block sizes and peak."""
import numpy as np
import pytest

from tilegemm.tuning.blocking import blocking, register_tiles
from tilegemm.tuning.machine import ISA_SHAPE, detect, max_clock
from tilegemm.kernels.peak import measured_peak_gflops
from tilegemm.tuning.peak import nominal_peak_gflops


def test_detect_reports_per_core_caches():
    m = detect()
    assert m.isa in ISA_SHAPE
    assert m.cores >= 1
    assert 8 * 1024 <= m.l1d_bytes <= 1 << 20, "L1d should be per core"
    assert m.l2_bytes > m.l1d_bytes
    assert (m.vector_bits, m.vector_registers) == ISA_SHAPE[m.isa]


@pytest.mark.parametrize("registers,lanes", [(32, 16), (32, 8), (16, 8), (16, 4)])
def test_register_tiles_fit_the_register_file(registers, lanes):
    tiles = register_tiles(registers, lanes)
    assert tiles
    for mr, nr in tiles:
        assert nr % lanes == 0
        assert mr * nr // lanes + nr // lanes + 1 <= registers


@pytest.mark.parametrize("registers,lanes,best", [(32, 16, (6, 64)), (32, 8, (6, 32)),
                                                  (16, 8, (6, 16)), (16, 4, (6, 8))])
def test_preferred_tile_has_six_rows(registers, lanes, best):
    """AVX-512 keeps 6x64 (nv = 4); AVX2 takes BLIS's 6x16 over the 4x24 that loads less."""
    assert register_tiles(registers, lanes)[0] == best


@pytest.mark.parametrize("registers,lanes", [(32, 16), (32, 8), (16, 8), (16, 4)])
def test_wide_products_take_a_tile_that_pads_fewer_columns(registers, lanes):
    """kernel_for's tile for n columns past the default NR (tiles.snug_tile): the
    default where n is a multiple of its NR or its padding is within n / 16 of the
    best; else a tile that pads fewer columns and loads at most a tenth more a FMA.
    On AVX-512 float32, 96 columns take 9x48 instead of 6x64 over 128."""
    from types import SimpleNamespace
    from tilegemm.ground.contracts import round_up
    from tilegemm.kernels.tiles import snug_tile
    tiles = register_tiles(registers, lanes)
    mr, nr = tiles[0]
    blk = SimpleNamespace(mr=mr, nr=nr, lanes=lanes)

    def per_load(t):
        return t[0] * (t[1] // lanes) / (t[0] + t[1] // lanes)
    for n in range(nr + 1, 8 * nr):
        got = snug_tile(tiles, n, blk)
        assert got in tiles
        if got != (mr, nr):
            assert 16 * (round_up(n, nr) - round_up(n, got[1])) > n, (n, got)
            assert per_load(got) >= 0.9 * per_load((mr, nr)), (n, got)
        elif n % nr == 0:
            assert got == (mr, nr)
    if (registers, lanes) == (32, 16):
        assert snug_tile(tiles, 96, blk) == (9, 48)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blocking_follows_the_formulas(dtype):
    m = detect()
    b = blocking(dtype)
    size = np.dtype(dtype).itemsize
    assert b.lanes * size * 8 == m.vector_bits
    assert b.nr % b.lanes == 0 and b.mc % b.mr == 0 and b.nc % b.nr == 0
    # KC: the B micro-panel fills L1d (rounded down to a multiple of 8).
    assert b.kc <= m.l1d_bytes // (b.nr * size) < b.kc + 8
    # MC: the A block is about two L1s.
    assert b.mc * b.kc * size <= 2 * m.l1d_bytes < (b.mc + b.mr) * b.kc * size
    # NC: the B panel in a quarter of a core's L3 share, or in L2 - L1d if larger.
    panel = max(m.l2_bytes - m.l1d_bytes, m.l3_bytes // (4 * m.cores))
    assert b.nc * b.kc * size <= panel < (b.nc + b.nr) * b.kc * size
    assert set(b.source.values()) == {"derived"}


def test_nc_falls_back_to_l2_without_l3():
    from dataclasses import replace
    m = replace(detect(), l1d_bytes=32 << 10, l2_bytes=512 << 10, l3_bytes=0)
    b = blocking(np.float32, machine=m, kc=256, nr=16)
    assert b.nc == (480 << 10) // (256 * 4) // 16 * 16
    b = blocking(np.float32, machine=replace(m, l3_bytes=32 << 20, cores=2), kc=256, nr=16)
    assert b.nc == (4 << 20) // (256 * 4)


def test_blocking_overrides(monkeypatch):
    b = blocking(np.float32, kc=100, mc=50, nc=1000)
    assert b.kc == 100 and b.mc % b.mr == 0 and b.nc % b.nr == 0
    assert b.source["kc"] == "keyword"
    monkeypatch.setenv("TILEGEMM_KC", "77")
    assert blocking(np.float32).kc == 77
    assert blocking(np.float32).source["kc"] == "environment"
    with pytest.raises(ValueError, match="KC"):
        blocking(np.float32, kc=0)
    with pytest.raises(ValueError, match="multiple"):
        blocking(np.float32, nr=17)
    with pytest.raises(TypeError):
        blocking(np.int32)


def test_overridden_blocking_is_used_and_correct(monkeypatch):
    """Odd block sizes through the whole driver still give the right product."""
    from tilegemm.kernels import driver
    import tilegemm
    monkeypatch.setenv("TILEGEMM_KC", "7")
    monkeypatch.setenv("TILEGEMM_MC", "12")
    monkeypatch.setenv("TILEGEMM_NC", "128")
    driver.reset_plans()
    try:
        rng = np.random.default_rng(1)
        a = rng.standard_normal((100, 59))
        b = rng.standard_normal((59, 300))
        assert np.allclose(tilegemm.matmul(a, b), a @ b, rtol=1e-12, atol=1e-12)
    finally:
        monkeypatch.undo()
        driver.reset_plans()


def test_peaks_are_positive_and_plausible():
    nominal = nominal_peak_gflops(np.float32)
    measured = measured_peak_gflops(np.float32, seconds=0.05)
    assert nominal > 0 and measured > 0
    # A turbo clock can beat the nominal one, but not by 3x.
    assert measured < 3 * nominal
    assert measured_peak_gflops(np.float64, seconds=0.05) < measured * 1.2


@pytest.mark.parametrize("scaling, attempts", [(0.0, 1), (10.0, 3)])
def test_several_thread_peak_measured_again_when_below_one_thread(scaling, attempts, monkeypatch):
    """A 2-thread peak under PEAK_SCALING x 2 x the 1-thread peak is measured again, up to
    PEAK_ATTEMPTS times (a scaling of 10 can never be reached; 0 always is)."""
    import threading
    import time as time_mod
    from tilegemm.kernels import peak
    main_calls = []

    def fake_kernel(iters, x):
        if threading.current_thread() is threading.main_thread():
            main_calls.append(iters)
        time_mod.sleep(iters * 1e-9)

    monkeypatch.setattr(peak, "PEAK_SCALING", scaling)
    single = peak.measure_peak(fake_kernel, np.float32, 1, seconds=0.004)
    del main_calls[:]
    gflops = peak.measure_peak(fake_kernel, np.float32, 2, seconds=0.004, single=single)
    # The calibration's last run, then five timed runs per attempt, all of that length.
    assert main_calls.count(main_calls[-1]) == 1 + 5 * attempts
    assert gflops > 0


def test_measured_peak_is_measured_once_per_process():
    from tilegemm.kernels import peak
    first = peak.measured_peak_gflops(np.float32, 1, seconds=0.01)
    assert peak.measured_peak_gflops(np.float32, 1, seconds=0.01) == first


def test_max_clock_prefers_cpufreq_then_py_cpuinfo(tmp_path):
    freq = tmp_path / "cpuinfo_max_freq"
    freq.write_text("3500000\n")  # kHz
    assert max_clock(str(freq), pycpuinfo={}) == (3.5e9, "cpufreq max")
    missing = str(tmp_path / "absent")
    fake = {"hz_advertised": (2.3e9, 0), "hz_actual": (3.1e9, 0)}
    assert max_clock(missing, pycpuinfo=fake) == (3.1e9, "py-cpuinfo")
    assert max_clock(missing, pycpuinfo={}) == (detect().clock_hz, "base clock")


def test_nominal_peak_on_the_max_clock_is_at_least_the_base_one():
    base = nominal_peak_gflops(np.float32, 1)
    assert nominal_peak_gflops(np.float32, 1, clock="max") >= base * 0.999
    assert nominal_peak_gflops(np.float32, 2) == pytest.approx(2 * base)
    with pytest.raises(ValueError):
        nominal_peak_gflops(np.float32, 1, clock="turbo")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m, n", [(29, 20), (32, 8), (44, 8), (20, 50), (61, 16)])
def test_packed_blocks_are_whole_panels_of_the_products_own_tile(dtype, m, n):
    """A product on a tile other than its blocking's (``driver.product_kernel``'s item
    tile) packs MC rows and NC columns in whole panels of that tile: the packers fill
    whole panels, so a blocking's MC of another MR (30 on a 6-row tile) would let
    them write past the A buffer."""
    from tilegemm.kernels import driver
    kern, blk = driver.product_kernel(np.dtype(dtype), m, n)
    for b in (blk, blocking(dtype, mc=30, nc=5 * 16)):
        path, (KC, MC, NC), sizes = driver.serial_plan(kern, b, m, n, 900, (1, 900))
        assert path == "packed"
        assert MC % kern.mr == 0 and MC >= min(b.mc, m) and NC % kern.nr == 0
        assert sizes == (MC * KC, NC * KC)
        assert driver.balanced_rows(m, b.mc, kern.mr, 2) % kern.mr == 0
