"""The right answers to chapter 02's exercises, and the hints that explain them.

The checks in :mod:`paged_lib.course.grading.ch02` compare a learner's answer with these:
which waste each mechanism removes (02.1), the worked derivation of why equal blocks on
demand remove both fragmentations (02.3, computed with the course's allocators), and
the traces a paged simulator is replayed on (02.5, answered by the library's simulator).
Each hint says what a wrong answer got wrong, without giving the recipe.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_lib.contiguous import FirstFit
from paged_lib.fragmentation import simulate_timeline
from paged_lib.util import cdiv
from paged_lib.workloads import Request, sharegpt_like, shrink

WASTE_KINDS = ("reserved", "internal", "external")

#: Exercise 02.1: which kinds of waste each mechanism removes (reduces to nothing, or to
#: less than one block per request).
MECHANISMS: dict[str, set[str]] = {
    "allocate on demand": {"reserved", "internal"},
    "equal-size blocks through a block table": {"external"},
    "reserve exactly the final length, first-fit (Orca Oracle)": {"internal"},
    "round the output up to a power of two (Orca Pow2)": set(),
}

MECHANISM_HINTS = {
    "allocate on demand": (
        "a block is taken only when the previous one is full: nothing is held for tokens "
        "not yet produced, and what is never used is at most the rest of the last block. "
        "It does not say *where* memory comes from, so alone it does not fix external "
        "fragmentation."),
    "equal-size blocks through a block table": (
        "any free block can hold any request's next block, so a free block is never too "
        "small or in the wrong place: that is external fragmentation gone. Block size "
        "alone says nothing about reserving ahead."),
    "reserve exactly the final length, first-fit (Orca Oracle)": (
        "an oracle reserves L slots and first-fit hands out exactly L, so no slot is past "
        "the end (no internal fragmentation); but the slots for future tokens are still "
        "held from the start (reserved), and chunks of different sizes still leave holes "
        "(external). On a buddy allocator, as the paper assumes, L is rounded up to a "
        "power of two and internal fragmentation is back: the allocator decides."),
    "round the output up to a power of two (Orca Pow2)": (
        "reserving the prompt plus the output rounded up to a power of two shrinks the "
        "over-reservation (at most 2x the output instead of max_len) but removes none of "
        "the three: slots past the end remain, future tokens are still reserved, and "
        "chunk sizes still differ."),
}



def batch_snapshot(prompt_lens, output_lens, step, slots) -> tuple[int, int, int]:
    """02.4: (token_states, reserved, internal) summed over the requests running at
    ``step`` (from 0): each stores its prompt plus ``step + 1`` tokens, out of its final
    length; ``slots(num_tokens, final_len)`` is one request's triple."""
    total = [0, 0, 0]
    for p, o in zip(prompt_lens, output_lens, strict=True):
        if step < o:
            for k, v in enumerate(slots(p + step + 1, p + o)):
                total[k] += v
    return tuple(total)


# ------------------------------------------------------------------ 02.3 the derivation

DERIVATION_KEYS = (
    "max: slots A never uses", "oracle: free slots", "oracle: largest hole",
    "oracle: external fragmentation", "paged: blocks A holds", "paged: free blocks",
    "paged: D admitted", "paged: empty slots held",
)

# (prompt_len, output_len) of the exercise's requests; all arrive at step 0 except D.
DERIVATION_REQUESTS = {"A": (100, 200), "B": (50, 150), "C": (200, 200), "D": (100, 150)}
DERIVATION_POOL, DERIVATION_MAX_LEN, DERIVATION_BLOCK = 1024, 512, 16


def derivation_answers() -> dict[str, int | bool]:
    """The true answers of 02.3, computed with the course's allocators.

    At step 150 (counting from 0) B has just left; A and C are in their step 150, so each
    stores prompt + 151 token states; D arrives and asks for its room.
    """
    final = {k: p + o for k, (p, o) in DERIVATION_REQUESTS.items()}
    pool = FirstFit(DERIVATION_POOL)
    where = {k: pool.alloc(final[k]) for k in "ABC"}  # Oracle: exact lengths, first-fit
    pool.free(*where["B"])
    step = DERIVATION_REQUESTS["B"][1]
    tokens = {k: DERIVATION_REQUESTS[k][0] + step + 1 for k in "AC"}
    blocks = {k: cdiv(tokens[k], DERIVATION_BLOCK) for k in "AC"}
    free_blocks = DERIVATION_POOL // DERIVATION_BLOCK - sum(blocks.values())
    d_fits_oracle = pool.largest_hole >= final["D"]
    return {
        "max: slots A never uses": DERIVATION_MAX_LEN - final["A"],
        "oracle: free slots": pool.free_slots,
        "oracle: largest hole": pool.largest_hole,
        "oracle: external fragmentation": 0 if d_fits_oracle else pool.free_slots,
        "paged: blocks A holds": blocks["A"],
        "paged: free blocks": free_blocks,
        "paged: D admitted": cdiv(DERIVATION_REQUESTS["D"][0] + 1, DERIVATION_BLOCK)
        <= free_blocks,
        "paged: empty slots held": sum(blocks[k] * DERIVATION_BLOCK - tokens[k] for k in "AC"),
    }


DERIVATION_HINTS = {
    "max: slots A never uses": "Orca (Max) holds max_len slots for A from admission to the "
                               "end; A ends at prompt + output: the rest is internal "
                               "fragmentation, caused by reserving the maximum",
    "oracle: free slots": "when B leaves, its chunk is free again: add it to the slots no "
                          "one ever took",
    "oracle: largest hole": "free slots are not one piece: B's old chunk and the tail after "
                            "C are two holes. A chunk must fit in one hole",
    "oracle: external fragmentation": "D needs one contiguous chunk of its final length; "
                                      "if no single hole is that big, D waits and every "
                                      "free slot counts as external fragmentation",
    "paged: blocks A holds": "during step s (from 0) A stores prompt + s + 1 tokens; blocks "
                             "are whole: round up (cdiv)",
    "paged: free blocks": "the pool has 1024 // 16 blocks; B has left; A and C hold the "
                          "blocks for the tokens they store now, nothing more",
    "paged: D admitted": "D needs the blocks for its prompt plus the token it produces in "
                         "its first step; any free blocks will do, wherever they are",
    "paged: empty slots held": "each running request leaves only the rest of its last "
                               "block empty: blocks x 16 - tokens, for A and C",
}


# ------------------------------------------------------------------ 02.5 the simulator

SIM_KEYS = ("token_states", "reserved", "internal", "external", "num_steps", "preemptions")

# name, requests, capacity, block size, hint when this trace (the first to fail) differs
SIM_TRACES: list[tuple[str, list[Request], int, int, str]] = [
    ("one request alone: prompt 5, output 6, pool of 64, blocks of 4",
     [Request(5, 6, 0.0)], 64, 4,
     "during its k-th step (k = 1 .. output_len) a running request stores prompt_len + k "
     "token states and holds ceil(tokens / block_size) blocks, taken one at a time as the "
     "last fills; nobody waits, so nothing is external"),
    ("a late arrival: the second request arrives at 5.5 (pool of 64, blocks of 4)",
     [Request(3, 2, 0.0), Request(2, 2, 5.5)], 64, 4,
     "a request arriving at time a joins the queue at step ceil(a); when nothing runs and "
     "nothing waits, time jumps to the next arrival (those steps add no slots)"),
    ("a queue: the pool of 14 fits one request at a time (blocks of 4)",
     [Request(6, 4, 0.0), Request(6, 4, 0.0)], 14, 4,
     "at a step when a request is still waiting after admission, every free slot counts "
     "as external (free blocks x block_size, plus capacity % block_size); a finished "
     "request frees its blocks at the end of its last step"),
    ("first come, first served: a long prompt at the head blocks a short one (pool of 24)",
     [Request(10, 4, 0.0), Request(16, 2, 0.0), Request(2, 2, 0.0)], 24, 4,
     "admission is first come, first served: stop at the first queued request whose "
     "blocks (for prompt + tokens already produced + 1) are not free; never skip it"),
    ("preemption: four requests outgrow a pool of 20 slots (blocks of 4)",
     [Request(2, 8, 0.0), Request(5, 8, 1.0), Request(5, 7, 2.0), Request(2, 4, 0.0)], 20, 4,
     "before admitting anyone, give every running request the blocks its next token "
     "needs; if they are short, preempt the most recently admitted running request (free "
     "all its blocks, put it at the head of the queue, keep the tokens it produced) and "
     "retry; count each preemption"),
    ("a small ShareGPT-like trace: 40 requests, lengths / 8, pool of 256, blocks of 4",
     shrink(sharegpt_like(40, seed=3, rate=0.5), 8), 256, 4,
     "compare your loop with the order of the spec: arrivals, grow running (preempt if "
     "short), admit, account, then every running request produces its token and the "
     "finished ones leave"),
]


def reference_paged(requests: Sequence[Request], capacity_tokens: int,
                    block_size: int) -> dict[str, int]:
    """What 02.5 must return, from the library's simulator."""
    timeline = simulate_timeline(requests, "paged", capacity_tokens, block_size,
                                 max_len=max(r.final_len for r in requests))
    return {**timeline.slot_steps, "num_steps": timeline.num_steps,
            "preemptions": timeline.preemptions}
