"""Types and options every layer shares: the engine's config, sampling parameters, outputs, a request's sequence and a step's batch."""
