"""Decided before the engine is built: `auto` mode's measured costs, predictions and choice."""
