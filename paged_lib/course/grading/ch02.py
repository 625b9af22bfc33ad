"""Checks for chapter 02 (where KV memory goes): 02.1 and 02.3 compare a dict with the
answers below; 02.2, 02.4 and 02.5 run the generated cases of :mod:`.generated.small_sim`,
02.5 after six traces built around one rule each."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from paged_lib.course import grading
from paged_lib.course.grading import slips
from paged_lib.course.grading.generated import numeric, small_sim
from paged_lib.fragmentation import request_slots
from paged_lib.workloads import Request

_SET_AGAIN = ("a request's blocks are set when it is admitted (again, after a preemption), "
              "before anything reads them")
#: Mutants of the solution that compute the same thing (see ``tools/mutants.py``).
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {"02.5": {
    "constant: `0` -> `-1` in `arrivals = deque((max(0, math.ceil(requests[i].arrival)), "
    "i) for i in order)`": "time starts at step 0, so a request whose arrival step is -1 "
    "joins the queue at step 0 exactly as one at step 0 does",
    "constant: `0` -> `-1` in `t = 0`": "with nothing queued or running at step -1, time "
    "jumps to the first arrival, as it does from step 0",
    "drop: `if not queue and (not running):` -> `pass` in `if not queue and not running:`":
        "without the jump, the steps before the next arrival run empty: nothing is counted, "
        "and the step count comes out the same",
    **dict.fromkeys(["drop: `blocks[i] = 0` -> `pass`", "constant: `0` -> `1` in `blocks[i] = "
                     "0`"], "a finished request never runs again, so what its entry says is "
                    "never read"),
    **dict.fromkeys(["constant: `0` -> `-1` in `blocks = [0] * len(requests)`", "drop: "
                     "`blocks[victim] = 0` -> `pass`"] + [f"constant: `0` -> `{x}` in `blocks["
                                                         "victim] = 0`" for x in ("-1", "1")],
                    _SET_AGAIN),
}}

WASTE_KINDS = ("reserved", "internal", "external")

#: 02.1: the kinds of waste each mechanism removes (to nothing, or under a block per request)
MECHANISMS: dict[str, set[str]] = {
    "allocate on demand": {"reserved", "internal"},
    "equal-size blocks through a block table": {"external"},
    "reserve exactly the final length, first-fit (Orca Oracle)": {"internal"},
    "round the output up to a power of two (Orca Pow2)": set(),
}

MECHANISM_HINTS = {
    "allocate on demand": "a block is taken only when the previous one is full: nothing is "
    "held for future tokens, and what is never used is at most the rest of the last block. It "
    "does not say *where* memory comes from, so alone it does not fix external fragmentation.",
    "equal-size blocks through a block table": "any free block can hold any request's next "
    "block: external fragmentation is gone. Block size alone says nothing about reserving "
    "ahead.",
    "reserve exactly the final length, first-fit (Orca Oracle)": "first-fit hands out exactly "
    "the final length L: no internal fragmentation; but the slots for future tokens are still "
    "held from the start (reserved), and chunks of different sizes leave holes (external). "
    "(A buddy allocator would round L up to a power of two: internal fragmentation again.)",
    "round the output up to a power of two (Orca Pow2)": "it shrinks the over-reservation "
    "(at most 2x the output, not max_len) but removes none of the three: slots past the end, "
    "reserved future tokens and chunks of different sizes all remain.",
}


def check_waste_removed(fn: Callable[[], dict[str, set[str]]]) -> None:
    with grading.exercise("02.1"):
        grading.expect_dict(got := fn(), MECHANISMS, "return {mechanism: {kinds}}, with the "
                            "mechanism names exactly as given in the dict stub")
        for mech, want in MECHANISMS.items():
            grading.expect_true(got[mech] is not None, f"{mech!r}: None",
                                hint="a mechanism that removes no kind of waste gets an empty "
                                     "set, set(), not None")
            answer = {got[mech]} if isinstance(got[mech], str) else set(got[mech])
            unknown = answer - set(WASTE_KINDS)
            grading.expect_true(not unknown, f"{mech!r}: unknown waste kind(s) "
                                f"{sorted(unknown)}", hint=f"use only {WASTE_KINDS}")
            grading.expect_equal(sorted(answer), sorted(want), what=repr(mech),
                                 hint=MECHANISM_HINTS[mech])


def _as_triple(got: object, what: str) -> tuple[int, ...]:
    grading.expect_true(isinstance(got, tuple | list | np.ndarray) and len(got) == 3,
                        f"{what}: expected a tuple (token_states, reserved, internal), "
                        f"got {got!r}", hint="return three numbers")
    for v in got:
        grading.expect_int(v, f"{what}: {got!r}")
    return tuple(int(v) for v in got)


def _slots_hint(got: tuple[int, ...], want: tuple[int, ...], max_len: int) -> str:
    if got[0] != want[0]:
        return "token states = num_tokens: the slots that hold a token now, no more, no less."
    if sum(got) != sum(want):
        return (f"Orca (Max) holds max_len = {max_len} slots from admission to the end, its "
                f"last step (when it stores its final length) included.")
    if got[1] == want[1] + want[2] or got[2] == want[1] + want[2]:
        return ("split the free slots: those below the final length will be filled later "
                "(reserved); those at or past it never will (internal).")
    return ("token states = num_tokens; reserved = held slots the request will still fill "
            "(up to final_len); internal = the rest.")


def _check_slots(fn: Callable[[int, int, int], object], n: int, length: int,
                 max_len: int) -> None:
    want = request_slots("orca-max", n, length, max_len=max_len)
    what = f"{n} token{'s' * (n != 1)} stored, final length {length}, max_len={max_len}"
    got = _as_triple(fn(n, length, max_len), what)
    grading.expect_equal(got, want, what=what, hint=_slots_hint(got, want, max_len))


def check_orca_max_slots(fn: Callable[[int, int, int], object]) -> None:
    with grading.exercise("02.2"):
        numeric.check("02.2", small_sim.slot_cases(), lambda p: _check_slots(fn, *p.args))


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


def _snapshot_slips(case: tuple) -> dict[str, Any]:
    """hint -> what that typical wrong snapshot returns for ``case``."""
    p, o, step, slots = case

    def total(d: int = 0, kept: bool = False) -> tuple[int, ...]:
        """Running requests (and, ``kept``, finished ones at their end) with d more tokens."""
        n = [(x + min(step, y - 1 if kept else step) + 1 + d, x + y) for x, y in zip(
            p, o, strict=True) if step < y or kept]
        return tuple(map(sum, zip((0, 0, 0), *(slots(*a) for a in n if 1 <= a[0] <= a[1]),
                                  strict=True)))
    return {
        "a request takes part while step < output_len; finished ones have left and hold "
        "nothing.": total(kept=True),
        "during step s (counting from 0) a request stores prompt + s + 1 tokens: its prompt "
        "plus the token being produced.": total(-1),
        "during step s (counting from 0) a request stores prompt + s + 1 tokens, those of "
        "step s, not of step s - 1.": batch_snapshot(p, o, step - 1, slots) if step else None,
        "a snapshot is the totals during this one step, not summed over steps 0 .. step.":
            tuple(map(sum, zip(*(batch_snapshot(p, o, s, slots) for s in range(step + 1)),
                               strict=True))),
    }


def _checked_slots(slots, prompt_lens, output_lens, step):
    """``slots`` as the learner gets it: a call for a request past its end fails, named."""
    finals = {p + o for p, o in zip(prompt_lens, output_lens, strict=True)}

    def checked(num_tokens, final_len):
        if not 1 <= num_tokens <= final_len:
            if final_len not in finals and final_len in output_lens:
                hint = ("final_len is the request's whole length, prompt + output (not the "
                        "output alone).")
            else:
                hint = ("a running request stores prompt + step + 1 tokens, never more "
                        "than its final length prompt + output: it takes part only while "
                        "step < output_len (step counts from 0).")
            grading.fail(f"at step {step} your function asked slots({num_tokens}, "
                         f"{final_len}): {num_tokens} tokens for a request of final length "
                         f"{final_len}", hint)
        return slots(num_tokens, final_len)
    return checked


def check_batch_snapshot(fn: Callable[..., object]) -> None:
    def mine(p, o, step, slots) -> tuple[int, ...]:
        return _as_triple(fn(p[:], o[:], step, _checked_slots(slots, p, o, step)), "the snapshot")

    def run(*case: Any) -> None:
        got, want = mine(*case), batch_snapshot(*case)
        if got != want:
            grading.fail(f"the snapshot: expected {want}, got {got}", slips.name_mistake(
                case, got, want, [b.args() for b in small_sim.batch_cases()], _snapshot_slips,
                lambda c: mine(*c), "a request takes part while step < output_len; sum the "
                "slots over those only."))

    with grading.exercise("02.4"):
        numeric.check("02.4", small_sim.batch_cases(), lambda p: run(*p.args()), (numeric.Contrast(
            lambda p: dataclasses.replace(p, requests=tuple((x + 100 * i, o) for i, (x, o) in
                                                            enumerate(p.requests))), (
            "it passes once every request has a prompt length of its own: two requests of the "
            "same length (samples of one prompt) are still two requests, each counted; a dict "
            "or a set keyed by length keeps one")),))


def derivation_answers() -> dict[str, int | bool]:
    """The true answers of 02.3. Pool of 1024 slots, max_len 512, blocks of 16; A (100 +
    200), B (50 + 150) and C (200 + 200) arrive at step 0; first-fit puts A at 0, B at 300,
    C at 500. At step 150 (from 0) B has just left; A and C store prompt + 151 tokens;
    D (100 + 150) arrives."""
    return {
        "max: slots A never uses": 512 - 300,
        "oracle: free slots": 1024 - 300 - 400,
        "oracle: largest hole": 200,  # B's old chunk; the tail after C is 124
        "oracle: external fragmentation": 324,  # D needs one hole of 250: all free is waste
        "paged: blocks A holds": 16,  # cdiv(251, 16)
        "paged: free blocks": 64 - 16 - 22,  # C: cdiv(351, 16)
        "paged: D admitted": True,  # cdiv(101, 16) = 7 blocks, any 7
        "paged: empty slots held": 5 + 1,  # 16 x 16 - 251 and 22 x 16 - 351
    }


DERIVATION_HINTS = {
    "max: slots A never uses": "Orca (Max) holds max_len slots for A from admission to the end; "
    "A ends at prompt + output: the rest is internal fragmentation, from reserving the maximum",
    "oracle: free slots": "when B leaves, its chunk is free again: add it to the slots no one "
    "ever took",
    "oracle: largest hole": "free slots are not one piece: B's old chunk and the tail after C "
    "are two holes. A chunk must fit in one hole",
    "oracle: external fragmentation": "D needs one contiguous chunk of its final length; if no "
    "single hole is that big, D waits and every free slot counts as external fragmentation",
    "paged: blocks A holds": "during step s (from 0) A stores prompt + s + 1 tokens; blocks are "
    "whole: round up (cdiv)",
    "paged: free blocks": "the pool has 1024 // 16 blocks; B has left; A and C hold the blocks "
    "for the tokens they store now, nothing more",
    "paged: D admitted": "D needs the blocks for its prompt plus the token it produces in its "
    "first step; any free blocks will do, wherever they are",
    "paged: empty slots held": "each running request leaves only the rest of its last block "
    "empty: blocks x 16 - tokens (prompt + s + 1 during step s), for A and C",
}


def check_derivation(derive: Callable[[], dict[str, Any]]) -> None:
    with grading.exercise("02.3"):
        got, answers = derive(), derivation_answers()
        grading.expect_dict(got, answers, f"use exactly the keys {list(answers)}")
        for key, want in answers.items():
            mine = got[key]
            if isinstance(want, bool):
                grading.expect_true(isinstance(mine, bool | np.bool_), f"{key}: expected True or "
                                    f"False, got {mine!r}", DERIVATION_HINTS[key])
            else:
                grading.expect_int(mine, key)
            grading.expect_equal(mine, want, key, DERIVATION_HINTS[key])


# name, requests, capacity, block size, hint when this trace (the first to fail) differs
SIM_TRACES: list[tuple[str, list[Request], int, int, str]] = [
    ("one request alone: prompt 5, output 6, pool of 64, blocks of 4",
     [Request(5, 6, 0.0)], 64, 4,
     "during its k-th step (k = 1 .. output_len) a running request stores prompt_len + k "
     "token states and holds ceil(tokens / block_size) blocks, taken one at a time as the "
     "last fills; nobody waits, so nothing is external; arriving at 0.0, it joins at step "
     "ceil(0.0) = 0 and leaves after step 5: num_steps 6"),
    ("a late arrival listed first: it arrives at 2.3, the other at 1.0 (pool of 9, blocks of 4)",
     [Request(2, 1, 2.3), Request(3, 2, 1.0)], 9, 4,
     "requests join the queue in order of arrival, not of the list; one arriving at time a "
     "joins at step ceil(a) (2.3: step 3; round(a) and int(a) say 2); when nothing runs and "
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
    ("two preemptions in one step (all three join at step 1; pool of 8, blocks of 2)",
     [Request(1, 2, 0.2), Request(3, 2, 0.5), Request(1, 4, 1.0)], 8, 2,
     "each victim goes to the head of the queue as it is preempted: of two preempted in one "
     "step, the one admitted earlier (preempted second) ends up first, in front of the other"),
]


def check_paged_simulator(simulate_paged: Callable[..., Any]) -> None:
    with grading.exercise("02.5"):
        for name, requests, capacity, block_size, hint in SIM_TRACES:
            small_sim.run_paged(simulate_paged, requests, capacity, block_size, hint, name)
        small_sim.trace_stage(simulate_paged)
