"""Orca-style reservation on the paged pool (chapter 14: the paper's baselines, §6.1).

``LLMEngine(..., reservation="orca-max" | "orca-pow2" | "orca-oracle")`` makes every
request reserve, when it is admitted, the blocks of the length chapter 02's policies
give it (:func:`paged_lib.fragmentation.reservation`, the same function): ``max_len``
tokens (here the engine's ``max_model_len``); its prompt plus its output length rounded
up to a power of two (at most ``max_len``); or its prompt plus its true output length.
The reservation is held until the request finishes, so memory, not compute, limits the
batch, as it did in Orca. ``"paged"`` (the default) reserves nothing: blocks are taken
on demand, the engine's behaviour in every other chapter.

**The output length the policies see.** An engine cannot know how long an answer will
be; the paper's Orca (Oracle) and (Pow2) are told. Here a request's ``max_tokens`` is
taken as its true output length: a benchmark that wants the two to agree sets
``ignore_eos=True`` (``python -m paged_lib.bench serve`` does), and a request that stops
earlier frees its reservation when it stops.

**How, with the least intrusion.** Blocks are still taken on demand from the one pool;
what changes is admission, through the ``num_required_blocks`` hook (as the sliding
window's :meth:`~paged_lib.engine.window.SlidingWindow.reserving` does): a waiting
request needs its own reservation, plus what every running request may still take of
its own (its reservation less the blocks it holds). So free blocks always cover every
running request up to its reservation: none is ever preempted, and the blocks reserved
for one are never given to another. The reservation is whole blocks (``cdiv`` of the
tokens): less than one block of internal fragmentation per request, on top of the
policy's own.

**Not supported** (``ValueError``): ``n > 1`` and beam search (the policies reserve for
one sequence), prefix caching (a hit changes what a request takes), chunked prefill (a
first chunk is admitted on its own blocks, not through the hook) and a sliding window.
"""

from __future__ import annotations

from collections.abc import Callable

from paged_lib.engine.sequence import SamplingParams, SequenceGroup
from paged_lib.fragmentation.request import reservation as chapter02_reservation
from paged_lib.util import cdiv

#: The engine's reservation policies: ``"paged"`` (none) and chapter 02's three Orcas.
RESERVATIONS = ("paged", "orca-max", "orca-pow2", "orca-oracle")


def reserved_tokens(policy: str, prompt_len: int, max_tokens: int, max_len: int) -> int:
    """Token slots a request reserves at admission under ``policy`` (chapter 02's rule,
    its true output length taken to be ``max_tokens``); ``"paged"`` reserves none (0).

    Example (max_len 512): prompt 40, 25 new tokens -> orca-max 512, orca-pow2 40 + 32 =
    72, orca-oracle 65.
    """
    if policy == "paged":
        return 0
    if policy not in RESERVATIONS:
        raise ValueError(f"reservation must be one of {RESERVATIONS}, got {policy!r}")
    final = prompt_len + max_tokens
    return chapter02_reservation(policy, prompt_len + 1, final, max_len=max_len,
                                 prompt_len=prompt_len)


class Reservation:
    """The engine's reservation: the admission count and the checks (module docstring)."""

    def __init__(self, policy: str, block_size: int, max_len: int):
        if policy not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {policy!r}")
        self.policy, self.block_size, self.max_len = policy, block_size, max_len

    def blocks(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks one request reserves at admission."""
        return cdiv(reserved_tokens(self.policy, prompt_len, max_tokens, self.max_len),
                    self.block_size)

    def group_blocks(self, group: SequenceGroup) -> int:
        return self.blocks(len(group.prompt_token_ids), group.params.max_tokens)

    def owed(self, running: list[SequenceGroup]) -> int:
        """Blocks the ``running`` requests may still take of their reservations."""
        return owed(running, self.group_blocks)

    def check_request(self, i: int, params: SamplingParams) -> None:
        if params.num_seqs != 1:
            raise ValueError(f"request {i}: reservation={self.policy!r} reserves for one "
                             f"sequence (n=1, no beam search), got {params.num_seqs}")

    def reserving(self, num_required_blocks: Callable,
                  running: Callable[[], list[SequenceGroup]]) -> Callable:
        """The admission count that reserves each request's blocks (:func:`reserving`)."""
        return reserving(num_required_blocks, running, self.group_blocks)


def reserving(num_required_blocks: Callable, running: Callable[[], list[SequenceGroup]],
              cap: Callable[[SequenceGroup], int]) -> Callable:
    """An admission count that keeps every request's ``cap(group)`` blocks for it: a
    waiting group needs its cap (or more, if ``num_required_blocks`` says so) plus what the
    ``running()`` groups may still take of theirs (their cap less the blocks they hold).
    Free blocks then always cover every running request up to its cap: none is preempted,
    and no block kept for one goes to another. Orca's reservations use it, and so does the
    sliding window, whose cap is the most blocks a windowed stream ever holds."""

    def required(group: SequenceGroup, block_size: int) -> int:
        return max(num_required_blocks(group, block_size), cap(group)) + owed(running(), cap)

    return required


def owed(running: list[SequenceGroup], cap: Callable[[SequenceGroup], int]) -> int:
    """Blocks the ``running`` groups may still take of their ``cap``."""
    return sum(max(0, cap(g) - len(s.block_table.blocks))
               for g in running for s in g.live_seqs() if s.block_table is not None)


def make_reservation(policy: str, block_size: int, max_len: int, **options) -> Reservation | None:
    """``LLMEngine``'s reservation (``None`` for ``"paged"``), checked: an unknown policy,
    or an engine option it does not combine with (``options``, each off when falsy or
    ``None``), is a ``ValueError``."""
    if policy == "paged":
        return None
    res = Reservation(policy, block_size, max_len)
    for name, value in options.items():
        if value:
            raise ValueError(f"reservation={policy!r} does not combine with {name}={value!r} "
                             "(see paged_lib.engine.reservation for why)")
    return res
