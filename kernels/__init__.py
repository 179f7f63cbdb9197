"""Triton kernels, installed as `ssd_engine.kernels` (pyproject.toml maps this folder there): import
them by that name, never as a top-level `kernels`."""
