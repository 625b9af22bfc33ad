"""A CPU tier under the GPU's KV blocks, simulated: LRU vs CLOCK (chapter 11; pure Python).

Between the turns of a conversation its K/V blocks wait: nobody reads them until the
user's next message. When GPU blocks run short, the blocks of waiting requests move to
CPU memory, and come back to the GPU before a request that reads them runs (each is
copied back at its request's start, ahead of the forward pass: no page faults, no
attention reading host memory). A block the CPU tier has no room for is dropped: its
K/V must be computed again.

:func:`simulate` replays a trace, one request at a time. A request is the list of its
blocks, named by what they hold (e.g. the chained hashes of
:func:`~paged_lib.engine.prefix_cache.block_hashes`), all on the GPU while it runs
(pinned). Each block a request reads is a GPU hit, a CPU hit (copied in), a miss
(recomputed: it was dropped) or new (never seen). Which waiting block leaves a full tier
is the policy's choice:

* ``"lru"`` evicts the block used longest ago (a linked order, moved on every use);
* ``"clock"`` (second chance) keeps one reference bit per frame, set on every use; a
  hand sweeps the frames, clears set bits and evicts the first block whose bit is clear.
  CLOCK approximates LRU without reordering anything on a hit.

Both tiers use the same policy. :func:`chat_trace` turns chapter 10's multi-turn chat
workload (:func:`~paged_lib.studies.prefix_workloads.multi_turn_chat`, synthetic and seeded)
into such a trace; :func:`compare_policies` runs both policies on one.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from paged_lib.engine.prefix_cache import block_hashes
from paged_lib.studies.prefix_workloads import multi_turn_chat

POLICIES = ("lru", "clock")


class LRU:
    """Blocks in order of last use; the victim is the oldest one not pinned."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, key: Hashable) -> None:
        if len(self._order) >= self.capacity:
            raise ValueError(f"LRU tier of {self.capacity} blocks is full: evict first")
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def victim(self, pinned: set) -> Hashable:
        for key in self._order:
            if key not in pinned:
                return key
        raise ValueError(f"all {len(self._order)} blocks are pinned: nothing to evict")


class Clock:
    """``capacity`` frames in a circle, a reference bit each, a hand (second chance).

    A block enters the lowest free frame with its bit set (it is being used); a hit sets
    the bit. :meth:`victim` sweeps from the hand: a pinned block is passed, a set bit is
    cleared and passed, the first clear bit is the victim; the hand stops just past it.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.frames: list[Hashable | None] = [None] * capacity
        self.ref: dict[Hashable, bool] = {}
        self._frame_of: dict[Hashable, int] = {}
        self.hand = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._frame_of

    def __len__(self) -> int:
        return len(self._frame_of)

    def insert(self, key: Hashable) -> None:
        if len(self._frame_of) >= self.capacity:
            raise ValueError(f"CLOCK tier of {self.capacity} blocks is full: evict first")
        frame = self.frames.index(None)
        self.frames[frame] = key
        self._frame_of[key] = frame
        self.ref[key] = True

    def touch(self, key: Hashable) -> None:
        self.ref[key] = True

    def remove(self, key: Hashable) -> None:
        self.frames[self._frame_of.pop(key)] = None
        del self.ref[key]

    def victim(self, pinned: set) -> Hashable:
        for _ in range(2 * self.capacity + 1):  # two sweeps clear every bit
            key = self.frames[self.hand]
            self.hand = (self.hand + 1) % self.capacity
            if key is None or key in pinned:
                continue
            if self.ref[key]:
                self.ref[key] = False
                continue
            return key
        raise ValueError(f"all {len(self)} blocks are pinned: nothing to evict")


@dataclass
class TierStats:
    """What a replay did. ``reused`` counts block reads of blocks seen before (the
    chances to hit): ``gpu_hits + cpu_hits + misses == reused``."""

    policy: str
    requests: int = 0
    reused: int = 0
    gpu_hits: int = 0
    cpu_hits: int = 0
    misses: int = 0
    new: int = 0
    blocks_to_cpu: int = 0
    blocks_to_gpu: int = 0
    dropped: int = 0
    bytes_moved: int = 0
    peak_gpu: int = 0
    peak_cpu: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of reused blocks found in either tier (not recomputed)."""
        return (self.gpu_hits + self.cpu_hits) / self.reused if self.reused else 0.0

    @property
    def gpu_hit_rate(self) -> float:
        """Share of reused blocks already on the GPU (nothing copied)."""
        return self.gpu_hits / self.reused if self.reused else 0.0


def _tier(policy: str, capacity: int):
    return (LRU if policy == "lru" else Clock)(capacity)


def simulate(trace: list[list[Hashable]], gpu_blocks: int, cpu_blocks: int,
             policy: str = "lru", block_bytes: int = 1) -> TierStats:
    """Replay ``trace`` (each request: the blocks it reads or writes) over a GPU tier of
    ``gpu_blocks`` and a CPU tier of ``cpu_blocks`` (0: no CPU tier, evicted blocks are
    dropped). ``bytes_moved`` is every block copied either way times ``block_bytes``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, v, low in (("gpu_blocks", gpu_blocks, 1), ("cpu_blocks", cpu_blocks, 0),
                         ("block_bytes", block_bytes, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    for i, request in enumerate(trace):
        if len(set(request)) > gpu_blocks:
            raise ValueError(f"request {i} needs {len(set(request))} blocks on the GPU at "
                             f"once, more than the {gpu_blocks} there are")
    gpu, cpu = _tier(policy, gpu_blocks), _tier(policy, max(cpu_blocks, 1))
    stats, seen = TierStats(policy), set()

    def make_room(pinned: set) -> None:
        if len(gpu) < gpu_blocks:
            return
        out = gpu.victim(pinned)
        gpu.remove(out)
        if cpu_blocks == 0:
            stats.dropped += 1
            return
        if len(cpu) == cpu_blocks:
            cpu.remove(cpu.victim(set()))
            stats.dropped += 1
        cpu.insert(out)
        stats.blocks_to_cpu += 1

    for request in trace:
        pinned = set(request)
        for key in dict.fromkeys(request):  # each block once, in order
            if key in gpu:
                stats.gpu_hits += 1
                gpu.touch(key)
            else:
                if key in cpu:
                    stats.cpu_hits += 1
                    stats.blocks_to_gpu += 1
                    cpu.remove(key)
                elif key in seen:
                    stats.misses += 1
                else:
                    stats.new += 1
                make_room(pinned)
                gpu.insert(key)
            stats.reused += key in seen
            seen.add(key)
            stats.peak_gpu, stats.peak_cpu = max(stats.peak_gpu, len(gpu)), \
                max(stats.peak_cpu, len(cpu))
        stats.requests += 1
    stats.bytes_moved = (stats.blocks_to_cpu + stats.blocks_to_gpu) * block_bytes
    return stats


def chat_trace(block_size: int = 16, order: str = "round_robin",
               **chat) -> list[list[Hashable]]:
    """Chapter 10's interleaved multi-turn chat (:func:`~paged_lib.studies.prefix_workloads.
    multi_turn_chat`, keywords passed on) as a block trace: each turn reads its prompt's
    full blocks and writes its answer's, named by their chained hashes (a part-filled
    last block is not kept, as in vLLM's prefix cache).

    ``order="round_robin"``: turn ``t`` of every conversation, then turn ``t + 1`` (the
    workload's own order: every reuse waits for all the other conversations);
    ``"random"``: each next request is the next turn of a conversation drawn at random
    among those with turns left (seeded with the workload's ``seed``), so conversations
    move at different paces.
    """
    if order not in ("round_robin", "random"):
        raise ValueError(f"order must be 'round_robin' or 'random', got {order!r}")
    trace = [block_hashes(r.prompt + r.output, block_size) for r in multi_turn_chat(**chat)]
    if order == "round_robin":
        return trace
    defaults = inspect.signature(multi_turn_chat).parameters
    convs = chat.get("num_conversations", defaults["num_conversations"].default)
    turns = [trace[c::convs] for c in range(convs)]  # each conversation's turns, in order
    rng = np.random.default_rng(chat.get("seed", defaults["seed"].default))
    out = []
    while any(turns):
        left = [c for c in range(convs) if turns[c]]
        out.append(turns[left[int(rng.integers(len(left)))]].pop(0))
    return out


def compare_policies(trace: list[list[Hashable]], gpu_blocks: int, cpu_blocks: int,
                     block_bytes: int = 1) -> dict[str, TierStats]:
    """:func:`simulate` with each policy of :data:`POLICIES` on the same trace."""
    return {p: simulate(trace, gpu_blocks, cpu_blocks, p, block_bytes) for p in POLICIES}
