"""Command-line option values: dtype, size, shape and thread lists, checked.

Bad input raises :class:`UsageError`, which the command line prints without a
traceback and turns into exit status 2.
"""
import os
import tempfile


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit status 2."""


# --------------------------------------------------------------------------- option parsing

_DTYPE_ALIASES = {"float32": "float32", "f32": "float32", "single": "float32",
                  "float64": "float64", "f64": "float64", "double": "float64"}


def parse_dtypes(text):
    """``"float32"``, ``"f64"``, ``"all"`` or a comma list -> list of dtype names."""
    if text == "all":
        return ["float32", "float64"]
    out = []
    for item in text.split(","):
        name = _DTYPE_ALIASES.get(item.strip().lower())
        if name is None:
            raise UsageError(f"--dtype: unknown dtype {item!r}; use float32, float64 "
                             "(or f32, f64), a comma list, or all")
        if name not in out:
            out.append(name)
    return out


def _positive_ints(text, option):
    values = []
    for item in text.split(","):
        try:
            value = int(item)
        except ValueError:
            raise UsageError(f"{option}: {item!r} is not an integer "
                             f"(expected a comma list such as 64,128)") from None
        if value <= 0:
            raise UsageError(f"{option}: sizes must be positive, got {value}")
        values.append(value)
    return values


def parse_sizes(text):
    """``"64,128"`` -> [64, 128]."""
    return _positive_ints(text, "--sizes")


def parse_shapes(text):
    """``"2048x64x2048,1x512x512"`` -> [(2048, 64, 2048), (1, 512, 512)] as (m, n, k)."""
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3:
            raise UsageError(f"--shapes: {item!r} is not MxNxK (e.g. 2048x64x2048)")
        shapes.append(tuple(_positive_ints(",".join(parts), "--shapes")))
    return shapes


def parse_threads(text):
    """``"1,2"`` or ``"2"`` -> thread counts, each within what Numba was started with."""
    from tilegemm.tools.timing import max_threads  # imports Numba: only when asked
    counts = _positive_ints(text, "--threads")
    too_many = [t for t in counts if t > max_threads()]
    if too_many:
        raise UsageError(f"--threads: {too_many[0]} is more than the {max_threads()} threads "
                         "available (NUMBA_NUM_THREADS / CPU count)")
    return sorted(set(counts))


def check_out_dir(path):
    """Make sure the report can be written to ``path`` before anything is measured.

    Creates the directory when it does not exist and writes a scratch file into it.

    Raises
    ------
    UsageError
        When ``path`` is an existing file, or the directory cannot be created or
        written to.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out: {path} is a file; give a directory for report.md, "
                         "report.json and the plots")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise UsageError(f"--out: cannot write to {path}: {exc.strerror or exc}") from None
