"""The quantized formats and the checkpoint files they live in, below both the model and the conversion job.

``formats`` (nf4/fp4 through bitsandbytes' codes in ``bnb4``, group-wise int4, block fp8),
``qconfig`` (the ``quantization_config`` a quantized checkpoint carries), ``safetensors_io``
(streaming reads and shard writes), ``source`` (a Hugging Face checkpoint opened tensor by tensor)
and ``targets`` (which weights a format quantizes). Imports neither :mod:`orbitctl.model` nor the
conversion job in :mod:`orbitctl.quant`.
"""
