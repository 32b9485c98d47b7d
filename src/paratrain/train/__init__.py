"""The training loop and what it needs: data, optimizer and schedule, run directory."""
