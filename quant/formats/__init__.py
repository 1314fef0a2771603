"""On-disk formats: safetensors files, compressed-tensors packing and config documents, and the INT6
bit-plane layout."""
