"""Kernel registries: every micro-kernel flavour, and the compiled drivers bound to a tile.

* :func:`microkernel`: (dtype, ISA, MR, NR, flavour) -> the micro-kernel intrinsic,
  built once per process; the templates (``kernels/_tile.py``, the convolution's)
  take theirs from it.  :func:`microkernel_specs` lists every one this host can run,
  GEMM and convolution flavours alike, for the kernel tester.
* :func:`get_kernel`: (dtype, MR, NR, ISA) -> a module of compiled code bound to that
  tile, written from ``kernels/_tile.py`` with its configuration block filled in.

A module per configuration keeps MR/NR compile-time constants and gives Numba's
on-disk cache one file per kernel (closures over an intrinsic cannot be cached, and
one file shared by several configurations would mix their cache entries).  Writing
and importing them is :mod:`tilegemm.ground.loader`'s job.
"""
import dataclasses
import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

from tilegemm.ground import loader
from tilegemm.kernels import tilelib
from tilegemm.kernels.microkernel import Flavour, make_microkernel
from tilegemm.tuning.blocking import blocking, register_tiles
from tilegemm.tuning.machine import ISA_SHAPE, detect

_TEMPLATE = os.path.join(os.path.dirname(__file__), "_tile.py")
#: The kernel's companion modules, written from their own templates on first use.
_COMPANIONS = {"shares": "_tile_shares.py", "batch": "_tile_batch.py"}
_lock = threading.RLock()   # loading the shares module loads its kernel's


@dataclass(frozen=True)
class Kernel:
    """A registered micro-kernel and the drivers compiled around it."""

    name: str
    dtype: np.dtype
    mr: int
    nr: int
    lanes: int
    isa: str
    module: object

    @property
    def shares(self):
        """The module of this kernel's native shares (``kernels/_tile_shares.py``),
        written and imported on first use, then kept on the kernel (every threaded
        call asks for it)."""
        return self._companion("shares")

    @property
    def batches(self):
        """The module of this kernel's batched products (``kernels/_tile_batch.py``),
        written and imported on first use, then kept on the kernel."""
        return self._companion("batch")

    def _companion(self, part):
        # One lock for every companion (not cached_property's own lock per property,
        # which Python 3.11 holds while computing): loading the shares module loads
        # the batch module, and two threads taking the two locks in opposite orders
        # would wait for each other forever.
        module = self.__dict__.get(part)
        if module is None:
            with _lock:
                module = _load_companion(part, self.dtype.name, self.mr, self.nr, self.isa)
            self.__dict__[part] = module       # frozen dataclass: its dict, as a cache
        return module

    @property
    def no_bias(self):
        """A zero bias the kernels may be handed when there is none (never read then)."""
        return self.module.NO_BIAS


def kernel_name(dtype, mr, nr, isa):
    """``{dtype}_gemm_{MR}x{NR}_{isa}``, e.g. ``f32_gemm_6x64_avx512``."""
    return f"f{np.dtype(dtype).itemsize * 8}_gemm_{mr}x{nr}_{isa}"


def lanes_of(isa, dtype):
    """Elements of ``dtype`` in one vector register of ``isa``."""
    return ISA_SHAPE[isa][0] // (8 * np.dtype(dtype).itemsize)


def runnable_isas():
    """The ISAs whose kernels this host runs: the detected one (``TILEGEMM_ISA`` if
    forced) and every narrower one, widest first."""
    order = sorted(ISA_SHAPE, key=lambda isa: -ISA_SHAPE[isa][0])
    return tuple(order[order.index(detect().isa):])


@functools.lru_cache(maxsize=None)
def _microkernel(dtype_name, isa, mr, nr, flavour, a_step):
    return make_microkernel(np.dtype(dtype_name).type, mr, nr, lanes_of(isa, dtype_name),
                            flavour, a_step=a_step)


def microkernel(dtype, isa, mr, nr, flavour=Flavour.PACKED, a_step=None):
    """The micro-kernel intrinsic for ``(dtype, isa, mr, nr, flavour)``, built once.

    Parameters
    ----------
    dtype : float32 or float64
    isa : str
        ``"avx512"``, ``"avx2"`` or ``"generic"``: sets the vector width.
    mr, nr : int
        Register tile; ``nr`` a multiple of the ISA's lanes.
    flavour : Flavour
    a_step : int, optional
        ``Flavour.TAPS`` only: values per k of A's packed panels (default ``mr``).

    Returns
    -------
    numba intrinsic, callable from jitted code only (arguments:
    ``microkernel.ARGUMENTS[flavour]``).
    """
    a_step = None if a_step is None or a_step == mr else int(a_step)
    return _microkernel(np.dtype(dtype).name, isa, int(mr), int(nr), Flavour(flavour), a_step)


@dataclass(frozen=True)
class MicrokernelSpec:
    """One registrable micro-kernel: the key :func:`microkernel` builds it from."""

    dtype: np.dtype
    isa: str
    mr: int
    nr: int
    flavour: Flavour
    a_step: int = None

    @property
    def lanes(self):
        return lanes_of(self.isa, self.dtype)

    @property
    def name(self):
        """``{dtype}_{flavour}_{MR}x{NR}[_a{step}]_{isa}``, e.g. ``f32_packed_6x64_avx512``."""
        step = f"_a{self.a_step}" if self.a_step else ""
        return (f"f{self.dtype.itemsize * 8}_{self.flavour.value}_{self.mr}x{self.nr}{step}"
                f"_{self.isa}")

    def build(self):
        """The intrinsic (see :func:`microkernel`)."""
        return microkernel(self.dtype, self.isa, self.mr, self.nr, self.flavour, self.a_step)


#: The flavours the GEMM drivers run (``kernels/_tile.py``), on every register tile.
GEMM_FLAVOURS = (Flavour.PACKED, Flavour.EDGE, Flavour.STRIDED, Flavour.STRIDED_EDGE)


def isa_machine(isa):
    """This machine as seen by kernels of ``isa`` (its vector width and register count)."""
    bits, regs = ISA_SHAPE[isa]
    return dataclasses.replace(detect(), isa=isa, vector_bits=bits, vector_registers=regs)


def microkernel_specs(isas=None, dtypes=(np.float32, np.float64), all_tiles=False):
    """Every micro-kernel the engine builds for ``isas`` (default: :func:`runnable_isas`).

    Per ISA and dtype: the GEMM flavours on the blocking's tile (on every register
    tile with ``all_tiles``, as the driver picks narrower ones for narrow products),
    and the convolution's on the same tile: the rows flavours, taps, taps one vector
    wide, taps of 4 and 2 rows over panels packed ``MR`` rows high
    (``conv/_tile_rows.py``, ``conv/_tile_taps.py``), and strided one vector wide
    (``conv/_tile_winograd.py``).

    Returns
    -------
    list of MicrokernelSpec
    """
    out = []
    for isa in isas or runnable_isas():
        regs = ISA_SHAPE[isa][1]
        for dtype in map(np.dtype, dtypes):
            lanes = lanes_of(isa, dtype)
            mr, nr = _default_tile(dtype, isa)
            tiles = register_tiles(regs, lanes) if all_tiles else [(mr, nr)]
            out += [MicrokernelSpec(dtype, isa, t_mr, t_nr, f) for t_mr, t_nr in tiles
                    for f in GEMM_FLAVOURS]
            out += [MicrokernelSpec(dtype, isa, mr, nr, f) for f in Flavour
                    if f not in GEMM_FLAVOURS]
            out.append(MicrokernelSpec(dtype, isa, mr, lanes, Flavour.TAPS))
            # One vector wide over packed panels: Winograd NCHW's last column panel.
            out += [MicrokernelSpec(dtype, isa, t_mr, lanes, Flavour.STRIDED)
                    for t_mr, t_nr in tiles if t_nr > lanes]
            out += [MicrokernelSpec(dtype, isa, rows, nr, Flavour.TAPS, a_step=mr)
                    for rows in (4, 2) if mr > rows]
    return list(dict.fromkeys(out))


def _default_tile(dtype, isa):
    """The blocking's tile for ``isa``; the ISA's best tile where a tile forced through
    the environment (``TILEGEMM_MR`` / ``TILEGEMM_NR``) does not fit its vectors."""
    try:
        blk = blocking(dtype, machine=isa_machine(isa))
        return blk.mr, blk.nr
    except ValueError:
        return register_tiles(ISA_SHAPE[isa][1], lanes_of(isa, dtype))[0]


@functools.lru_cache(maxsize=None)
def _load(dtype_name, mr, nr, isa):
    lanes = lanes_of(isa, dtype_name)
    if nr % lanes:
        raise ValueError(f"NR={nr} is not a multiple of the {isa} vector width ({lanes} lanes)")
    name = kernel_name(dtype_name, mr, nr, isa)
    config = [f"DTYPE = np.{np.dtype(dtype_name).name}", f"MR = {mr}", f"NR = {nr}",
              f"LANES = {lanes}", f"ISA = {isa!r}"]
    header = ("# Generated by tilegemm.kernels.registry from kernels/_tile.py; do not edit.\n"
              + tilelib.header())
    module = loader.load_generated(f"{name}_{tilelib.engine_digest()}",
                                   loader.configured(_TEMPLATE, config, header))
    return Kernel(name, np.dtype(dtype_name), mr, nr, lanes, isa, module)


@functools.lru_cache(maxsize=None)
def _load_companion(part, dtype_name, mr, nr, isa):
    template = _COMPANIONS[part]
    config = [f"DTYPE = np.{np.dtype(dtype_name).name}", f"MR = {mr}", f"NR = {nr}",
              f"ISA = {isa!r}"]
    header = (f"# Generated by tilegemm.kernels.registry from kernels/{template}; "
              "do not edit.\n" + tilelib.header())
    name = f"{kernel_name(dtype_name, mr, nr, isa)}_{part}_{tilelib.engine_digest()}"
    path = os.path.join(os.path.dirname(__file__), template)
    return loader.load_generated(name, loader.configured(path, config, header))


def get_kernel(dtype, mr=None, nr=None, isa=None):
    """The kernel for ``dtype`` (default shape from :func:`tilegemm.tuning.blocking`).

    Parameters
    ----------
    dtype : float32 or float64
    mr, nr : int, optional
        Register tile; defaults to the blocking's.
    isa : str, optional
        ``"avx512"``, ``"avx2"`` or ``"generic"``; defaults to the detected ISA.

    Returns
    -------
    Kernel
    """
    dtype = np.dtype(dtype)
    if mr is None or nr is None:
        blk = blocking(dtype)
        mr, nr = mr or blk.mr, nr or blk.nr
    isa = isa or detect().isa
    with _lock:  # one thread writes and imports a module; the others wait for it
        return _load(dtype.name, int(mr), int(nr), isa)


def registered_kernels():
    """Every (dtype, MR, NR, ISA) the driver may pick on this machine: all register tiles.

    The widest tile serves general products; narrower ones serve products with
    fewer columns than its NR (see ``kernels.driver.kernel_for``).
    """
    isa = detect().isa
    bits, regs = ISA_SHAPE[isa]
    out = []
    for dtype in (np.float32, np.float64):
        lanes = bits // (8 * np.dtype(dtype).itemsize)
        for mr, nr in register_tiles(regs, lanes):
            out.append((np.dtype(dtype), mr, nr, isa))
    return out
