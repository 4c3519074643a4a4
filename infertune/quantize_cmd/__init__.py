"""`infertune quantize`: offline quantization with calibration into a checkpoint the engine loads directly.

quantize.py runs it (quantize(...) -> QuantizeResult), calibration.py collects activation statistics,
clipping.py chooses weight ranges, checkpoint.py defines the stored format, command.py is the CLI face.
It sits with the tools, above the loader it uses (quant/ sits below the loader).
"""
