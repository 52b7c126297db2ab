"""Layer 6: thin adapters (CLI, Orbax) that translate and let the engine work."""
