"""References the tests compare tilegemm with, written from the definitions (float64,
or float32 where the definition is float32 steps)."""
import numpy as np


def reference_conv(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, activation=None):
    """float64 direct convolution of an NCHW input, written from the definition.

    ``padding`` is an int, a pair or a (top, bottom, left, right) tuple.
    """
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    sy, sx = (stride, stride) if np.isscalar(stride) else stride
    dy, dx = (dilation, dilation) if np.isscalar(dilation) else dilation
    if np.isscalar(padding):
        padding = (padding,) * 4
    elif len(padding) == 2:
        padding = (padding[0], padding[0], padding[1], padding[1])
    top, bottom, left, right = padding
    N, C, H, W = x.shape
    K, Cg, kh, kw = w.shape
    Kg = K // groups
    xp = np.zeros((N, C, H + top + bottom, W + left + right))
    xp[:, :, top:top + H, left:left + W] = x
    Ho = (H + top + bottom - dy * (kh - 1) - 1) // sy + 1
    Wo = (W + left + right - dx * (kw - 1) - 1) // sx + 1
    out = np.zeros((N, K, Ho, Wo))
    for g in range(groups):
        xg = xp[:, g * Cg:(g + 1) * Cg]
        wg = w[g * Kg:(g + 1) * Kg]
        for i in range(kh):
            for j in range(kw):
                patch = xg[:, :, i * dy:i * dy + sy * (Ho - 1) + 1:sy,
                           j * dx:j * dx + sx * (Wo - 1) + 1:sx]
                out[:, g * Kg:(g + 1) * Kg] += np.einsum("nchw,kc->nkhw", patch, wg[:, :, i, j])
    if b is not None:
        out += np.asarray(b, np.float64).reshape(1, -1, 1, 1)
    return reference_activation(out, activation)


def reference_activation(y, activation):
    """``y`` through None, "relu" or "relu6"; NaN stays NaN."""
    if activation in ("relu", "relu6"):
        y = np.where(y < 0, 0, y)
    if activation == "relu6":
        y = np.where(y > 6, 6, y)
    return y


def qdq_sum(codes, residual, conv_quant, s):
    """ONNX's DequantizeLinear of a conv's codes (``conv_quant = (scale, zero point)``)
    and of a residual's, Add (in the model's operand order), [Relu], QuantizeLinear,
    as numpy float32 computes them: what a residual sum
    (:class:`tilegemm.conv.qconv.QuantizedSum` ``s``) fused into a conv must equal bit for bit."""
    def dq(q, scale, zero):
        return (q.astype(np.float32) - np.float32(zero)) * np.float32(scale)
    mine, other = dq(codes, *conv_quant), dq(residual, s.scale, s.zero_point)
    y = mine + other if s.conv_first else other + mine
    if s.activation == "relu":
        y = np.maximum(y, np.float32(0))
    info = np.iinfo(np.asarray(s.out_zero_point).dtype)
    q = np.rint(y / np.float32(s.out_scale)) + np.float32(s.out_zero_point)
    return np.clip(q, info.min, info.max).astype(info.dtype)
