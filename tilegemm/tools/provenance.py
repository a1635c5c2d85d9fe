"""Where a result comes from: the package version and the git commit of its source.

Reports record both, and ``tilegemm --version`` prints them, so a figure can be
traced back to the code that produced it.
"""
import os
import subprocess

import tilegemm

#: The checkout holding this package (when it is installed from one, e.g. ``pip install -e``).
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tilegemm.__file__)))


def _git(root, *args):
    proc = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          timeout=10)
    if proc.returncode != 0:
        raise OSError(proc.stderr.strip())
    return proc.stdout.strip()


def source_commit(root=SOURCE_ROOT):
    """The git commit of the checkout at ``root``.

    Parameters
    ----------
    root : str
        The folder whose checkout to ask about; by default the one this package
        was imported from.

    Returns
    -------
    dict or None
        ``{"commit": short hash, "dirty": bool}``, where ``dirty`` says that tracked
        files have uncommitted changes (untracked files, such as a report written
        into the tree, do not count, as with ``git describe --dirty``); None when
        ``root`` is not the top of a git checkout or git is not installed.
    """
    try:
        top = _git(root, "rev-parse", "--show-toplevel")
        # A package installed into some other repository's tree is not that repository's code.
        if os.path.realpath(top) != os.path.realpath(root):
            return None
        commit = _git(root, "rev-parse", "--short", "HEAD")
        changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(changes)}


def commit_text(source):
    """``"abc1234"``, ``"abc1234+dirty"`` or ``"unknown"`` for :func:`source_commit`'s result."""
    if not source:
        return "unknown"
    return source["commit"] + ("+dirty" if source["dirty"] else "")


def version_text(root=SOURCE_ROOT):
    """What ``tilegemm --version`` prints: ``tilegemm 0.2.0 (commit abc1234+dirty)``."""
    return f"tilegemm {tilegemm.__version__} (commit {commit_text(source_commit(root))})"
