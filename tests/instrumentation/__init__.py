"""What the tests count and check while the engine runs on CPU, standing in for a GPU's costs and
failures: aten ops per step (op_count), device-to-host syncs (sync_count, step_count), device
placement (placement), and emulated CUDA graphs' fidelity to a capture (graph_fidelity)."""
