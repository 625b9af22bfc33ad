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
  request reserves one contiguous chunk of ``max_len``, the next power of two of its final
  length, or exactly its final length, first-fit in a linear address space.
* ``buddy``: the oracle length reserved from a binary buddy allocator (the paper's own Orca
  implementation assumes one); the round-up to a power of two is internal fragmentation.
* ``paged``: vLLM: ``block_size``-token blocks allocated on demand from a free list; when a
  running request needs a block and none is free, the most recently admitted request is
  preempted (recompute: its blocks are freed and it waits at the head of the queue).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

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


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


def reservation(policy: str, num_tokens: int, final_len: int, block_size: int = 16,
                max_len: int = 2048) -> int:
    """Slots a request holds under ``policy`` while it stores ``num_tokens`` token states
    and will end with ``final_len``."""
    if policy in ("static-max", "orca-max"):
        return max_len
    if policy in ("orca-pow2", "buddy"):
        return next_pow2(final_len)
    if policy == "orca-oracle":
        return final_len
    if policy == "paged":
        return -(-num_tokens // block_size) * block_size
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")


def request_slots(policy: str, num_tokens: int, final_len: int, block_size: int = 16,
                  max_len: int = 2048) -> tuple[int, int, int]:
    """(token states, reserved, internal) slots of one running request right now.

    Reserved slots are held slots the request will still fill (up to its final length);
    internal fragmentation is every held slot past the final length.
    """
    if not 1 <= num_tokens <= final_len:
        raise ValueError(f"need 1 <= num_tokens <= final_len, got {num_tokens} and {final_len}")
    held = reservation(policy, num_tokens, final_len, block_size, max_len)
    will_use = min(held, final_len)
    return num_tokens, will_use - num_tokens, held - will_use


# ---------------------------------------------------------------- allocators


class FirstFit:
    """Contiguous chunks in a linear address space: the first hole that fits wins."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.holes: list[list[int]] = [[0, capacity]]  # [start, size], sorted by start
        self.free_slots = capacity

    def alloc(self, size: int) -> tuple[int, int] | None:
        """(address, slots held) of a new chunk, or None when no hole is big enough."""
        for i, (start, hole) in enumerate(self.holes):
            if hole >= size:
                if hole == size:
                    del self.holes[i]
                else:
                    self.holes[i] = [start + size, hole - size]
                self.free_slots -= size
                return start, size
        return None

    def free(self, addr: int, size: int) -> None:
        i = bisect.bisect_left(self.holes, [addr, 0])
        self.holes.insert(i, [addr, size])
        self.free_slots += size
        if i + 1 < len(self.holes) and addr + size == self.holes[i + 1][0]:  # merge right
            self.holes[i][1] += self.holes.pop(i + 1)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == addr:  # merge left
            self.holes[i - 1][1] += self.holes.pop(i)[1]


class Buddy:
    """Binary buddy allocator: blocks of 2**k slots aligned to their size; a freed block
    merges with its buddy (address XOR size) whenever that buddy is free too."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free_lists: dict[int, set[int]] = {}
        self.free_slots = capacity
        addr = 0
        for k in range(capacity.bit_length() - 1, -1, -1):  # aligned power-of-two pieces
            if capacity >> k & 1:
                self.free_lists.setdefault(k, set()).add(addr)
                addr += 1 << k
        self.largest_block = 1 << (capacity.bit_length() - 1)

    def alloc(self, size: int) -> tuple[int, int] | None:
        k = (size - 1).bit_length()
        for j in range(k, self.capacity.bit_length()):
            if self.free_lists.get(j):
                addr = min(self.free_lists[j])
                self.free_lists[j].remove(addr)
                while j > k:  # split, keep the lower half
                    j -= 1
                    self.free_lists.setdefault(j, set()).add(addr + (1 << j))
                self.free_slots -= 1 << k
                return addr, 1 << k
        return None

    def free(self, addr: int, size: int) -> None:
        k = (size - 1).bit_length()
        self.free_slots += 1 << k
        while addr ^ (1 << k) in self.free_lists.get(k, ()):
            self.free_lists[k].remove(addr ^ (1 << k))
            addr = min(addr, addr ^ (1 << k))
            k += 1
        self.free_lists.setdefault(k, set()).add(addr)


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
    ``breakdown``; ``allocations`` and ``runs`` are filled when ``record=True``."""

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

    def state_map(self) -> tuple[np.ndarray, np.ndarray]:
        """(owner, state), both ``[capacity, num_steps]``: the request holding each slot at
        each step (-1: free) and its category: 0 idle, 1 token state, 2 reserved,
        3 internal, 4 external (free while a request waits). Needs ``record=True``."""
        cells = self.capacity * self.num_steps
        if cells > 20_000_000:
            raise ValueError(f"state_map is for small traces: {self.capacity} slots x "
                             f"{self.num_steps} steps is too big")
        owner = np.full((self.capacity, self.num_steps), -1, dtype=np.int32)
        state = np.zeros((self.capacity, self.num_steps), dtype=np.int8)
        for t0, t1 in self.waiting:
            state[:, t0:t1] = 4
        tokens = {}  # request -> tokens stored at each step (-1: not running)
        for r in self.runs:
            row = tokens.setdefault(r.request, np.full(self.num_steps, -1, dtype=np.int64))
            row[r.start:r.end] = r.tokens0 + np.arange(r.end - r.start)
        final = {r.request: r.final_len for r in self.runs}
        for a in self.allocations:
            tok = tokens[a.request][a.start:a.end][None, :]
            pos = (a.logical + np.arange(a.size))[:, None]
            code = np.where(pos < tok, 1, np.where(pos < final[a.request], 2, 3))
            code = np.where(tok < 0, 3, code)  # finished but still held (static batch)
            owner[a.slot:a.slot + a.size, a.start:a.end] = a.request
            state[a.slot:a.slot + a.size, a.start:a.end] = code
        return owner, state


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
    owned which slots when, for :meth:`Timeline.state_map` and the memory-map picture)."""
    _validate(requests, policy, capacity_tokens, block_size, max_len)
    tl = Timeline(policy, capacity_tokens, block_size, max_len)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    arrive = [max(0, math.ceil(requests[i].arrival)) for i in order]
    if policy == "static-max":
        _run_static(requests, order, arrive, tl, record)
    elif policy == "paged":
        _run_paged(requests, order, arrive, tl, record)
    else:
        _run_contiguous(requests, order, arrive, tl, record)
    return tl


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
        held = reservation(policy, length, length, block_size, max_len)
        if held > limit or length > capacity:
            raise ValueError(f"request {i} ({length} tokens, {held} slots under {policy}) "
                             f"cannot fit in a pool of {capacity} slots")


def _add_run(tl: Timeline, i: int, p: int, o: int, held: int) -> None:
    """Slot-steps of a contiguous request admitted with ``held`` slots, running o steps."""
    length = p + o
    tokens = o * p + o * (o + 1) // 2
    tl.slot_steps["token_states"] += tokens
    tl.slot_steps["reserved"] += o * length - tokens
    tl.slot_steps["internal"] += o * (held - length)


def _run_contiguous(requests, order, arrive, tl: Timeline, record: bool) -> None:
    pool = Buddy(tl.capacity) if tl.policy == "buddy" else FirstFit(tl.capacity)
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
            got = pool.alloc(reservation(tl.policy, p + o, p + o, tl.block_size, tl.max_len))
            if got is None:
                break
            queue.popleft()
            addr, held = got
            heapq.heappush(running, (t + o, i, addr, held))
            _add_run(tl, i, p, o, held)
            if record:
                tl.allocations.append(Alloc(i, addr, held, 0, t, t + o))
                tl.runs.append(Run(i, t, t + o, p + 1, p + o))
        nxt = min(running[0][0] if running else math.inf,
                  arrive[nxt_arrival] if nxt_arrival < len(order) else math.inf)
        if nxt == math.inf:
            break
        if queue:
            tl.slot_steps["external"] += pool.free_slots * (nxt - t)
            tl.waiting_steps += nxt - t
            tl.waiting.append((t, nxt))
        t = nxt
    tl.num_steps = t


def _run_static(requests, order, arrive, tl: Timeline, record: bool) -> None:
    slots = tl.capacity // tl.max_len
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
            _add_run(tl, i, p, o, tl.max_len)
            tl.slot_steps["internal"] += tl.max_len * (duration - o)  # done, slot still held
            if record:
                tl.allocations.append(Alloc(i, k * tl.max_len, tl.max_len, 0, t, t + duration))
                tl.runs.append(Run(i, t, t + o, p + 1, p + o))
        end = t + duration
        first_wait = t if queue else (arrive[nxt_arrival] if nxt_arrival < len(order) else end)
        if first_wait < end:
            tl.slot_steps["external"] += (tl.capacity - len(batch) * tl.max_len) * (end -
                                                                                  first_wait)
            tl.waiting_steps += end - first_wait
            tl.waiting.append((first_wait, end))
        t = end
    tl.num_steps = t


def _run_paged(requests, order, arrive, tl: Timeline, record: bool) -> None:
    bs = tl.block_size
    num_blocks = tl.capacity // bs
    n = len(requests)
    prompt = np.array([r.prompt_len for r in requests], dtype=np.int64)
    out = np.array([r.output_len for r in requests], dtype=np.int64)
    final = prompt + out
    done = np.zeros(n, dtype=np.int64)  # output tokens produced so far (kept on preemption)
    blocks = np.zeros(n, dtype=np.int64)  # blocks held now
    free = num_blocks
    free_list: deque[int] = deque(range(num_blocks))
    held_ids: dict[int, list[tuple[int, int]]] = {}  # request -> [(block, since step)]
    run_start: dict[int, tuple[int, int]] = {}  # request -> (step, tokens then)
    running: list[int] = []  # admission order
    queue: deque[int] = deque()
    t, nxt_arrival = 0, 0

    def release(i: int, step: int) -> None:
        nonlocal free
        free += int(blocks[i])
        blocks[i] = 0
        if record:
            for lb, (b, since) in enumerate(held_ids.pop(i)):
                tl.allocations.append(Alloc(i, b * bs, bs, lb * bs, since, step))
                free_list.append(b)
            s, tok0 = run_start.pop(i)
            tl.runs.append(Run(i, s, step, tok0, int(final[i])))

    def grab(i: int, count: int, step: int) -> None:
        nonlocal free
        free -= count
        blocks[i] += count
        if record:
            held_ids.setdefault(i, []).extend((free_list.popleft(), step) for _ in range(count))

    while nxt_arrival < len(order) or queue or running:
        while nxt_arrival < len(order) and arrive[nxt_arrival] <= t:
            queue.append(order[nxt_arrival])
            nxt_arrival += 1
        if not queue and not running:
            t = arrive[nxt_arrival]
            continue
        # 1. running requests write one more token; a full last block means a new block
        ids = np.array(running, dtype=np.int64)
        need = -(-(prompt[ids] + done[ids] + 1) // bs) - blocks[ids]
        total = int(need.sum())
        while total > free:  # preempt the newest request (recompute): back to the queue head
            victim = running.pop()
            total -= int(need[len(running)])
            release(victim, t)
            queue.appendleft(victim)
            tl.preemptions += 1
        for k, i in enumerate(running):
            if need[k]:
                grab(i, int(need[k]), t)
        # 2. admit from the queue head while its prompt (plus this step's token) fits
        while queue:
            i = queue[0]
            want = -(-(int(prompt[i] + done[i]) + 1) // bs)
            if want > free:
                break
            queue.popleft()
            grab(i, want, t)
            running.append(i)
            if record:
                run_start[i] = (t, int(prompt[i] + done[i]) + 1)
        # 3. account this step
        ids = np.array(running, dtype=np.int64)
        tokens = prompt[ids] + done[ids] + 1
        held = blocks[ids] * bs
        will_use = np.minimum(held, final[ids])
        tl.slot_steps["token_states"] += int(tokens.sum())
        tl.slot_steps["reserved"] += int((will_use - tokens).sum())
        tl.slot_steps["internal"] += int((held - will_use).sum())
        if queue:
            tl.slot_steps["external"] += free * bs + tl.capacity % bs
            tl.waiting_steps += 1
            if record:
                tl.waiting.append((t, t + 1))
        # 4. everyone produced a token; finished requests leave
        done[ids] += 1
        t += 1
        if np.any(done[ids] == out[ids]):
            for i in [i for i in running if done[i] == out[i]]:
                release(i, t)
            running = [i for i in running if done[i] < out[i]]
    tl.num_steps = t
    if record:
        tl.waiting = _merge(tl.waiting)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in intervals:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged
