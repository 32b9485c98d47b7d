"""The data a run trains on, from files to batches, before and apart from any training.

tokens.py: token data (the embedded default, text, a .bin of ids, prepared shards), the
deterministic split and the stateless batch sampler; checks.py: the data checked before
any worker starts; prepare.py: `paratrain prepare`, text to memory-mapped token shards
(prepared.py reads them back);
tokenizer.py: byte-level BPE trained here, a tokenizer.json read, the vocabulary padded.

Imports nothing else from paratrain (no strategy, no training code): the CLI's checks,
the workers and the offline commands all read data through it.
"""
