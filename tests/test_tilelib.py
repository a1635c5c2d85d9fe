"""Tiles compiled once and cached as object code (kernels/tilelib.py), across processes.

A jitted loop calls its tiles by symbol, so a loop loaded from Numba's cache in a
new process must find them registered before it runs: these tests run fresh
processes on one cache folder, including one whose tiles folder was deleted
while the generated modules and Numba's cache of them stayed.
"""
import ast
import glob
import os
import shutil
import subprocess
import sys

import pytest

_SCRIPT = """
import numpy as np, tilegemm as tg
from tilegemm.kernels import tilelib
rng = np.random.default_rng(0)
a = rng.standard_normal((70, 90)).astype(np.float32)
b = rng.standard_normal((90, 130)).astype(np.float32)
c = tg.matmul(a, b)
err = np.abs(c - a.astype(np.float64) @ b).max()
assert err < 1e-3, err
print(sorted(tilelib.compiled()))
"""


_WINOGRAD = """
import numpy as np, tilegemm as tg
from tilegemm.kernels import tilelib
from reference import reference_conv
rng = np.random.default_rng(0)
x = rng.standard_normal((1, 8, 11, 13)).astype(np.float32)
w = rng.standard_normal((5, 8, 3, 3)).astype(np.float32)
ref = reference_conv(x, w, padding=1)
for tile in (2, 4):
    got = tg.conv2d(x, w, padding=1, algorithm="winograd", winograd_tile=tile)
    nhwc = tg.conv2d(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), w, padding=1, layout="NHWC",
                     algorithm="winograd", winograd_tile=tile)
    assert np.abs(got - ref).max() < 1e-3 and np.abs(nhwc.transpose(0, 3, 1, 2) - ref).max() < 1e-3
print(sorted(tilelib.compiled()))
"""


def _run(cache, helper="1", prelude="", script=_SCRIPT):
    env = dict(os.environ, TILEGEMM_CACHE_DIR=str(cache), NUMBA_CACHE_DIR=str(cache / "numba"),
               TILEGEMM_TILE_HELPER=helper)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", prelude + script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _stored(cache):
    return {os.path.basename(p).rsplit("_", 1)[0]
            for p in glob.glob(str(cache / "tiles" / "*" / "*.o"))}


@pytest.mark.parametrize("helper", ["1", "0"])
def test_tiles_compile_once_and_load_in_later_processes(tmp_path, helper):
    first = ast.literal_eval(_run(tmp_path, helper))
    assert first                                # this process compiled its tiles
    assert _run(tmp_path, helper) == "[]"       # the next one loads them all
    if helper == "1":
        # The helper also compiled the other tiles of the template the call imported
        # (the first of them before the caller's, as it takes the latest first).
        assert set(first) < _stored(tmp_path)
    else:
        assert _stored(tmp_path) == set(first)  # only the tiles some loop called


@pytest.mark.parametrize("helper", ["1", "0"])
def test_winograd_transforms_compile_once_as_functions_of_their_own(tmp_path, helper):
    """The four transforms of each tile size are compiled once (by the helper or the
    caller), stored, and loaded by the next process, whose layers give the same results."""
    first = ast.literal_eval(_run(tmp_path, helper, script=_WINOGRAD))
    transforms = {f"tilegemm_float32_winograd{t}_{kind}" for t in (2, 4)
                  for kind in ("input", "output", "input_nhwc", "output_nhwc")}
    stored = {name.rsplit("_l", 1)[0] for name in _stored(tmp_path)}
    assert transforms <= stored
    if helper == "0":
        assert transforms <= {name.rsplit("_l", 1)[0] for name in first}
    assert _run(tmp_path, helper, script=_WINOGRAD) == "[]"


def test_a_helper_that_cannot_start_leaves_the_tiles_to_the_caller(tmp_path):
    # The helper runs as ``sys.executable -m ...``: here a program that exits at once.
    prelude = "import sys; sys.executable = '/bin/false'\n"
    assert ast.literal_eval(_run(tmp_path, prelude=prelude))
    assert _run(tmp_path) == "[]"


def test_deleted_tiles_folder_makes_cached_loops_recompile(tmp_path):
    _run(tmp_path)
    shutil.rmtree(tmp_path / "tiles")
    # Numba's cache of the loops is still there; a loop loaded from it would call
    # tiles nobody registered.  The new tiles epoch rewrites the generated modules.
    assert ast.literal_eval(_run(tmp_path))
    assert _run(tmp_path) == "[]"


_KILL_HELPER = """
import glob, os, signal, threading, time

def kill_helper():
    # The helper is this process's only child: kill it once it is busy with tiles.
    for _ in range(4000):
        kids = [int(p) for f in glob.glob(f"/proc/{os.getpid()}/task/*/children")
                for p in open(f).read().split()]
        if kids:
            time.sleep(0.6)
            for kid in kids:
                os.kill(kid, signal.SIGKILL)
            print("killed", flush=True)
            return
        time.sleep(0.005)

threading.Thread(target=kill_helper, daemon=True).start()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the helper through /proc")
def test_a_helper_killed_midway_leaves_the_rest_to_the_caller(tmp_path):
    env = dict(os.environ, TILEGEMM_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    done = subprocess.run([sys.executable, "-c", _KILL_HELPER + _SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "killed" in done.stdout                      # the helper did start and die
    assert ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert _run(tmp_path) == "[]"


_CONCURRENT_FIRST_CALLS = """
import threading
import numpy as np, tilegemm as tg
rng = np.random.default_rng(1)
a = rng.standard_normal((300, 200)).astype(np.float32)
b = rng.standard_normal((200, 250)).astype(np.float32)
x = rng.standard_normal((1, 16, 20, 20)).astype(np.float32)
w = rng.standard_normal((24, 16, 3, 3)).astype(np.float32)
want_c = a.astype(np.float64) @ b
patches = np.lib.stride_tricks.sliding_window_view(
    np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3))
want_y = np.einsum("nchwij,kcij->nkhw", patches, w)
errors = []

def product():
    for _ in range(3):
        if np.abs(tg.matmul(a, b) - want_c).max() > 1e-3:
            errors.append("matmul")

def convolution():
    for _ in range(3):
        if np.abs(tg.conv2d(x, w, padding=1) - want_y).max() > 1e-3:
            errors.append("conv2d")

threads = [threading.Thread(target=f) for f in (product, convolution, product, convolution)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors)
"""


def test_concurrent_first_calls_on_a_cold_cache(tmp_path):
    """Python threads making their first calls at once, tiles and pool still compiling."""
    env = dict(os.environ, TILEGEMM_CACHE_DIR=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    done = subprocess.run([sys.executable, "-c", _CONCURRENT_FIRST_CALLS], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


_LATER_STORED = """
import subprocess, sys
import numpy as np
from tilegemm.kernels import driver, tilelib
rng = np.random.default_rng(0)
a = rng.standard_normal((200, 150)).astype(np.float32)
b = rng.standard_normal((150, 180)).astype(np.float32)
PRODUCT = "c = np.zeros((200, 180), np.float32); driver.gemm_into(a, b, c, threads=1)"
if sys.argv[1:] == ["child"]:
    exec(PRODUCT)
    sys.exit()
driver.kernel_for(np.float32, 180)  # the template asks for its tiles: none stored yet
# Another process now compiles and stores the tiles, then the loops that call them.
subprocess.run([sys.executable, "-c", SCRIPT, "child"], check=True)
exec(PRODUCT)  # loads those loops from Numba's cache
assert np.abs(c - a.astype(np.float64) @ b).max() < 1e-3
print(sorted(tilelib.compiled()))
"""


def test_loops_another_process_cached_after_this_one_imported(tmp_path):
    """A cached loop names tiles stored after this process asked for them: it must
    find them registered (an unregistered symbol left every external call of the
    loaded object code at address zero: a segfault)."""
    script = f"SCRIPT = {_LATER_STORED!r}\n" + _LATER_STORED
    assert _run(tmp_path, "0", script=script) == "[]"
