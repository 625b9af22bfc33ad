"""What ``bench serve`` sends and what it sees, shared by its in-process and HTTP drivers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadRequest:
    """One request of the load: its prompt, how many tokens it gets, when it arrives (s)."""

    prompt: list[int]
    output_len: int
    arrival: float


@dataclass
class Served:
    """What one request saw: its arrival and the time each piece of its answer came (s):
    each token in-process; each streamed chunk over HTTP (a chunk may hold several tokens,
    or wait for the rest of a character, as ``vllm bench serve`` counts it too)."""

    arrival: float
    output_len: int
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
