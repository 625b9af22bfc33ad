"""Where KV memory goes: a trace-driven simulation of a KV pool (the paper's Fig. 2).

The pool has ``capacity_tokens`` slots; one slot holds one token's K and V for every layer.
Time moves in decoding *steps*. A request is admitted first-come-first-served when its
policy can give it memory; during its k-th step it stores ``prompt_len + k`` token states
(its prompt and the tokens produced so far, counting this step's: like the paper's Fig. 3,
the token being generated has a slot), and after ``output_len`` steps it leaves holding its
final length ``L = prompt_len + output_len``.

Every slot the policy holds falls in one of the paper's four categories, at every step:

* **token states**: slots holding a real token's KV now;
* **reserved**: slots held for tokens this request *will* produce later (used eventually);
* **internal fragmentation**: slots held for this request that will never hold a token
  (beyond its final length, the rest of a power-of-two or buddy block, the unused tail of
  its last page, a finished request kept in a static batch);
* **external fragmentation**: free slots at a step when a request is still waiting after
  admission: memory that exists but could not be given to the next request (the hole is
  not contiguous or too small, a static batch is closed, or the page pool is short of the
  head request's prompt). Free memory while nobody waits is idle, not waste, and is left
  out.

The denominator ("the KV memory the policy holds") is therefore held slots plus unusable
free slots, summed over steps (slot-steps), so each share is a time average weighted by how
much memory was in play. Under load (a queue most of the time, as in the paper's serving
experiments) it is the whole pool.

Policies (``POLICIES``):

* ``static-max``: FasterTransformer-like static batching: ``capacity // max_len`` batch
  slots of ``max_len`` each; a batch runs until its longest request ends.
* ``orca-max`` / ``orca-pow2`` / ``orca-oracle``: iteration-level batching (Orca); each
  request reserves one contiguous chunk, first-fit in a linear address space: ``max_len``;
  its prompt plus its output length rounded up to a power of two (the paper's §6.1: "if
  the true output length is 25, it reserves 32 positions for outputs"; at most
  ``max_len``); or exactly its final length.
* ``buddy``: the oracle length reserved from a binary buddy allocator (the paper's own Orca
  implementation assumes one); the round-up to a power of two is internal fragmentation.
* ``paged``: vLLM: ``block_size``-token blocks allocated on demand from a free list; when a
  running request needs a block and none is free, the most recently admitted request is
  preempted (recompute: its blocks are freed and it waits at the head of the queue).

The contiguous allocators live in :mod:`paged_lib.contiguous`; the memory-map picture
(which request held which slot at each step) in :mod:`paged_lib.course.viz.fragmentation`.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from paged_lib.contiguous import Buddy, FirstFit, next_pow2
from paged_lib.util import cdiv
from paged_lib.workloads import Request

POLICIES = ("static-max", "orca-max", "orca-pow2", "orca-oracle", "buddy", "paged")
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


# ---------------------------------------------------------------- one request, one step


def reservation(policy: str, num_tokens: int, final_len: int, block_size: int = 16,
                max_len: int = 2048, prompt_len: int | None = None) -> int:
    """Slots a request holds under ``policy`` while it stores ``num_tokens`` token states
    and will end with ``final_len`` (``orca-pow2`` also needs its ``prompt_len``)."""
    if policy in ("static-max", "orca-max"):
        return max_len
    if policy == "orca-pow2":
        if prompt_len is None or not 0 <= prompt_len < final_len:
            raise ValueError("orca-pow2 reserves the prompt plus the output length rounded "
                             "up to a power of two: pass prompt_len (0 <= prompt_len < "
                             f"final_len={final_len}), got {prompt_len!r}")
        return min(max_len, prompt_len + next_pow2(final_len - prompt_len))
    if policy == "buddy":
        return next_pow2(final_len)
    if policy == "orca-oracle":
        return final_len
    if policy == "paged":
        return cdiv(num_tokens, block_size) * block_size
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")


def request_slots(policy: str, num_tokens: int, final_len: int, block_size: int = 16,
                  max_len: int = 2048, prompt_len: int | None = None) -> tuple[int, int, int]:
    """(token states, reserved, internal) slots of one running request right now.

    Reserved slots are held slots the request will still fill (up to its final length);
    internal fragmentation is every held slot past the final length.
    """
    if not 1 <= num_tokens <= final_len:
        raise ValueError(f"need 1 <= num_tokens <= final_len, got {num_tokens} and {final_len}")
    held = reservation(policy, num_tokens, final_len, block_size, max_len, prompt_len)
    will_use = min(held, final_len)
    return num_tokens, will_use - num_tokens, held - will_use


# ---------------------------------------------------------------- the timeline


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


# ---------------------------------------------------------------- simulation


def simulate(requests: Sequence[Request], policy: str, capacity_tokens: int,
             block_size: int = 16, max_len: int = 2048) -> Breakdown:
    """Time-averaged :class:`Breakdown` of the KV memory ``policy`` holds serving
    ``requests`` from a pool of ``capacity_tokens`` slots (see the module docstring)."""
    return simulate_timeline(requests, policy, capacity_tokens, block_size, max_len).breakdown


def simulate_timeline(requests: Sequence[Request], policy: str, capacity_tokens: int,
                      block_size: int = 16, max_len: int = 2048, *,
                      record: bool = False) -> Timeline:
    """Run the simulation and return its :class:`Timeline` (``record=True`` also keeps who
    owned which slots when, for chapter 02's memory-map picture)."""
    _validate(requests, policy, capacity_tokens, block_size, max_len)
    timeline = Timeline(policy, capacity_tokens, block_size, max_len)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    arrive = [max(0, math.ceil(requests[i].arrival)) for i in order]
    if policy == "static-max":
        _run_static(requests, order, arrive, timeline, record)
    elif policy == "paged":
        _run_paged(requests, order, arrive, timeline, record)
    else:
        _run_contiguous(requests, order, arrive, timeline, record)
    return timeline


def _validate(requests: Sequence[Request], policy: str, capacity: int, block_size: int,
              max_len: int) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    for name, v in (("capacity_tokens", capacity), ("block_size", block_size),
                    ("max_len", max_len)):
        if not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not requests:
        raise ValueError("no requests to simulate")
    if policy in ("static-max", "orca-max") and max_len > capacity:
        raise ValueError(f"{policy} reserves max_len={max_len} slots per request but the "
                         f"pool has only {capacity}")
    if policy == "paged" and capacity < block_size:
        raise ValueError(f"a pool of {capacity} slots holds no block of {block_size}")
    limit = Buddy(capacity).largest_block if policy == "buddy" else capacity
    for i, r in enumerate(requests):
        if r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"request {i}: prompt_len and output_len must be >= 1, got {r}")
        length = r.prompt_len + r.output_len
        if length > max_len:
            raise ValueError(f"request {i} is {length} tokens long, longer than "
                             f"max_len={max_len}")
        held = reservation(policy, length, length, block_size, max_len, r.prompt_len)
        if held > limit or length > capacity:
            raise ValueError(f"request {i} ({length} tokens, {held} slots under {policy}) "
                             f"cannot fit in a pool of {capacity} slots")


def _add_run(timeline: Timeline, i: int, p: int, o: int, held: int) -> None:
    """Slot-steps of a contiguous request admitted with ``held`` slots, running o steps."""
    length = p + o
    tokens = o * p + o * (o + 1) // 2
    timeline.slot_steps["token_states"] += tokens
    timeline.slot_steps["reserved"] += o * length - tokens
    timeline.slot_steps["internal"] += o * (held - length)


def _run_contiguous(requests, order, arrive, timeline: Timeline, record: bool) -> None:
    pool = Buddy(timeline.capacity) if timeline.policy == "buddy" else FirstFit(timeline.capacity)
    queue: deque[int] = deque()
    running: list[tuple[int, int, int, int]] = []  # heap of (end step, request, addr, size)
    t, nxt_arrival = 0, 0
    while nxt_arrival < len(order) or queue or running:
        while running and running[0][0] <= t:
            _, _, addr, size = heapq.heappop(running)
            pool.free(addr, size)
        while nxt_arrival < len(order) and arrive[nxt_arrival] <= t:
            queue.append(order[nxt_arrival])
            nxt_arrival += 1
        while queue:
            i = queue[0]
            p, o = requests[i].prompt_len, requests[i].output_len
            got = pool.alloc(reservation(timeline.policy, p + o, p + o, timeline.block_size,
                                         timeline.max_len, p))
            if got is None:
                break
            queue.popleft()
            addr, held = got
            heapq.heappush(running, (t + o, i, addr, held))
            _add_run(timeline, i, p, o, held)
            if record:
                timeline.allocations.append(Alloc(i, addr, held, 0, t, t + o))
                timeline.runs.append(Run(i, t, t + o, p + 1, p + o))
        nxt = min(running[0][0] if running else math.inf,
                  arrive[nxt_arrival] if nxt_arrival < len(order) else math.inf)
        if nxt == math.inf:
            break
        if queue:
            timeline.slot_steps["external"] += pool.free_slots * (nxt - t)
            timeline.waiting_steps += nxt - t
            timeline.waiting.append((t, nxt))
        t = nxt
    timeline.num_steps = t


def _run_static(requests, order, arrive, timeline: Timeline, record: bool) -> None:
    size = timeline.max_len
    slots = timeline.capacity // size
    queue: deque[int] = deque()
    t, nxt_arrival = 0, 0
    while nxt_arrival < len(order) or queue:
        while nxt_arrival < len(order) and arrive[nxt_arrival] <= t:
            queue.append(order[nxt_arrival])
            nxt_arrival += 1
        if not queue:
            t = arrive[nxt_arrival]
            continue
        batch = [queue.popleft() for _ in range(min(slots, len(queue)))]
        duration = max(requests[i].output_len for i in batch)
        for k, i in enumerate(batch):
            p, o = requests[i].prompt_len, requests[i].output_len
            _add_run(timeline, i, p, o, size)
            timeline.slot_steps["internal"] += size * (duration - o)  # done, slot still held
            if record:
                timeline.allocations.append(Alloc(i, k * size, size, 0, t, t + duration))
                timeline.runs.append(Run(i, t, t + o, p + 1, p + o))
        end = t + duration
        first_wait = t if queue else (arrive[nxt_arrival] if nxt_arrival < len(order) else end)
        if first_wait < end:
            unused = timeline.capacity - len(batch) * size
            timeline.slot_steps["external"] += unused * (end - first_wait)
            timeline.waiting_steps += end - first_wait
            timeline.waiting.append((first_wait, end))
        t = end
    timeline.num_steps = t


def _run_paged(requests, order, arrive, timeline: Timeline, record: bool) -> None:
    """vLLM's loop, one decoding step at a time (see :class:`_PagedPool` for each step)."""
    pool = _PagedPool(requests, timeline, record)
    queue: deque[int] = deque()
    t, nxt_arrival = 0, 0
    while nxt_arrival < len(order) or queue or pool.running:
        while nxt_arrival < len(order) and arrive[nxt_arrival] <= t:
            queue.append(order[nxt_arrival])
            nxt_arrival += 1
        if not queue and not pool.running:
            t = arrive[nxt_arrival]  # idle until the next arrival
            continue
        pool.grow_running(queue, t)
        pool.admit(queue, t)
        pool.account(bool(queue), t)
        t += 1
        pool.finish(t)
    timeline.num_steps = t
    if record:
        timeline.waiting = _merge(timeline.waiting)


class _PagedPool:
    """The block pool of the ``paged`` policy and the requests running in it.

    A running request ``i`` has produced ``done[i]`` tokens; during the next step it
    stores ``prompt[i] + done[i] + 1`` token states and holds ``blocks[i]`` blocks.
    Arrays are numpy so a step over hundreds of running requests stays cheap.
    """

    def __init__(self, requests: Sequence[Request], timeline: Timeline, record: bool):
        self.timeline, self.record, self.bs = timeline, record, timeline.block_size
        self.prompt = np.array([r.prompt_len for r in requests], dtype=np.int64)
        self.out = np.array([r.output_len for r in requests], dtype=np.int64)
        self.final = self.prompt + self.out
        self.done = np.zeros(len(requests), dtype=np.int64)  # kept across preemptions
        self.blocks = np.zeros(len(requests), dtype=np.int64)
        self.num_free = timeline.capacity // self.bs
        self.running: list[int] = []  # admission order: the newest is last
        # Only for record=True (the memory map): which physical block, since when.
        self.free_list: deque[int] = deque(range(self.num_free))
        self.held_ids: dict[int, list[tuple[int, int]]] = {}
        self.run_start: dict[int, tuple[int, int]] = {}

    def blocks_for_next_token(self, ids: np.ndarray) -> np.ndarray:
        return cdiv(self.prompt[ids] + self.done[ids] + 1, self.bs)

    def grow_running(self, queue: deque[int], t: int) -> None:
        """Step 1: every running request writes one more token; a full last block means a
        new one. If the pool is short, preempt the newest request (recompute): it frees
        its blocks and waits at the head of the queue."""
        need = self.blocks_for_next_token(np.array(self.running, dtype=np.int64)) \
            - self.blocks[self.running]
        total = int(need.sum())
        while total > self.num_free:
            victim = self.running.pop()
            total -= int(need[len(self.running)])
            self.timeline.preemptions += 1
            self.timeline.preempted[victim] += 1
            self.timeline.recomputed_tokens += int(self.prompt[victim] + self.done[victim])
            self.release(victim, t)
            queue.appendleft(victim)
        for k, i in enumerate(self.running):
            if need[k]:
                self.grab(i, int(need[k]), t)

    def admit(self, queue: deque[int], t: int) -> None:
        """Step 2: first come, first served: admit the queue's head while the blocks for
        its prompt (and the tokens it already produced) plus this step's token are free."""
        while queue:
            i = queue[0]
            want = int(self.blocks_for_next_token(np.array([i]))[0])
            if want > self.num_free:
                break
            queue.popleft()
            self.grab(i, want, t)
            self.running.append(i)
            if self.record:
                self.run_start[i] = (t, int(self.prompt[i] + self.done[i]) + 1)

    def account(self, someone_waits: bool, t: int) -> None:
        """Step 3: add this step's slots to the four categories."""
        ids = np.array(self.running, dtype=np.int64)
        tokens = self.prompt[ids] + self.done[ids] + 1
        held = self.blocks[ids] * self.bs
        will_use = np.minimum(held, self.final[ids])
        steps = self.timeline.slot_steps
        steps["token_states"] += int(tokens.sum())
        steps["reserved"] += int((will_use - tokens).sum())
        steps["internal"] += int((held - will_use).sum())
        if someone_waits:  # free blocks (and a pool tail too small for a block) go unused
            steps["external"] += self.num_free * self.bs + self.timeline.capacity % self.bs
            self.timeline.waiting_steps += 1
            if self.record:
                self.timeline.waiting.append((t, t + 1))

    def finish(self, t: int) -> None:
        """Step 4: everyone produced a token; finished requests leave and free their
        blocks."""
        ids = np.array(self.running, dtype=np.int64)
        self.done[ids] += 1
        if np.any(self.done[ids] == self.out[ids]):
            for i in [i for i in self.running if self.done[i] == self.out[i]]:
                self.release(i, t)
            self.running = [i for i in self.running if self.done[i] < self.out[i]]

    def grab(self, i: int, count: int, t: int) -> None:
        self.num_free -= count
        self.blocks[i] += count
        if self.record:
            self.held_ids.setdefault(i, []).extend(
                (self.free_list.popleft(), t) for _ in range(count))

    def release(self, i: int, t: int) -> None:
        self.num_free += int(self.blocks[i])
        self.blocks[i] = 0
        if self.record:
            for logical, (b, since) in enumerate(self.held_ids.pop(i)):
                self.timeline.allocations.append(
                    Alloc(i, b * self.bs, self.bs, logical * self.bs, since, t))
                self.free_list.append(b)
            start, tokens0 = self.run_start.pop(i)
            self.timeline.runs.append(Run(i, start, t, tokens0, int(self.final[i])))


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in intervals:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged
