"""Tokenizers and prepared token shards: a BPE trained here, `paratrain prepare` run,
interrupted and run again, small files grouped into jobs and a large JSON-lines file cut
into several, each giving the token streams of encoding one document at a time, shards
read through memory maps in constant memory, and bad shards refused before any worker
starts."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from paratrain.cli import main
from paratrain.data.prepare import prepare
from paratrain.data.prepared import ShardedTokens
from paratrain.data.tokenizer import (
    EOT,
    load_tokenizer,
    padded_vocab,
    text_files,
    train_tokenizer,
)
from paratrain.data.tokens import BatchSampler, load_tokens
from paratrain.models.generate import next_token

CORPUS = Path(json.__file__).parent  # the json package's sources: a few files of real text


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    assert train_tokenizer(CORPUS, 400, out) == 400
    return out


def _corpus(tmp: Path, files: int, copies: int = 1, rows: int = 15) -> Path:
    """A folder of text files and one JSON-lines file of `rows` documents."""
    root = tmp / "corpus"
    root.mkdir()
    texts = [f.read_text() for f in sorted(CORPUS.glob("*.py"))]
    for i in range(files):
        (root / f"doc{i:03d}.txt").write_text(texts[i % len(texts)] * copies + f"\n# {i}\n")
    lines = [json.dumps({"text": texts[i % len(texts)][:500] + f" {i}"}) for i in range(rows)]
    (root / "more.jsonl").write_text("".join(line + "\n" for line in lines))
    return root


def _expected_streams(data: Path, tokenizer: Path, val_fraction: float) -> dict[str, list[int]]:
    """The train and val streams by the rule, one document encoded at a time: the sorted
    files, a text file one document, a JSON-lines line one unless blank, document n of a
    file held out when sha256 of "file:n" says so."""
    tok = load_tokenizer(tokenizer)
    root, files = (data, text_files(data)) if data.is_dir() else (data.parent, [data])
    streams: dict[str, list[int]] = {"train": [], "val": []}
    for f in files:
        if f.suffix == ".jsonl":
            docs = [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
        else:
            docs = [f.read_text(errors="replace")]
        for n, text in enumerate(docs):
            digest = hashlib.sha256(f"{f.relative_to(root).as_posix()}:{n}".encode()).digest()
            held_out = int.from_bytes(digest[:8], "little") / 2**64 < val_fraction
            streams["val" if held_out else "train"] += tok.encode(text).ids + [tok.token_to_id(EOT)]
    return streams


def _streams(out: Path) -> dict[str, list[int]]:
    data = load_tokens(str(out))
    return {"train": data.train[:].tolist(), "val": data.val[:].tolist()}


def test_a_trained_tokenizer_round_trips_any_text(tokenizer):
    tok = load_tokenizer(tokenizer)
    text = 'def f(x):\n    return "héllo, wörld ✓" + str(x)  # 日本語\n'
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: nothing unknown
    assert tok.token_to_id(EOT) is not None and tok.get_vocab_size() == 400
    assert len(tok.encode(text).ids) < len(text.encode())  # it merged something


def test_prepare_writes_documents_with_end_of_text_and_a_held_out_split(tmp_path, tokenizer):
    meta = prepare(_corpus(tmp_path, 6), tokenizer, tmp_path / "data", 0.3, 1, progress=False)
    eot = load_tokenizer(tokenizer).token_to_id(EOT)
    data = load_tokens(str(tmp_path / "data"))
    assert meta["dtype"] == "uint16" and data.vocab_size == 400
    train = data.train[:]
    assert int((train == eot).sum()) == meta["documents"]["train"]
    assert meta["documents"]["val"] > 0 and len(data.val) == meta["tokens"]["val"]
    assert int(train[-1]) == eot  # every document ends with it


def test_many_small_files_make_fewer_shards_with_the_streams_of_one_document_at_a_time(
    tmp_path, tokenizer
):
    corpus = _corpus(tmp_path, 40)
    meta = prepare(corpus, tokenizer, tmp_path / "data", 0.2, 1, False, job_bytes=50_000)
    assert 1 < len(meta["shards"]) < 41  # 41 files, a few jobs
    assert len(list((tmp_path / "data").glob("shard_*.json"))) == len(meta["shards"])
    expected = _expected_streams(corpus, tokenizer, 0.2)
    assert expected["val"] and _streams(tmp_path / "data") == expected
    one_job = prepare(corpus, tokenizer, tmp_path / "one", 0.2, 1, progress=False)
    assert len(one_job["shards"]) == 1 and _streams(tmp_path / "one") == expected


def test_a_large_json_lines_file_is_cut_into_jobs_that_encode_like_the_whole_file(
    tmp_path, tokenizer
):
    texts = [f.read_text() for f in sorted(CORPUS.glob("*.py"))]
    lines = [json.dumps({"text": texts[i % 5][: 50 + 37 * i % 900] + f" {i}"}) for i in range(300)]
    lines[40:40] = ["", "   "]  # blank: not documents, yet lines (the n of the split key)
    lines[200] = json.dumps({"text": "long " * 3000})  # one line over a job's bytes
    big = tmp_path / "big.jsonl"
    big.write_text("".join(line + "\n" for line in lines))
    meta = prepare(big, tokenizer, tmp_path / "cut", 0.2, 2, False, job_bytes=8192)
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "cut").glob("shard_*"))]
    ranges = [tuple(piece[1:]) for r in records for piece in r["inputs"]]
    assert len(meta["shards"]) > 4 and ranges[0][0] == 0 and ranges[-1][1] == big.stat().st_size
    raw = big.read_bytes()
    for (_, end), (start, _) in zip(ranges[:-1], ranges[1:], strict=True):  # at line starts
        assert end == start and raw[start - 1 : start] == b"\n"
    expected = _expected_streams(big, tokenizer, 0.2)
    assert expected["val"] and _streams(tmp_path / "cut") == expected
    whole = prepare(big, tokenizer, tmp_path / "whole", 0.2, 1, progress=False)
    assert len(whole["shards"]) == 1 and _streams(tmp_path / "whole") == expected
    assert (whole["documents"], whole["tokens"]) == (meta["documents"], meta["tokens"])


PREPARE = """import sys
from pathlib import Path
from paratrain.data.prepare import prepare
data, tok, out = map(Path, sys.argv[1:4])
prepare(data, tok, out, 0.1, 1, progress=False, job_bytes=int(sys.argv[4]))
"""


def test_an_interrupted_prepare_run_again_writes_the_same_shards(tmp_path, tokenizer):
    corpus = _corpus(tmp_path, 120, copies=4, rows=1000)  # ~40 kB a file, a 520 kB .jsonl
    job_bytes = 100_000  # ~2 text files a job, ~5 jobs for the .jsonl
    whole = tmp_path / "whole"
    meta = prepare(corpus, tokenizer, whole, 0.1, 1, progress=False, job_bytes=job_bytes)
    assert len(meta["shards"]) < 121
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-c", PREPARE, str(corpus), str(tokenizer), str(cut), str(job_bytes)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(cut.glob("shard_*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "meta.json").exists(), "it finished before the kill: nothing was tested"
    finished = {p: p.stat().st_mtime_ns for p in cut.glob("shard_*.json")}
    assert 3 <= len(finished) < len(meta["shards"])
    prepare(corpus, tokenizer, cut, 0.1, 2, False, job_bytes)  # again, now with 2 workers
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # not redone
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in cut.iterdir())
    for name in names:
        assert (whole / name).read_bytes() == (cut / name).read_bytes(), name


def test_shards_read_like_the_whole_stream_in_the_same_order(tmp_path, tokenizer):
    prepare(_corpus(tmp_path, 8), tokenizer, tmp_path / "data", 0.1, 1, False, job_bytes=20_000)
    sharded = load_tokens(str(tmp_path / "data")).train
    assert isinstance(sharded, ShardedTokens) and len(sharded.maps) > 1
    whole = sharded[:]
    mine, theirs = BatchSampler(sharded, 64, 8, 3), BatchSampler(whole, 64, 8, 3)
    for step in (0, 1, 7, 40):  # across epochs and shard boundaries
        assert torch.equal(mine.global_batch_at(step), theirs.global_batch_at(step))
    assert torch.equal(sharded[10:20], whole[10:20]) and len(sharded) == len(whole)


def _rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon")


def _touch_every_window(path: str, seq_len: int) -> tuple[int, int, int]:
    """In a fresh process: anonymous memory before loading the data and after visiting
    every window of it."""
    load_tokens("", 0.05)  # warm: the modules and the allocator's first arenas
    before = _rss_anon_kib()
    data = load_tokens(path)
    sampler = BatchSampler(data.train, seq_len, 64, 0)
    total = 0
    for step in range(sampler.num_windows // 64):
        total += int(sampler.global_batch_at(step)[:, 0].sum())
    return before, _rss_anon_kib(), total


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc needed")
def test_training_data_is_memory_mapped_in_constant_memory(tmp_path):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    # 64 MiB of token ids, a multiple of what the loader may hold (16 MiB of anonymous
    # memory): written as a prepared data set of two shards.
    out = tmp_path / "big"
    out.mkdir()
    n = 16 * 2**20  # uint16 ids per shard: 32 MiB each
    shards = []
    for i in range(2):
        ids = np.arange(n, dtype=np.uint32) % 50000
        ids.astype(np.uint16).tofile(out / f"train_{i:05d}.bin")
        np.zeros(0, dtype=np.uint16).tofile(out / f"val_{i:05d}.bin")
        files = {"train": f"train_{i:05d}.bin", "val": f"val_{i:05d}.bin"}
        shards.append({s: {"file": f, "documents": 1, "tokens": n if s == "train" else 0}
                       for s, f in files.items()})  # fmt: skip
    meta = {"tokenizer_sha256": "", "vocab_size": 50000, "eot": 0, "dtype": "uint16",
            "val_fraction": 0.0, "shards": shards, "tokens": {"train": 2 * n, "val": 0},
            "documents": {"train": 2, "val": 0}}  # fmt: skip
    (out / "meta.json").write_text(json.dumps(meta))
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        before, after, _ = pool.submit(_touch_every_window, str(out), 1024).result()
    assert after - before < 16 * 1024, f"anonymous memory grew by {after - before} KiB"


def test_a_truncated_shard_or_another_tokenizer_is_refused_before_any_worker(
    tmp_path, tokenizer, capsys
):
    prepare(_corpus(tmp_path, 4), tokenizer, tmp_path / "data", 0.2, 1, progress=False)
    other = tmp_path / "other.json"
    train_tokenizer(CORPUS, 300, other)
    capsys.readouterr()
    args = ["train", "--data", str(tmp_path / "data"), "--nproc", "1", "--steps", "1"]
    assert main([*args, "--tokenizer", str(other), "--out", str(tmp_path / "r1")]) == 2
    assert "is not the one" in capsys.readouterr().err
    shard = tmp_path / "data" / "train_00000.bin"  # the one job of these 5 small files
    shard.write_bytes(shard.read_bytes()[:-3])
    assert main([*args, "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert "train_00000.bin" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_the_vocabulary_is_padded_for_tensor_parallelism_and_padding_is_never_drawn():
    assert padded_vocab(400) == 512 and padded_vocab(512) == 512 and padded_vocab(50257) == 50304
    logits = torch.zeros(4, 512)
    logits[:, 400:] = 100.0  # the padding rows would win every draw
    gen = torch.Generator().manual_seed(0)
    for temperature in (0.0, 1.0):
        ids = next_token(logits, temperature, 0, gen, vocab=400)
        assert int(ids.max()) < 400
