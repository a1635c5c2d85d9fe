"""torch tensors and other array-likes through matmul, gemm, conv2d and ConvWeights."""
import numpy as np
import pytest

import tilegemm
from tilegemm.ground.interop import numpy_view

torch = pytest.importorskip("torch")


def _close(got, expected, tol=1e-5):
    assert isinstance(got, torch.Tensor), type(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sa, sb", [((5, 7), (7, 3)), ((7,), (7, 4)), ((6, 7), (7,)), ((7,), (7,)),
                                    ((3, 5, 7), (7, 2)), ((2, 1, 5, 7), (3, 7, 4))])
def test_matmul_tensors_in_tensors_out(dtype, sa, sb):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(sa, generator=g, dtype=dtype), torch.randn(sb, generator=g, dtype=dtype)
    _close(tilegemm.matmul(a, b), torch.matmul(a, b))
    _close(tilegemm.matmul(a.numpy(), b), torch.matmul(a, b))        # one tensor is enough


def test_strided_tensors_are_read_in_place():
    a = torch.randn(9, 8)[::2, 1:].t()           # non-contiguous, transposed
    b = torch.randn(5, 6)
    view = numpy_view(a, "a", "f")
    assert np.shares_memory(view, a.numpy()) and view.strides == tuple(
        s * a.element_size() for s in a.stride())
    _close(tilegemm.matmul(a, b), a @ b)


def test_out_and_gemm_c_are_written_in_place():
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    out = torch.full((4, 3), float("nan"))
    assert tilegemm.matmul(a, b, out=out) is out
    _close(out, a @ b)
    c = torch.ones(4, 3)
    assert tilegemm.gemm(a, b, c, alpha=2.0, beta=-1.0) is c
    _close(c, 2 * (a @ b) - 1)
    _close(tilegemm.gemm(a, b.t(), trans_b=True), a @ b)


def test_conv2d_and_conv_weights_match_torch_under_no_grad():
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
    x = torch.randn(2, 3, 11, 11)
    with torch.no_grad():
        expected = torch.relu(layer(x))
        _close(tilegemm.conv2d(x, layer.weight, layer.bias, 2, 1, activation="relu"), expected)
        weights = tilegemm.ConvWeights(layer.weight)
        _close(tilegemm.conv2d(x, weights, layer.bias, 2, 1, activation="relu"), expected)
    with torch.inference_mode():
        _close(tilegemm.conv2d(x, layer.weight, layer.bias, 2, 1, activation="relu"), expected)


def test_conv2d_residual_summed_into_a_tensor_out():
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(4, 4, 3, padding=1)
    x, skip = torch.randn(1, 4, 6, 6), torch.randn(1, 4, 6, 6)
    with torch.no_grad():
        expected = torch.relu(layer(x) + skip)
        out = skip.clone()
        got = tilegemm.conv2d(x, layer.weight, layer.bias, 1, 1, activation="relu",
                              residual=out, out=out)
    assert got is out
    _close(out, expected)


def test_tensors_tilegemm_cannot_serve_get_clear_errors():
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="requires grad.*no_grad"):
        tilegemm.matmul(torch.randn(2, 4), layer.weight)
    with pytest.raises(TypeError, match="requires grad"):
        tilegemm.conv2d(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 3, requires_grad=True))
    with pytest.raises(TypeError, match="bfloat16"):
        tilegemm.matmul(torch.randn(2, 2, dtype=torch.bfloat16), torch.randn(2, 2))
    with pytest.raises(TypeError, match="dtype int64"):
        tilegemm.matmul(torch.ones(2, 2, dtype=torch.int64), torch.ones(2, 2))
    with pytest.raises(ValueError, match="not aligned"):
        tilegemm.matmul(torch.randn(2, 3), torch.randn(2, 3))


def test_array_likes_in_give_ndarrays_out():
    class Wrapped:
        def __init__(self, x):
            self.x = x

        def __array__(self, dtype=None, copy=None):
            return self.x

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = tilegemm.matmul(Wrapped(a), [[1.0], [2.0], [3.0]])
    assert type(got) is np.ndarray and np.allclose(got, a @ [[1.0], [2.0], [3.0]])


def test_a_negated_view_is_read_but_never_written_through():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    neg = a._neg_view() if hasattr(a, "_neg_view") else None
    if neg is None or not neg.is_neg():
        pytest.skip("this torch has no lazily negated views")
    _close(tilegemm.matmul(neg, b), -(a @ b))
    with pytest.raises(TypeError, match="negated"):
        tilegemm.matmul(a, b, out=torch.zeros(5, 3).t()._neg_view())
