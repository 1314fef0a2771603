"""The vLLM patch series as data: the registry (``series``), the probes, and beside them each
patch's diff and prose, which the wheel ships as package data."""
