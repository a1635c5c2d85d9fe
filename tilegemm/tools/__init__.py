"""The tooling around the library: the ``tilegemm`` command line and its benchmarks.

:mod:`~tilegemm.tools.cli` (``python -m tilegemm``) parses the command line;
:mod:`~tilegemm.tools.options` and :mod:`~tilegemm.tools.progress` serve it;
:mod:`~tilegemm.tools.runner` turns ``bench`` options into a plan and runs it over
the suites :mod:`~tilegemm.tools.gemm_suite` and :mod:`~tilegemm.tools.conv_suite`,
which time with the rules of :mod:`~tilegemm.tools.timing` (and
:mod:`~tilegemm.tools.conv_scaling` for 1 thread against several);
:mod:`~tilegemm.tools.report`, :mod:`~tilegemm.tools.compare` and
:mod:`~tilegemm.tools.plots` write, compare and draw the results.  Nothing in the
library imports this package.
"""
