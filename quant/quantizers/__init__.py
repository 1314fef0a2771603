"""Quantizers: how weights become integer codes and scales."""
