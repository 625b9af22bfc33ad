"""Checks for chapter 02 (where KV memory goes). Each prints one verdict line."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from paged_lib import grading
from paged_lib.fragmentation import request_slots

WASTE_KINDS = ("reserved", "internal", "external")

#: Exercise 02.1: which kinds of waste each mechanism removes (reduces to nothing, or to
#: less than one block per request).
MECHANISMS: dict[str, set[str]] = {
    "allocate on demand": {"reserved", "internal"},
    "equal-size blocks through a block table": {"external"},
    "reserve exactly the final length (Orca Oracle)": {"internal"},
    "round reservations up to a power of two (Orca Pow2)": set(),
}

_MECHANISM_HINTS = {
    "allocate on demand": (
        "a block is taken only when the previous one is full: nothing is held for tokens "
        "not yet produced, and what is never used is at most the rest of the last block. "
        "It does not say *where* memory comes from, so alone it does not fix external "
        "fragmentation."),
    "equal-size blocks through a block table": (
        "any free block can hold any request's next block, so a free block is never too "
        "small or in the wrong place: that is external fragmentation gone. Block size "
        "alone says nothing about reserving ahead."),
    "reserve exactly the final length (Orca Oracle)": (
        "an oracle reserves L slots, so no slot is past the end (no internal "
        "fragmentation); but the slots for future tokens are still held from the start "
        "(reserved), and chunks of different sizes still leave holes (external)."),
    "round reservations up to a power of two (Orca Pow2)": (
        "rounding up to a power of two shrinks the over-reservation (at most 2x the final "
        "length instead of max_len) but removes none of the three: slots past the end "
        "remain, future tokens are still reserved, and chunk sizes still differ."),
}


def check_waste_removed(fn: Callable[[], dict[str, set[str]]]) -> None:
    """02.1: mechanism -> set of waste kinds it removes."""
    with grading.exercise("02.1", "Which waste each mechanism removes"):
        got = fn()
        grading.expect_true(isinstance(got, dict), f"expected a dict, got "
                            f"{type(got).__name__}", hint="return {mechanism: {kinds}}")
        missing = [m for m in MECHANISMS if m not in got]
        grading.expect_true(not missing, f"no answer for {missing}",
                            hint="use the mechanism names exactly as given in the dict stub")
        for mech, want in MECHANISMS.items():
            answer = got[mech]
            if isinstance(answer, str):
                answer = {answer}
            answer = set(answer)
            unknown = answer - set(WASTE_KINDS)
            grading.expect_true(not unknown, f"{mech!r}: unknown waste kind(s) "
                                f"{sorted(unknown)}", hint=f"use only {WASTE_KINDS}")
            grading.expect_equal(sorted(answer), sorted(want), what=repr(mech),
                                 hint=_MECHANISM_HINTS[mech])


def _as_triple(got: object, what: str) -> tuple[int, ...]:
    grading.expect_true(isinstance(got, tuple | list | np.ndarray) and len(got) == 3,
                        f"{what}: expected a tuple (token_states, reserved, internal), "
                        f"got {got!r}", hint="return three numbers")
    return tuple(int(v) for v in got)


def _slots_hint(policy: str, n: int, length: int, got: tuple[int, ...], want: tuple[int, ...],
                size: int) -> str:
    if sum(got) != sum(want):
        if policy == "orca-max":
            return f"Orca (Max) holds max_len = {size} slots from admission to the end."
        return (f"paging holds whole blocks for the tokens stored now: ceil({n} / {size}) "
                f"blocks = {sum(want)} slots, not more.")
    if got[1] == want[1] + want[2] or got[2] == want[1] + want[2]:
        return ("split the free slots: those below the final length will be filled later "
                "(reserved); those at or past it never will (internal).")
    return ("token states = num_tokens; reserved = held slots the request will still fill "
            "(up to final_len); internal = the rest.")


_SLOT_CASES = [(1, 1), (1, 500), (161, 499), (499, 499), (16, 40), (17, 40), (40, 40),
               (32, 33), (33, 33), (2047, 2048), (2048, 2048), (100, 2000)]


def _check_slots(ex_id: str, title: str, policy: str, fn: Callable[[int, int, int], object],
                 sizes: Sequence[int]) -> None:
    with grading.exercise(ex_id, title):
        for size in sizes:
            for n, length in _SLOT_CASES:
                if length > size and policy == "orca-max":
                    continue
                kw = {"max_len": size} if policy == "orca-max" else {"block_size": size}
                want = request_slots(policy, n, length, **kw)
                what = f"{n} tokens stored, final length {length}, " + \
                       ", ".join(f"{k}={v}" for k, v in kw.items())
                got = _as_triple(fn(n, length, size), what)
                grading.expect_equal(got, want, what=what,
                                     hint=_slots_hint(policy, n, length, got, want, size))


def check_orca_max_slots(fn: Callable[[int, int, int], object]) -> None:
    """02.2: (token_states, reserved, internal) of one Orca (Max) request."""
    _check_slots("02.2", "Orca (Max) accounting", "orca-max", fn, (2048, 512, 40))


def check_paged_slots(fn: Callable[[int, int, int], object]) -> None:
    """02.3: (token_states, reserved, internal) of one paged request."""
    _check_slots("02.3", "Paged accounting", "paged", fn, (16, 1, 7, 256))


def _snapshot(prompt_lens, output_lens, step, slots):
    total = [0, 0, 0]
    for p, o in zip(prompt_lens, output_lens, strict=True):
        if step < o:
            for k, v in enumerate(slots(p + step + 1, p + o)):
                total[k] += v
    return tuple(total)


def check_batch_snapshot(fn: Callable[..., object], block_size: int = 16) -> None:
    """02.4: totals over a batch at one step, then the claim "paging wastes less than one
    block per running request" checked at every step with the learner's function."""
    rng = np.random.default_rng(2)
    prompts = [int(v) for v in rng.integers(1, 300, size=12)]
    outputs = [int(v) for v in rng.integers(1, 400, size=12)]
    cases = [([10], [5], 0), ([10], [5], 4), ([10], [5], 5), ([16, 1, 30], [1, 16, 3], 0),
             ([16, 1, 30], [1, 16, 3], 2), (prompts, outputs, 0), (prompts, outputs, 150),
             (prompts, outputs, 10_000)]
    policies = {
        "paged": lambda n, length: request_slots("paged", n, length, block_size=block_size),
        "orca-max": lambda n, length: request_slots("orca-max", n, length, max_len=2048),
    }
    with grading.exercise("02.4", "A batch snapshot, and less than one block per request"):
        for name, slots in policies.items():
            for p, o, step in cases:
                what = f"{name} snapshot of prompts {p}, outputs {o} at step {step}"
                if len(what) > 120:
                    what = f"{name} snapshot of a batch of {len(p)} requests at step {step}"
                got = _as_triple(fn(p, o, step, slots), what)
                want = _snapshot(p, o, step, slots)
                if got != want and step >= 1 and got == _snapshot(p, o, step - 1, slots):
                    hint = ("during step s (counting from 0) a request stores prompt + s + 1 "
                            "tokens: its prompt plus the token being produced.")
                elif got != want:
                    hint = ("a request takes part while step < output_len; sum the slots "
                            "function over those requests only.")
                else:
                    hint = None
                grading.expect_equal(got, want, what=what, hint=hint)
        slots = policies["paged"]
        for step in range(max(outputs)):
            running = sum(step < o for o in outputs)
            _, reserved, internal = _as_triple(fn(prompts, outputs, step, slots), "snapshot")
            grading.expect_true(reserved + internal < block_size * running,
                                f"at step {step}, {running} running requests waste "
                                f"{reserved + internal} slots, not less than one "
                                f"{block_size}-slot block each")
