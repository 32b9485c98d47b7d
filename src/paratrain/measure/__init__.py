"""Measurements of what the runtime does: activations, timelines."""
