"""flashnext: checkpoint overlays and serving for Qwen3.8-Flash-Next on small rigs.

The library lives in ``flashnext.quant`` (folder ``quant/``), the command lines in
``flashnext.tools`` (folder ``tools/``) and the serving pieces in ``flashnext.serving``
(folder ``serving/``).
"""

__version__ = "0.1.0"
