"""GPU kernels (Triton) that the serving patches call."""
