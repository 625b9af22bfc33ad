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

Three modules, one job each: :mod:`.request` (the slots one request holds under a policy
at one step), :mod:`.timeline` (what a run saw: the four categories' slot-steps and, for
the memory map, who held which slots when) and :mod:`.simulators` (the serving loops, one
per kind of allocator). The contiguous allocators live in :mod:`paged_lib.contiguous`; the
memory-map picture (which request held which slot at each step) in
:mod:`paged_lib.course.viz.fragmentation`.
"""

from paged_lib.fragmentation.request import POLICIES, request_slots, reservation
from paged_lib.fragmentation.simulators import simulate, simulate_timeline
from paged_lib.fragmentation.timeline import (
    CATEGORIES,
    PAPER_FIG2,
    PAPER_NAMES,
    Alloc,
    Breakdown,
    Run,
    Timeline,
)

__all__ = ["CATEGORIES", "PAPER_FIG2", "PAPER_NAMES", "POLICIES", "Alloc", "Breakdown", "Run",
           "Timeline", "request_slots", "reservation", "simulate", "simulate_timeline"]
