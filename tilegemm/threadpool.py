"""tilegemm's thread limit as threadpoolctl sees it.

threadpoolctl (``threadpool_limits``, ``threadpool_info``) finds the libraries it
controls among the shared libraries loaded in the process, by file name.  tilegemm's
threads are Python threads running Numba-compiled code, so the controller anchors
itself on Numba's helper library (``numba/_helperlib``), which is loaded whenever
tilegemm is; its ``filepath`` in ``threadpool_info()`` is that library's.  Limits
set through threadpoolctl are the process-wide limit of
:func:`tilegemm.set_num_threads`.  Registered when tilegemm is imported and
threadpoolctl is installed (it is never required).
"""
import importlib.util

from tilegemm.ground import threads

#: The ``user_api`` and ``internal_api`` under which threadpoolctl lists tilegemm:
#: ``threadpool_limits(1)`` limits it, ``threadpool_limits(1, user_api="blas")`` does not.
API = "tilegemm"


def _controller_class(version):
    import threadpoolctl

    class TilegemmController(threadpoolctl.LibController):
        """threadpoolctl's handle on :func:`tilegemm.set_num_threads`."""

        user_api = API
        internal_api = API
        filename_prefixes = ("_helperlib",)

        def get_num_threads(self):
            return threads.process_limit()

        def set_num_threads(self, num_threads):
            # threadpoolctl passes any positive count: more than there can be means all.
            threads.set_num_threads(max(1, min(int(num_threads), threads.max_threads())))

        def get_version(self):
            return version

        def set_additional_attributes(self):
            self.threading_layer = "Python threads over nogil kernels"

    return TilegemmController


def register(version):
    """Register the controller (reporting ``version``) with threadpoolctl, if it is
    installed; returns the class or None."""
    if importlib.util.find_spec("threadpoolctl") is None:
        return None
    import threadpoolctl
    if not hasattr(threadpoolctl, "register"):      # before threadpoolctl 3.2
        return None
    cls = _controller_class(version)
    threadpoolctl.register(cls)
    return cls
