"""Plain single-device models. Nothing here imports torch.distributed."""
