"""Multi-process runtime: tensor-parallel ranks (gloo on CPU, NCCL on CUDA), placement, launch."""
