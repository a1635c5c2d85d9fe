"""Winograd F(m x m, r x r) transform matrices, built exactly from interpolation points.

For an output tile of m values and a filter of r taps the 1-D algorithm F(m, r) uses
``alpha = m + r - 1`` interpolation points: ``alpha - 1`` finite ones and infinity.
Its three matrices come from the Cook-Toom construction, the transposed form of
"evaluate, multiply, interpolate" for the product of two polynomials (Lavin and
Gray, *Fast Algorithms for Convolutional Neural Networks*, 2016):

* ``A^T`` (m x alpha): column ``j`` evaluates a degree ``m - 1`` polynomial at point
  ``p_j``, i.e. ``[1, p_j, ..., p_j^(m-1)]``; the column of infinity is ``[0, ..., 0, 1]``.
* ``G`` (alpha x r): row ``j`` is ``[1, p_j, ..., p_j^(r-1)] / f_j`` with
  ``f_j = prod_{k != j} (p_j - p_k)``; the row of infinity is ``[0, ..., 0, 1]``.
* ``B^T`` (alpha x alpha): row ``j`` holds the coefficients (constant first) of
  ``prod_{k != j} (x - p_k)``; the row of infinity those of ``prod_k (x - p_k)``.

Then for an input tile ``d`` (alpha values) ``y = A^T [(G g) * (B^T d)]`` is the
correlation ``y_i = sum_k g_k d_(i+k)``, and in 2-D ``Y = A^T [(G g G^T) * (B^T d B)] A``
(``*`` element-wise).  The matrices are computed in exact rationals
(:class:`fractions.Fraction`) and only then rounded to float64, so every entry is
the nearest double to its exact value (they are small integers and dyadic or
near-dyadic fractions for the points below).

The points decide the float32 error: small integers and their reciprocals keep the
entries of all three matrices close to 1 in magnitude.  ``POINTS`` are the published
choices (Lavin and Gray for F(2,3) and F(4,3); 0, +-1, +-2, +-1/2 for F(6,3), as in
the mobile inference libraries); the errors they give in float32 are measured in
``tests/test_winograd_points.py`` and stated in docs/conv-paths.md.
"""
import functools
from fractions import Fraction

import numpy as np

#: Finite interpolation points (infinity is always added) per output tile size m,
#: for 3-tap filters: m + 1 finite points each.
POINTS = {
    2: (0, 1, -1),
    4: (0, 1, -1, 2, -2),
    6: (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2)),
}


def _poly_mul_linear(coeffs, root):
    """Coefficients (constant first) of ``poly(x) * (x - root)``."""
    out = [Fraction(0)] * (len(coeffs) + 1)
    for i, c in enumerate(coeffs):
        out[i + 1] += c
        out[i] -= root * c
    return out


def _product_coeffs(roots, length):
    """Coefficients of ``prod (x - root)``, padded with zeros to ``length``."""
    coeffs = [Fraction(1)]
    for root in roots:
        coeffs = _poly_mul_linear(coeffs, root)
    return coeffs + [Fraction(0)] * (length - len(coeffs))


@functools.lru_cache(maxsize=None)
def exact_matrices(m, r=3, points=None):
    """``(AT, G, BT)`` of F(m, r) as nested tuples of :class:`fractions.Fraction`.

    ``points`` are the finite interpolation points (``POINTS[m]`` by default; there
    must be ``m + r - 2`` of them, distinct); infinity is the last point.
    """
    if points is None:
        if m not in POINTS or r != 3:
            raise ValueError(f"no default points for F({m}, {r}); pass points=")
        points = POINTS[m]
    pts = [Fraction(p) for p in points]
    alpha = m + r - 1
    if len(pts) != alpha - 1 or len(set(pts)) != len(pts):
        raise ValueError(f"F({m}, {r}) needs {alpha - 1} distinct finite points, got {points}")
    inf_col = [Fraction(0)] * (m - 1) + [Fraction(1)]
    AT = tuple(tuple(p ** i for p in pts) + (inf_col[i],) for i in range(m))
    G = []
    BT = []
    for j, p in enumerate(pts):
        others = pts[:j] + pts[j + 1:]
        f = Fraction(1)
        for q in others:
            f *= p - q
        # The published sets (wincnn's convention): a negative f_0 moves to B^T's
        # first row, so G's first row is positive ([1, 0, 0] for F(2,3) and F(6,3)).
        sign = -1 if j == 0 and f < 0 else 1
        G.append(tuple(p ** k / (f * sign) for k in range(r)))
        BT.append(tuple(sign * c for c in _product_coeffs(others, alpha)))
    G.append(tuple([Fraction(0)] * (r - 1) + [Fraction(1)]))
    BT.append(tuple(_product_coeffs(pts, alpha)))
    return AT, tuple(G), tuple(BT)


def matrices(m, r=3, points=None):
    """``(AT, G, BT)`` of F(m, r) as float64 arrays (shapes m x alpha, alpha x r,
    alpha x alpha), each entry the double nearest its exact value."""
    return tuple(np.array([[float(v) for v in row] for row in mat])
                 for mat in exact_matrices(m, r, None if points is None else tuple(points)))


def correlate_tile(mats, d, g):
    """``A^T [(G g G^T) * (B^T d B)] A`` for one tile, in ``d``'s arithmetic.

    ``mats`` is ``(AT, G, BT)`` (floats or Fractions in object arrays), ``d`` an
    alpha x alpha input tile, ``g`` an r x r filter.  For checks and for the error
    measurements: the library's drivers apply the same matrices in their own loops.
    """
    AT, G, BT = (np.asarray(x) for x in mats)
    U = G @ g @ G.T
    V = BT @ d @ BT.T
    return AT @ (U * V) @ AT.T
