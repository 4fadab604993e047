"""Quantized storage of the frozen base: formats, the streaming converter, the quality report.

The public entry points are :func:`orbitctl.quant.convert.quantize_checkpoint` and
:func:`orbitctl.quant.manifest.verify_output`; importing this package imports no torch.
"""
