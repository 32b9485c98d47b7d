"""Data loading: the embedded default, text files, folders, .bin token files, the sampler."""

from __future__ import annotations

import pytest
import torch

from paratrain.data.tokens import BatchSampler, load_tokens, validation_batches


def test_default_data_is_the_stdlib_split_by_file():
    data = load_tokens("")
    assert data.vocab_size == 256
    assert len(data.train) > 1_000_000 and len(data.val) > 10_000
    assert 0.01 < len(data.val) / (len(data.train) + len(data.val)) < 0.15
    assert data.train.dtype == torch.uint8
    again = load_tokens("")
    assert again.fingerprint == data.fingerprint and torch.equal(again.val, data.val)


def test_text_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 40)
    data = load_tokens(str(path), val_fraction=0.1)
    assert len(data.val) == 1024 and len(data.train) == 9216
    assert data.val.tolist() == list(range(256)) * 4


def test_folder_is_split_by_file(tmp_path):
    for i in range(60):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i}\n" * 20)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 10)  # not a text suffix
    data = load_tokens(str(tmp_path), val_fraction=0.2)
    total = len(data.train) + len(data.val)
    assert total == sum(len(f"file {i}\n") * 20 for i in range(60))
    assert 0 < len(data.val) < total
    assert "60 files" in data.description


def test_bin_file_of_uint16_ids(tmp_path):
    ids = torch.arange(1000, dtype=torch.int32) % 700
    path = tmp_path / "tokens.bin"
    path.write_bytes(ids.to(torch.uint16).numpy().tobytes())
    data = load_tokens(str(path), val_fraction=0.1)
    assert data.vocab_size == 700
    assert torch.equal(torch.cat([data.train, data.val]), ids)


def test_bad_data_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.txt"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd size"):
        load_tokens(str(tmp_path / "odd.bin"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        load_tokens(str(empty))


def test_sampler_is_a_function_of_seed_and_step():
    tokens = torch.arange(10_000) % 256
    a = BatchSampler(tokens, seq_len=16, global_batch=8, seed=1)
    b = BatchSampler(tokens, seq_len=16, global_batch=8, seed=1)
    assert torch.equal(a.global_batch_at(3), b.global_batch_at(3))
    assert not torch.equal(a.global_batch_at(3), a.global_batch_at(4))
    other_seed = BatchSampler(tokens, seq_len=16, global_batch=8, seed=2)
    assert not torch.equal(a.global_batch_at(0), other_seed.global_batch_at(0))
    batch = a.global_batch_at(0)
    assert batch.shape == (8, 17) and batch.dtype == torch.int64
    # consecutive tokens: each row is a contiguous window of the stream
    assert torch.equal((batch[:, 1:] - batch[:, :-1]) % 256, torch.ones(8, 16, dtype=torch.long))


def test_each_epoch_visits_every_window_once_in_a_new_order():
    tokens = torch.arange(16 * 10 + 1)
    s = BatchSampler(tokens, seq_len=16, global_batch=5, seed=0)
    assert s.num_windows == 10
    epoch0 = torch.cat([s.global_batch_at(0), s.global_batch_at(1)])[:, 0] // 16
    epoch1 = torch.cat([s.global_batch_at(2), s.global_batch_at(3)])[:, 0] // 16
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(10))
    assert epoch0.tolist() != epoch1.tolist()


def test_replicas_split_the_global_batch_into_micro_batches():
    tokens = torch.arange(5000) % 256
    s = BatchSampler(tokens, seq_len=8, global_batch=8, seed=0)
    whole = s.global_batch_at(2)
    parts = [s.replica_microbatches(2, r, 2, micro_batch=2) for r in range(2)]
    assert [len(p) for p in parts] == [2, 2]
    assert torch.equal(torch.cat([mb for p in parts for mb in p]), whole)


def test_a_replicas_micro_batches_hold_only_its_own_rows():
    """Each rank reads its replica's rows, not the global batch: stacked whole, the batch
    stayed alive behind the micro-batches' views, dp times a rank's own rows (found by
    `paratrain simulate` at dp 128: +5.4% over the planner's peak, docs/planner.md)."""
    tokens = torch.arange(5000) % 256
    s = BatchSampler(tokens, seq_len=8, global_batch=32, seed=0)
    whole = s.global_batch_at(1)
    for replica in (0, 5, 7):
        micro = s.replica_microbatches(1, replica, 8, micro_batch=2)
        assert torch.equal(torch.cat(micro), whole[replica * 4 : (replica + 1) * 4])
        assert {mb.untyped_storage().nbytes() for mb in micro} == {4 * 9 * 8}  # 4 rows of 9


def test_validation_batches_are_fixed():
    tokens = torch.arange(1000)
    batches = validation_batches(tokens, seq_len=10, batch_size=4, num_batches=3)
    assert len(batches) == 3 and batches[0][0, 0] == 0 and batches[2][3, 0] == 110
