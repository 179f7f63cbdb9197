"""Tensor-parallel ranks over the runtime: the executor on rank 0, workers, launch."""
