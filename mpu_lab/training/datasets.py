"""Training data for the small GPT: a synthetic learnable dataset and a byte-level text file.

:class:`MockGPTDataset` is in the spirit of Megatron-core's ``MockGPTDataset`` (data made up
on the fly, deterministic from a seed, no files or tokenizer needed) but *learnable*: each
sample is a walk on a fixed random graph over the vocabulary — token ``x`` is followed by one
of ``branching`` successors, chosen with probabilities ``(0.5, 0.25, 0.15, 0.1)`` for four.
A model that has learned the graph reaches the entropy of that choice (about 1.2 nats for four
successors), far below ``log V`` (6.2 nats for ``V = 512``) where an untrained model starts,
so the loss visibly falls within a few hundred steps.

:class:`ByteTextDataset` reads any file as bytes (the tokenizer is the identity on bytes:
vocabulary 256) and returns random windows of it.

Sample ``i`` depends only on ``(seed, i)``, never on how many ranks read the data, so every
parallel layout sees exactly the same batches: :func:`batch_indices` gives each data-parallel
rank its own slice of each global batch, the way Megatron's pretraining sampler does.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

import numpy as np
import torch

BYTE_VOCAB_SIZE = 256


def _choice_probs(branching: int) -> np.ndarray:
    if branching == 4:
        return np.array([0.5, 0.25, 0.15, 0.1])
    w = 0.5 ** np.arange(branching)   # geometric for other sizes
    return w / w.sum()


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` deterministic sequences of ``seq_length + 1`` token ids in
    ``[0, vocab_size)``; item ``i`` is a dict of ``tokens``, ``labels`` (``tokens`` shifted by
    one), ``loss_mask`` and ``position_ids``, each of length ``seq_length``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int = 512,
                 seed: int = 1234, branching: int = 4):
        if vocab_size < 2 or branching < 1 or seq_length < 1:
            raise ValueError(f"MockGPTDataset: vocab_size {vocab_size} must be >= 2, branching "
                             f"{branching} and seq_length {seq_length} >= 1")
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed
        graph = np.random.default_rng([seed, 0x6770])
        self.successors = graph.integers(0, vocab_size, size=(vocab_size, branching))
        self.cum_probs = np.cumsum(_choice_probs(branching))

    def __len__(self) -> int:
        return self.num_samples

    def sequence(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1, idx])
        choices = np.searchsorted(self.cum_probs, rng.random(self.seq_length), side="right")
        choices = np.minimum(choices, self.successors.shape[1] - 1)
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        out[0] = rng.integers(0, self.vocab_size)
        for t in range(self.seq_length):
            out[t + 1] = self.successors[out[t], choices[t]]
        return out

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        return _sample(self.sequence(idx))


class ByteTextDataset(torch.utils.data.Dataset):
    """Random windows of ``seq_length + 1`` bytes of a text file (vocabulary 256)."""

    def __init__(self, path: str, num_samples: int, seq_length: int, seed: int = 1234):
        check_text_file(path, seq_length)
        self.data = np.fromfile(path, dtype=np.uint8)
        self.num_samples, self.seq_length, self.seed = num_samples, seq_length, seed
        self.vocab_size = BYTE_VOCAB_SIZE

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, 2, idx])
        start = int(rng.integers(0, len(self.data) - self.seq_length))
        return _sample(self.data[start:start + self.seq_length + 1].astype(np.int64))


def check_text_file(path: str, seq_length: int) -> None:
    """Raise ``ValueError`` unless ``path`` is a readable file of more than ``seq_length`` bytes."""
    if not os.path.isfile(path):
        raise ValueError(f"--data-path {path!r} is not a file")
    size = os.path.getsize(path)
    if size < seq_length + 1:
        raise ValueError(f"--data-path {path!r} holds {size} bytes; a sample needs "
                         f"seq_length + 1 = {seq_length + 1}")


def decode_bytes(ids: Sequence[int]) -> str:
    """Byte-level ids back to text (invalid UTF-8 shown as U+FFFD)."""
    return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def _sample(seq: np.ndarray) -> Dict[str, torch.Tensor]:
    t = torch.from_numpy(seq)
    n = len(seq) - 1
    return {"tokens": t[:-1].clone(), "labels": t[1:].clone(),
            "loss_mask": torch.ones(n, dtype=torch.float32),
            "position_ids": torch.arange(n, dtype=torch.int64)}


def batch_indices(iteration: int, micro_batch: int, micro_batch_size: int,
                  data_parallel_rank: int, data_parallel_size: int,
                  num_micro_batches: int) -> List[int]:
    """Sample ids of one micro-batch: global batch ``iteration`` (0-based) holds samples
    ``[iteration * G, (iteration + 1) * G)`` with ``G = mbs x micro-batches x DP``; micro-batch
    ``m`` of it is split into ``DP`` consecutive slices of ``mbs`` (Megatron's sampler)."""
    global_batch = micro_batch_size * num_micro_batches * data_parallel_size
    start = iteration * global_batch + (micro_batch * data_parallel_size + data_parallel_rank) * micro_batch_size
    return list(range(start, start + micro_batch_size))


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def build_dataset(data_path=None, num_samples: int = 1, seq_length: int = 64,
                  vocab_size: int = 512, seed: int = 1234):
    """The text file at ``data_path`` if given, else the mock dataset."""
    if data_path:
        return ByteTextDataset(data_path, num_samples, seq_length, seed)
    return MockGPTDataset(num_samples, seq_length, vocab_size, seed)
