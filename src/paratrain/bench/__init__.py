"""Benchmarks run as commands (`paratrain bench X`), never as timed tests."""
