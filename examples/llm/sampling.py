"""Next-token choice: greedy, or temperature -> top-k -> top-p sampling (the usual order).

Sampling runs on the host in float64 with a numpy Generator per sequence, so a given seed gives
the same tokens whatever else is in the batch and on both backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0   # 0: greedy
    top_p: float = 1.0         # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0             # 0: no limit
    ignore_eos: bool = False   # benchmarks generate exactly max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def check(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        return self


def sequence_rng(seed: int, index: int) -> np.random.Generator:
    """The random stream of the `index`-th request of a run seeded with `seed`."""
    return np.random.default_rng([seed, index])


def sample(logits, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from host float logits [vocab]."""
    logits = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        return int(np.argmax(logits))
    scores = logits / params.temperature
    vocab = scores.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.partition(scores, vocab - params.top_k)[vocab - params.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if params.top_p < 1.0:
        order = np.argsort(-scores, kind="stable")
        probs = _softmax(scores[order])
        # Keep a token when the mass of the tokens ranked above it is below top_p; the most likely
        # token is therefore always kept.
        drop = (np.cumsum(probs) - probs) >= params.top_p
        scores[order[drop]] = -np.inf
    probs = _softmax(scores)
    return int(rng.choice(vocab, p=probs))


def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()
