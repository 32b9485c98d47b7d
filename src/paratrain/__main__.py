"""`python -m paratrain ...`: the form that `torchrun -m paratrain train ...` uses."""

from paratrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
