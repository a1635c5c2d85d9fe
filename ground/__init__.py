"""Ground contracts every tilegemm component builds on; this package imports none of them.

* :mod:`tilegemm.ground.contracts` -- JIT options, epilogue codes, ``cdiv``/``round_up``.
* :mod:`tilegemm.ground.validate` -- input checks shared by the public faces (dtypes,
  arrays, ``out=``, scalars, flags, choices, thread counts).
* :mod:`tilegemm.ground.loader` -- writing and importing generated modules, keyed by a
  digest of the sources they compile in.
* :mod:`tilegemm.ground.workspace` -- aligned arrays and per-thread scratch buffers.
* :mod:`tilegemm.ground.validate` -- the input checks of the public functions.
"""
