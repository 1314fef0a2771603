"""The flashnext library: formats, quantizers, packing, checkpoint overlays."""
