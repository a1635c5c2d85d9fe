"""A float ONNX model quantized to int8 as users quantize theirs: onnxruntime's
``quant_pre_process`` (BatchNorm folded into the convs) then ``quantize_static`` in
QDQ form, uint8 activations and int8 weights per output channel, calibrated on
random inputs.  For ``python -m tilegemm run MODEL --int8``; onnxruntime is the
quantizer here, so it is needed (it is an optional extra, never a dependency).
"""
import logging
import os
import tempfile

import numpy as np


def quantize_model(proto, input_shape, calibration=8, seed=0, reduce_range=False):
    """The QDQ-quantized ``onnx.ModelProto`` of float model ``proto``.

    Parameters
    ----------
    proto : onnx.ModelProto
        One float32 input.
    input_shape : tuple of int
        The calibration inputs' shape.
    calibration : int
        Random standard-normal inputs the activation ranges are calibrated on.
    seed : int
    reduce_range : bool
        Weights in 7 bits ([-64, 64]), onnxruntime's advice for hosts without VNNI: on
        AVX2 both onnxruntime's ``vpmaddubsw`` and tilegemm's ``maddubs`` kernel then
        sum them exactly.

    Raises
    ------
    ImportError
        Without onnxruntime.
    """
    try:
        import onnx
        from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                              quantize_static)
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError as err:
        raise ImportError("--int8 quantizes the model with onnxruntime: "
                          "pip install 'tilegemm[onnx]'") from err
    name = proto.graph.input[0].name
    rng = np.random.default_rng(seed)
    batches = [{name: rng.standard_normal(input_shape).astype(np.float32)}
               for _ in range(calibration)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(batches)

        def get_next(self):
            return next(self.feeds, None)

    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)     # its advice on pre-processing, axes
    try:
        with tempfile.TemporaryDirectory() as folder:
            paths = [os.path.join(folder, f) for f in ("float.onnx", "pre.onnx", "int8.onnx")]
            onnx.save(proto, paths[0])
            quant_pre_process(paths[0], paths[1], skip_symbolic_shape=True)
            quantize_static(paths[1], paths[2], Reader(), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            per_channel=True, reduce_range=reduce_range)
            return onnx.load(paths[2])
    finally:
        logging.getLogger().setLevel(quiet)


def is_quantized(proto):
    """Whether ``proto`` holds quantization operators."""
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear", "QLinearConv",
                             "QLinearMatMul", "ConvInteger", "MatMulInteger")
               for n in proto.graph.node)
