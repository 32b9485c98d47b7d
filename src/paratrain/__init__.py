"""paratrain: parallel training of plain PyTorch models, measured against theory."""

__version__ = "0.1.0"
