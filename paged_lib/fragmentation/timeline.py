"""What one simulation saw: the four categories' slot-steps, and who held which slots when.

:class:`Timeline` is filled by :mod:`paged_lib.fragmentation.simulators`; its
:attr:`~Timeline.breakdown` is the paper's Fig. 2 for the run, and with ``record=True`` its
``allocations`` and ``runs`` draw chapter 02's memory map.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

CATEGORIES = ("token_states", "reserved", "internal", "external")

#: The paper's Fig. 2 (shares of KV memory, ShareGPT on OPT-13B). ``None``: not reported
#: (Oracle has no internal fragmentation; vLLM's bar gives only its token-state share).
PAPER_FIG2: dict[str, dict[str, float | None]] = {
    "orca-max": {"token_states": 0.204, "reserved": 0.133, "internal": 0.573, "external": 0.089},
    "orca-pow2": {"token_states": 0.268, "reserved": 0.179, "internal": 0.136,
                  "external": 0.416},
    "orca-oracle": {"token_states": 0.382, "reserved": 0.252, "internal": None,
                    "external": 0.366},
    "paged": {"token_states": 0.963, "reserved": None, "internal": None, "external": None},
}
PAPER_NAMES = {"orca-max": "Orca (Max)", "orca-pow2": "Orca (Pow2)",
               "orca-oracle": "Orca (Oracle)", "paged": "vLLM"}


class Breakdown(NamedTuple):
    """Time-averaged shares of KV memory; the four fields sum to 1."""

    token_states: float
    reserved: float
    internal: float
    external: float



@dataclass(frozen=True)
class Alloc:
    """Request ``request`` held slots ``[slot, slot + size)`` during steps ``[start, end)``;
    the first of them is its logical slot ``logical`` (a page's offset in the sequence)."""

    request: int
    slot: int
    size: int
    logical: int
    start: int
    end: int


@dataclass(frozen=True)
class Run:
    """Request ``request`` ran during steps ``[start, end)`` holding ``tokens0`` token
    states in its first step (one more each step) on its way to ``final_len``."""

    request: int
    start: int
    end: int
    tokens0: int
    final_len: int


@dataclass
class Timeline:
    """Everything one simulation saw. ``slot_steps`` are the raw integrals behind
    ``breakdown``; ``allocations`` and ``runs`` are filled when ``record=True``.

    ``preempted`` counts, per request, how often paging evicted it, and
    ``recomputed_tokens`` the token states it had to compute again on readmission.
    """

    policy: str
    capacity: int
    block_size: int
    max_len: int
    num_steps: int = 0
    preemptions: int = 0
    waiting_steps: int = 0  # steps with a request still waiting after admission
    slot_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    allocations: list[Alloc] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    waiting: list[tuple[int, int]] = field(default_factory=list)  # [t0, t1) queue non-empty
    preempted: Counter = field(default_factory=Counter)
    recomputed_tokens: int = 0

    @property
    def breakdown(self) -> Breakdown:
        total = sum(self.slot_steps.values())
        return Breakdown(*(self.slot_steps[c] / total for c in CATEGORIES))

    def pool_breakdown(self) -> Breakdown:
        """Shares of the *whole pool* over every step of the run: free memory counts as
        external (& others) even when nobody waits, as idle memory would in a measurement
        that does not tell the two apart. Depends on load and on the drain at the end."""
        total = self.capacity * self.num_steps
        held = self.slot_steps["token_states"] + self.slot_steps["reserved"] \
            + self.slot_steps["internal"]
        return Breakdown(self.slot_steps["token_states"] / total,
                         self.slot_steps["reserved"] / total,
                         self.slot_steps["internal"] / total, (total - held) / total)
