"""flashnext's command lines: thin click layers over the library in ``flashnext.quant``."""
