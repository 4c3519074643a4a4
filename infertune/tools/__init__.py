"""Tools that sit above the engine (layer 7). Here: `infertune quantize`, offline quantization with calibration
into a checkpoint the engine loads directly.

quantize.py is the CLI face, quantizer.py runs it (quantize(...) -> QuantizeResult), calibration.py collects
activation statistics, weight_clipping.py chooses weight ranges, quant_format.py defines the stored format.
They sit above the loader they use (quant/ sits below it).
"""
