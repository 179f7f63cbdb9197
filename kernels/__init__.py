"""Triton kernels, installed as `ssd_engine.kernels`: import them by that name, not as `kernels`."""
