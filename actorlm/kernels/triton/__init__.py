"""The GPU wing: Triton kernels (CPU-tested under ``TRITON_INTERPRET=1``)."""
