"""vLLM model classes flashnext registers under vLLM's own architecture names.

Split the way :mod:`flashnext.serving.quantization` is: a class here is vLLM's own model with what a
patch adds to it through the model's own extension points (``get_model_state_cls``), registered by
flashnext's vLLM plugin through ``ModelRegistry.register_model``; the decisions (switches, which
layers) stay in the adapters of :mod:`flashnext.serving.hooks`. vLLM's classes are imported when a
class is first asked for, never at plugin load.
"""
