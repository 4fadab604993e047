"""The model in memory: the frozen quantized base, adapters, the infer and train paths, tiny models.

``frozen_base`` (load a quantized checkpoint for any format), ``quant_linear`` (plain-torch
int4/fp8 layers), ``adapters`` (LoRA through PEFT, the bottleneck adapter), ``policy`` (the two
paths over one weight set), ``demo_base``/``tiny``/``charset`` (the tiny models and tokenizer the
demo and the tests build by code). The kernels these layers call are in :mod:`orbitctl.kernels`.
"""
