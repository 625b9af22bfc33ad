"""The serving loops: one request queue, first come first served, one loop per allocator.

:func:`simulate_timeline` picks the loop for a policy: a static batch of ``max_len`` slots
(``static-max``), one contiguous chunk per request from a first-fit or buddy allocator (the
Orca policies and ``buddy``), or blocks on demand with recompute preemption (``paged``). Each
loop adds every step's slots to a :class:`~paged_lib.fragmentation.timeline.Timeline` (the
categories are defined in :mod:`paged_lib.fragmentation`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from paged_lib.contiguous import Buddy, FirstFit
from paged_lib.fragmentation.request import POLICIES, reservation
from paged_lib.fragmentation.timeline import Alloc, Breakdown, Run, Timeline
from paged_lib.util import cdiv
from paged_lib.workloads import Request


def simulate(requests: Sequence[Request], policy: str, capacity_tokens: int,
             block_size: int = 16, max_len: int = 2048) -> Breakdown:
    """Time-averaged :class:`Breakdown` of the KV memory ``policy`` holds serving
    ``requests`` from a pool of ``capacity_tokens`` slots (see :mod:`paged_lib.fragmentation`)."""
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
