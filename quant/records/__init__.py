"""The foundation under ``checkpoint/`` and ``formats/``: reading regular files without following a
swap (``inputs``), reading JSON that trusts nothing (``jsonfile``), and the strict record every JSON
file of flashnext's own format is (``strict``). It imports nothing else of flashnext's but
``flashnext.errors``."""
