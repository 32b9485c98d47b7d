"""A layout predicted beyond this machine's memory is refused before any worker starts,
with the figures (issue 30): `--seq-len 100000` passed --dry-run predicting 12.8 TB of
activations per rank, then sat in step 1."""

from __future__ import annotations

from paratrain.cli import main
from paratrain.train.fits import fits_refusal

GB = 1e9


def test_terabytes_of_activations_are_refused_at_dry_run(capsys):
    argv = ["train", "--seq-len", "100000", "--max-seq-len", "100000", "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "activations 12.83 TB, predicted" in err and "available memory" in err
    assert "--seq-len" in err and len(err.strip().splitlines()) == 1


def test_the_rule_per_gpu_and_for_a_shared_host():
    ranks = [(1 * GB, 3 * GB), (1 * GB, 2 * GB)]
    assert fits_refusal(ranks, 4 * GB, shared=False, where="its GPU's memory") is None
    said = fits_refusal(ranks, 3.5 * GB, shared=False, where="its GPU's memory")
    assert said.startswith("rank 0 needs 4.00 GB (model state 1.00 GB + activations 3.00 GB")
    assert fits_refusal(ranks, 7 * GB, shared=True, where="this host") is None
    said = fits_refusal(ranks, 6.9 * GB, shared=True, where="this host")
    assert said.startswith("2 ranks need 7.00 GB together") and "this host of 6.90 GB" in said
