"""What Transformer Engine's kernels allocate and save, for the engine to count (README.md)."""
