"""Register tile and cache block sizes, derived from the detected machine.

* MR x NR: the tile with the most FMAs per load instruction among those whose
  accumulators, one row of B vectors and a broadcast register fit the register file
  (``MR*NR/lanes + NR/lanes + 1 <= registers``) and that have at least 6 rows.
  Each B vector then feeds 6 or more FMAs: with 16 AVX2 registers the 4x24 tile
  (more FMAs per load, 12/7 against 12/8) measured slower than 6x16 on a Zen 3:
  GEMM at n = 256 62 against 84 GFLOPS, im2col convolutions up to 28% slower;
  with 32 AVX-512 registers the rule keeps 6x64.
* KC = L1d / (NR * sizeof): the B micro-panel (KC x NR) fills L1d.  In the jr -> ir
  order it is the operand every micro-kernel call of a macro-kernel re-reads, while
  A's MR-row micro-panels stream from L2.  The seed formula KC = L1d / ((MR+NR) *
  sizeof) (both panels in L1) gives 168 for float32 6x64; measured at n=2048 it
  ran 0.86x numpy against 0.91-0.95x for KC = 192-256.
* MC = 2 * L1d / (KC * sizeof): the packed A block is about two L1s, so it stays
  in L2 next to the B panel.  Against an A block filling half of L2 (MC ~ 1500),
  small blocks measured 0.90-0.95x numpy against 0.77x.
* NC: the B panel (KC x NC) in a quarter of one core's share of L3, or in what L2
  has left after L1d when that is larger; rounded to NR.  Each NC block repacks A,
  so a panel bounded by a small L2 (NC = 240 from Zen 3's 512 KiB) repacks A every
  240 columns: float32 at n = 1024-4096 on a Zen 3 measured 0.84-0.93x numpy with
  NC = 240 against 0.89-1.03x with NC = 2048 (4 MiB of L3), while NC = 4096 fell to
  0.78x at n = 4096 (two threads' panels then fill half of a shared L3).

Every value can be overridden by keyword or by ``TILEGEMM_{MR,NR,KC,MC,NC}``
(the environment applies to both dtypes).
"""
import os
from dataclasses import dataclass, asdict

import numpy as np

from tilegemm.tuning.machine import detect


@dataclass(frozen=True)
class Blocking:
    """Block sizes for one dtype, and where each came from."""

    dtype: str
    mr: int
    nr: int
    kc: int
    mc: int
    nc: int
    lanes: int
    isa: str
    source: dict

    def as_dict(self):
        return asdict(self)


def _round_down(x, m):
    return max(m, (x // m) * m)


def _b_panel_bytes(m):
    """Bytes for the KC x NC panel of B: a quarter of a core's L3 share, at least L2 - L1d."""
    return max(m.l2_bytes - m.l1d_bytes, m.l3_bytes // (4 * max(1, m.cores)))


#: Rows a preferred register tile has at least (see the module docstring).
MIN_MR = 6


def register_tiles(registers, lanes):
    """All MR x NR tiles that fit ``registers`` vector registers of ``lanes`` elements.

    Returns a list of (mr, nr) sorted best first: tiles of at least ``MIN_MR`` rows
    first, then most FMAs per load (``MR * NR/lanes`` FMAs against ``MR`` broadcasts
    + ``NR/lanes`` vector loads), ties broken by the larger tile.
    """
    tiles = []
    for nv in range(1, 5):
        mr = (registers - nv - 1) // nv
        mr = min(mr, 16)
        if mr >= 2:
            tiles.append((mr, nv * lanes))
    return sorted(tiles, key=lambda t: (t[0] < MIN_MR, -(t[0] * t[1] / lanes) / (t[0] + t[1] / lanes),
                                        -t[0] * t[1]))


def blocking(dtype=np.float32, *, mr=None, nr=None, kc=None, mc=None, nc=None, machine=None):
    """Block sizes for ``dtype`` on this machine.

    Parameters
    ----------
    dtype : float32 or float64
    mr, nr, kc, mc, nc : int, optional
        Overrides; otherwise ``TILEGEMM_MR`` etc. from the environment, otherwise derived.
    machine : Machine, optional
        Defaults to :func:`tilegemm.tuning.detect`.

    Returns
    -------
    Blocking
    """
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"blocking is defined for float32 and float64, not {dtype}")
    m = machine or detect()
    size = dtype.itemsize
    lanes = m.vector_bits // (8 * size)
    source = {}

    def pick(name, given, derived):
        env = os.environ.get(f"TILEGEMM_{name.upper()}")
        if given is not None:
            source[name] = "keyword"
            value = int(given)
        elif env:
            source[name] = "environment"
            value = int(env)
        else:
            source[name] = "derived"
            value = int(derived())
        if value <= 0:
            raise ValueError(f"{name.upper()} must be positive, got {value}")
        return value

    best = register_tiles(m.vector_registers, lanes)[0]
    mr = pick("mr", mr, lambda: best[0])
    nr = pick("nr", nr, lambda: best[1])
    if nr % lanes:
        raise ValueError(f"NR={nr} must be a multiple of the vector width ({lanes} {dtype.name} lanes)")
    kc = pick("kc", kc, lambda: _round_down(m.l1d_bytes // (nr * size), 8))
    mc = pick("mc", mc, lambda: _round_down(2 * m.l1d_bytes // (kc * size), mr))
    nc = pick("nc", nc, lambda: _round_down(_b_panel_bytes(m) // (kc * size), nr))
    return Blocking(dtype=dtype.name, mr=mr, nr=nr, kc=kc, mc=_round_down(mc, mr),
                    nc=_round_down(nc, nr), lanes=lanes, isa=m.isa, source=source)
