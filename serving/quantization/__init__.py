"""vLLM quantization methods for the weight formats flashnext serves and vLLM 0.34.0 does not.

Split the way vLLM splits ``layers/quantization/`` from its model files: a method here knows a
weight format (its parameters, how it loads, which kernel multiplies by it) and nothing about
which layer gets it; the patches' adapters in :mod:`flashnext.serving.hooks` decide that, per
switch and per checkpoint. vLLM's base classes are fetched when a method class is first imported
(:mod:`flashnext.serving.quantization.vllm_bases`), which only a patched vLLM does: the command lines
never import vLLM.
"""
