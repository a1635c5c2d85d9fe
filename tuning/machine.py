"""What this CPU is: per-core caches, SIMD ISA, vector width, register count, cores."""
import functools
import math
import os
from dataclasses import dataclass, asdict

_SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"


@dataclass(frozen=True)
class Machine:
    """Facts about the CPU that drive the block sizes and the micro-kernel shape.

    Cache sizes are per core, in bytes.  ``*_source`` fields say where a value came
    from: ``"sysfs"``, ``"cpuinfo"``, ``"default"`` or ``"override"``.
    """

    brand: str
    isa: str            # "avx512", "avx2", or "generic"
    vector_bits: int    # width of one SIMD register
    vector_registers: int
    cores: int
    l1d_bytes: int
    l2_bytes: int
    l3_bytes: int
    clock_hz: float     # nominal (advertised) clock
    fma_units: int      # FMA pipes per core at vector_bits width
    cache_source: str
    isa_source: str

    def as_dict(self):
        return asdict(self)


def _parse_size(text):
    text = text.strip().upper()
    mult = 1
    for suffix, m in (("K", 1024), ("M", 1024 ** 2), ("G", 1024 ** 3)):
        if text.endswith(suffix):
            text, mult = text[:-1], m
    return int(text) * mult


def _sysfs_caches():
    """Per-core data/unified cache sizes by level from sysfs, or None."""
    sizes = {}
    try:
        entries = sorted(os.listdir(_SYSFS_CACHE))
    except OSError:
        return None
    for entry in entries:
        if not entry.startswith("index"):
            continue
        path = os.path.join(_SYSFS_CACHE, entry)
        try:
            with open(os.path.join(path, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(path, "level")) as f:
                level = int(f.read())
            with open(os.path.join(path, "size")) as f:
                size = _parse_size(f.read())
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        sizes[level] = size
    return sizes or None


def _procfs_cpuinfo():
    """Brand, flags and nominal clock from /proc/cpuinfo (Linux), or {}."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and "brand_raw" not in info:
                    info["brand_raw"] = value
                elif key == "flags" and "flags" not in info:
                    info["flags"] = value.split()
                elif key == "cpu MHz" and "mhz" not in info:
                    info["mhz"] = value
                elif not line.strip() and info:
                    break  # the first processor's block is enough
    except OSError:
        return {}
    brand = info.get("brand_raw", "")
    if "@" in brand and brand.rstrip().endswith("GHz"):
        try:
            info["hz_advertised"] = [float(brand.rsplit("@", 1)[1].strip()[:-3]) * 1e9, 0]
        except ValueError:
            pass
    if "hz_advertised" not in info and "mhz" in info:
        # No clock in the brand string (AMD EPYC, many VMs): the kernel's reported clock.
        try:
            info["hz_advertised"] = [float(info["mhz"]) * 1e6, 0]
        except ValueError:
            pass
    return info


@functools.lru_cache(maxsize=1)
def _cpuinfo():
    """CPU brand/flags/clock.  /proc/cpuinfo first: py-cpuinfo starts a subprocess (~1 s)."""
    info = _procfs_cpuinfo()
    if info.get("flags"):
        return info
    try:
        import cpuinfo
        return cpuinfo.get_cpu_info()
    except Exception:  # cpuinfo can fail on exotic platforms; detection falls back
        return {}


def _pycpuinfo_caches(info):
    """py-cpuinfo's dict when it knows the cache sizes (imported only when sysfs has none)."""
    if "l1_data_cache_size" not in info:
        try:
            import cpuinfo
            info = cpuinfo.get_cpu_info()
        except Exception:
            return None
    return info if info.get("l1_data_cache_size") else None


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value else None


@functools.lru_cache(maxsize=1)
def detect():
    """Detect the machine once per process.

    Environment overrides: ``TILEGEMM_L1D``, ``TILEGEMM_L2``, ``TILEGEMM_L3``
    (bytes, per core), ``TILEGEMM_ISA`` (avx512, avx2, generic),
    ``TILEGEMM_CORES``.

    Returns
    -------
    Machine
    """
    info = _cpuinfo()
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    cores = _env_int("TILEGEMM_CORES") or cores

    sysfs = _sysfs_caches()
    if sysfs and 1 in sysfs and 2 in sysfs:
        l1, l2, l3 = sysfs[1], sysfs[2], sysfs.get(3, 0)
        source = "sysfs"
    elif _pycpuinfo_caches(info):
        info = _pycpuinfo_caches(info)
        # py-cpuinfo reports totals over all cores for L1/L2 on Linux.
        n = max(cores, 1)
        l1 = int(info["l1_data_cache_size"]) // n
        l2 = int(info.get("l2_cache_size", 1 << 20)) // n
        l3 = int(info.get("l3_cache_size", 0))
        source = "cpuinfo"
    else:
        l1, l2, l3, source = 32 * 1024, 1 << 20, 8 << 20, "default"
    overrides = [_env_int(n) for n in ("TILEGEMM_L1D", "TILEGEMM_L2", "TILEGEMM_L3")]
    if any(o is not None for o in overrides):
        l1, l2, l3 = (o if o is not None else v for o, v in zip(overrides, (l1, l2, l3)))
        source = "override"

    flags = set(info.get("flags", ()))
    isa_source = "cpu flags"
    if {"avx512f", "avx512vl"} <= flags:
        isa = "avx512"
    elif {"avx2", "fma"} <= flags:
        isa = "avx2"
    else:
        isa = "generic"
    if os.environ.get("TILEGEMM_ISA"):
        isa, isa_source = os.environ["TILEGEMM_ISA"], "override"
        if isa not in ISA_SHAPE:
            raise ValueError(f"TILEGEMM_ISA must be one of {sorted(ISA_SHAPE)}, got {isa!r}")
    bits, regs = ISA_SHAPE[isa]
    hz = (info.get("hz_advertised") or [0])[0] or 2.0e9
    return Machine(
        brand=info.get("brand_raw", "unknown"),
        isa=isa,
        vector_bits=bits,
        vector_registers=regs,
        cores=cores,
        l1d_bytes=l1,
        l2_bytes=l2,
        l3_bytes=l3,
        clock_hz=float(hz),
        fma_units=2 if isa in ("avx512", "avx2") else 1,
        cache_source=source,
        isa_source=isa_source,
    )


#: The kernel's highest frequency of CPU 0 in kHz (the boost clock), where cpufreq exists.
CPUFREQ_MAX = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"


def max_clock(path=CPUFREQ_MAX, pycpuinfo=None):
    """The CPU's highest clock in Hz and where it came from: ``(hz, source)``.

    ``cpufreq``'s ``cpuinfo_max_freq`` (the boost clock) when ``path`` exists; else
    the larger of py-cpuinfo's advertised and actual clocks (``pycpuinfo`` is its
    dict, read when not given), which on a virtual machine without cpufreq is
    usually the base clock again; else :func:`detect`'s nominal clock.

    Returns
    -------
    (float, str)
        Hz and ``"cpufreq max"``, ``"py-cpuinfo"`` or ``"base clock"``.
    """
    try:
        with open(path) as f:
            return int(f.read().strip()) * 1e3, "cpufreq max"
    except (OSError, ValueError):
        pass
    if pycpuinfo is None:
        try:
            import cpuinfo
            pycpuinfo = cpuinfo.get_cpu_info()
        except Exception:  # as in _cpuinfo: detection must not fail on an odd platform
            pycpuinfo = {}
    hz = max([(pycpuinfo.get(k) or [0])[0] for k in ("hz_advertised", "hz_actual")])
    if hz > 0:
        return float(hz), "py-cpuinfo"
    return detect().clock_hz, "base clock"


@functools.lru_cache(maxsize=1)
def host_max_clock():
    """:func:`max_clock` of this host, read once per process (py-cpuinfo takes ~1 s)."""
    return max_clock()


#: ISA -> (vector bits, architectural vector registers).
ISA_SHAPE = {"avx512": (512, 32), "avx2": (256, 16), "generic": (128, 16)}


def l1_alias_period(stride_bytes):
    """Every how many rows ``stride_bytes`` apart the same L1d sets come back.

    An x86 L1d is indexed within a 4 KiB page, so rows ``4096 / gcd(stride, 4096)``
    apart fall on the same sets; with ``l1d_bytes / 4096`` ways, L1 holds at most
    ``l1d_bytes / 4096 * period`` such rows.
    """
    return 4096 // math.gcd(int(stride_bytes), 4096)
