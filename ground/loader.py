"""Generated modules: written once per configuration, imported, cached by Numba.

The kernel registry and the convolution engine both compile templates with a
configuration block filled in (MR, NR, dtype, ISA as compile-time constants).
Each generated file is named with a digest of the sources it compiles in, so two
versions of tilegemm (two checkouts, an upgrade) never share a file, and a file is
rewritten only when its text changes, so Numba's on-disk cache stays valid.
Files go to ``TILEGEMM_CACHE_DIR`` (default ``~/.cache/tilegemm``).
"""
import hashlib
import importlib.util
import os
import re
import sys
import tempfile

from tilegemm.ground import linking

CONFIG = re.compile(r"# --- configuration ---\n.*?# --- end configuration ---\n", re.S)


def cache_dir():
    """Where generated modules (and Numba's cache of them) live."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "tilegemm")
    return os.environ.get("TILEGEMM_CACHE_DIR", default)


def digest(paths):
    """A short hash of the contents of ``paths`` (in the order given)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def python_files(folder):
    """The ``.py`` files of ``folder``, sorted (for :func:`digest`)."""
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]


def configured(template_path, config_lines, header):
    """The template's text with its configuration block replaced by ``config_lines``."""
    with open(template_path) as f:
        template = f.read()
    block = "# --- configuration ---\n" + "".join(line + "\n" for line in config_lines)
    block += "# --- end configuration ---\n"
    if not CONFIG.search(template):
        raise ValueError(f"{template_path} has no configuration block")
    return header + CONFIG.sub(lambda _: block, template, count=1)


def write_if_changed(path, text):
    """Write ``text`` to ``path`` atomically unless the file already holds it."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    write_atomic(path, text.encode())


def write_atomic(path, data):
    """Write the bytes ``data`` to ``path`` so that no process ever sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_first(path, data):
    """Create ``path`` holding ``data`` unless it exists: of racing processes, the first wins."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    try:
        os.link(tmp, path)  # fails if the file exists; never shows half a file
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def load_generated(name, text):
    """Write ``text`` as ``<cache>/kernels/<name>.py`` (if changed) and import it.

    The caller serialises calls per name (both callers cache the result)."""
    path = os.path.join(cache_dir(), "kernels", name + ".py")
    write_if_changed(path, text)
    spec = importlib.util.spec_from_file_location(f"tilegemm._generated.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    linking.guard_plain_caches(vars(module))
    return module
