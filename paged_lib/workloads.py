"""Synthetic request traces shaped like the paper's two workloads (lengths in tokens).

The vLLM paper (Kwon et al., SOSP 2023, section 6.1, Fig. 11) serves requests sampled from
ShareGPT (long conversations: mean prompt about 161 tokens, mean output about 338) and Alpaca
(short instructions: about 19 and 58). The real data sets cannot be downloaded in this
course, so these generators draw *synthetic* lengths from long-tailed lognormal
distributions whose means, after clipping, land close to the paper's. They are stand-ins
for the length statistics only: no text, no real conversations.

Arrivals are a Poisson process: exponential gaps with ``rate`` requests per decoding step
(the simulator's unit of time). Everything is drawn from ``numpy.random.default_rng(seed)``
and rounded to integers, so a seed gives the same trace on every machine.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

#: The paper's mean (prompt, output) lengths, read from its Fig. 11.
PAPER_MEANS: dict[str, tuple[float, float]] = {
    "sharegpt": (161.0, 338.0),
    "alpaca": (19.0, 58.0),
}

#: Longest prompt we generate; prompt + output never exceeds ``max_len`` (OPT's 2048).
MAX_PROMPT = 1024


class Request(NamedTuple):
    """One request: ``prompt_len`` tokens in, ``output_len`` tokens out, arriving at step
    ``arrival`` (a float; the simulator admits it at the first whole step at or after it)."""

    prompt_len: int
    output_len: int
    arrival: float

    @property
    def final_len(self) -> int:
        """Tokens whose KV the request holds when it finishes."""
        return self.prompt_len + self.output_len


def _lognormal_ints(rng: np.random.Generator, mean: float, sigma: float, n: int,
                    lo: int, hi: np.ndarray | int) -> np.ndarray:
    """Lognormal draws with the given (unclipped) mean, rounded and clipped to [lo, hi]."""
    mu = math.log(mean) - sigma**2 / 2
    x = np.rint(rng.lognormal(mu, sigma, size=n)).astype(np.int64)
    return np.clip(x, lo, hi)


def _trace(num_requests: int, seed: int, rate: float, max_len: int,
           prompt: tuple[float, float], output: tuple[float, float]) -> list[Request]:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per step, got {rate}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one prompt and one output token), got {max_len}")
    rng = np.random.default_rng(seed)
    prompt_lens = _lognormal_ints(rng, *prompt, num_requests, 1, min(MAX_PROMPT, max_len - 1))
    output_lens = _lognormal_ints(rng, *output, num_requests, 1, max_len - prompt_lens)
    gaps = rng.exponential(1.0 / rate, size=num_requests)
    arrivals = np.round(np.cumsum(gaps), 6)
    return [Request(int(p), int(o), float(a))
            for p, o, a in zip(prompt_lens, output_lens, arrivals, strict=True)]


def sharegpt_like(num_requests: int, seed: int = 0, rate: float = 1.0,
                  max_len: int = 2048) -> list[Request]:
    """ShareGPT-shaped synthetic trace: mean prompt about 161, mean output about 338 tokens.

    Lognormal lengths (long tails: a few prompts near 1,000 tokens, a few outputs near
    2,000), clipped so prompt <= 1024 and prompt + output <= ``max_len``. ``rate`` is in
    requests per decoding step; the default 1.0 keeps every policy's memory full, which is
    the regime the paper's Fig. 2 measures.
    """
    return _trace(num_requests, seed, rate, max_len, prompt=(167.0, 1.0), output=(352.0, 1.0))


def alpaca_like(num_requests: int, seed: int = 0, rate: float = 4.0,
                max_len: int = 2048) -> list[Request]:
    """Alpaca-shaped synthetic trace: mean prompt about 19, mean output about 58 tokens."""
    return _trace(num_requests, seed, rate, max_len, prompt=(19.0, 0.6), output=(58.0, 0.8))


TRACES = {"sharegpt": sharegpt_like, "alpaca": alpaca_like}


def mean_lengths(requests: list[Request]) -> tuple[float, float]:
    """Mean (prompt_len, output_len) of a trace."""
    if not requests:
        raise ValueError("mean_lengths of an empty trace")
    return (float(np.mean([r.prompt_len for r in requests])),
            float(np.mean([r.output_len for r in requests])))


def shrink(requests: list[Request], factor: int) -> list[Request]:
    """The same trace with every length divided by ``factor`` (at least 1 token each), for
    pictures small enough to read; arrivals are unchanged."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    return [Request(max(1, round(r.prompt_len / factor)), max(1, round(r.output_len / factor)),
                    r.arrival) for r in requests]
