"""int64 words that carry floats, maxima and ranks through exact all-reduces.

A SUM or MIN all-reduce of int64 words gives every rank the same bits, in
whatever order the ranks' words arrive. The merge of zeroscan/distributed/allreduce.py
(and its replica comparison, zeroscan/distributed/allreduce_replicas.py) sends
everything else as such words: a float64 as its ordered key (MIN of the
keys is the least float, MIN of ~key the greatest), a row of exact words as
a 64-bit fingerprint, a rank that takes no part as MIN's identity, and the
greatest rank as MIN(~rank).
"""

from __future__ import annotations

import torch

INT64_MAX = (1 << 63) - 1
_SIGN_FREE = INT64_MAX  # the bits a negative float64's ordered key flips


def ordered(bits: torch.Tensor) -> torch.Tensor:
    """int64 keys of float64 bit patterns (non-NaN) that order as the floats
    do; the map is its own inverse."""
    return torch.where(bits < 0, bits ^ _SIGN_FREE, bits)


def as_floats(words: torch.Tensor) -> torch.Tensor:
    return words.contiguous().view(torch.float64)


def as_words(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.int64)


_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: odd, its multiples spread over 64 bits


def fingerprint(words: torch.Tensor) -> torch.Tensor:
    """int64 [...]: a 64-bit hash of int64 [..., K] words: their sum weighted
    by odd constants, wrapping modulo 2^64, then mixed. Two rows that differ
    in one word always differ here (an odd weight is invertible modulo 2^64).
    The weights are made on the words' device: no copy from the host."""
    k = torch.arange(1, words.shape[-1] + 1, dtype=torch.int64, device=words.device)
    weights = (k * _GOLDEN) | 1
    h = (words * weights).sum(-1)
    h = h ^ ((h >> 31) & ((1 << 33) - 1))
    return h ^ (h << 17)


def neither(condition: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value where condition holds, else the identity of MIN."""
    return torch.where(condition, value, torch.full_like(value, INT64_MAX))


def key_value(key: torch.Tensor) -> torch.Tensor:
    """The float64 whose ordered key is `key`."""
    return as_floats(ordered(key))


def last_rank(min_of_not: torch.Tensor) -> torch.Tensor:
    """The greatest rank from MIN(~rank), -1 where no rank took part."""
    return torch.where(min_of_not == INT64_MAX, -1, ~min_of_not)
