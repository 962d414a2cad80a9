"""Device kernels of the bundled engine: paged attention (PyTorch reference and Triton)."""
