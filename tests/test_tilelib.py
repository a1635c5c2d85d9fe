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


def _run(cache, helper="1", prelude=""):
    env = dict(os.environ, TILEGEMM_CACHE_DIR=str(cache), NUMBA_CACHE_DIR=str(cache / "numba"),
               TILEGEMM_TILE_HELPER=helper)
    done = subprocess.run([sys.executable, "-c", prelude + _SCRIPT], env=env,
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
        # The helper also compiled the other tiles of the templates the call imported.
        assert set(first) <= _stored(tmp_path)
    else:
        assert _stored(tmp_path) == set(first)  # only the tiles some loop called


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
