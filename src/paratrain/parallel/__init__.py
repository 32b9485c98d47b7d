"""Functions that make a plain model parallel, each taking one group from the Mesh."""
