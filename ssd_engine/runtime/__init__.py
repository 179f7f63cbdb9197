"""Runs a model on its device: the model runner, paged KV blocks, CUDA graphs, the draft's weight format."""
