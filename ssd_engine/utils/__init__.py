"""Leaf helpers with no engine knowledge: the machine, memory, progress bars, host-to-device uploads, kernel-launch hooks."""
