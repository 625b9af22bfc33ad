"""Checks for chapter 02 (where KV memory goes). Each prints one verdict line.

The right answers, the traces and the hints they are checked against are
:mod:`paged_lib.course.grading.ch02_answers`; this module holds the checks (which name
the mistake from how an answer differs) and the chapter's demo.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from paged_lib.course import grading
from paged_lib.course.grading.ch02_answers import (
    DERIVATION_HINTS,
    DERIVATION_KEYS,
    MECHANISM_HINTS,
    MECHANISMS,
    SIM_KEYS,
    SIM_TRACES,
    WASTE_KINDS,
    batch_snapshot,
    derivation_answers,
    reference_paged,
)
from paged_lib.course.grading.generated import small_sim
from paged_lib.fragmentation import request_slots
from paged_lib.workloads import sharegpt_like

#: Mutants of the solution that compute the same thing (see ``tools/mutants.py``).
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {
    "02.5": {
        "constant: `0` -> `-1` in `arrivals = deque((max(0, math.ceil(requests[i].arrival)), "
        "i) for i in order)`":
            "time starts at step 0, so a request whose arrival step is -1 joins the queue at "
            "step 0 exactly as one at step 0 does",
    },
}

def check_waste_removed(fn: Callable[[], dict[str, set[str]]]) -> None:
    """02.1: mechanism -> set of waste kinds it removes."""
    with grading.exercise("02.1"):
        got = fn()
        grading.expect_true(isinstance(got, dict), f"expected a dict, got "
                            f"{type(got).__name__}", hint="return {mechanism: {kinds}}")
        missing = [m for m in MECHANISMS if m not in got]
        grading.expect_true(not missing, f"no answer for {missing}",
                            hint="use the mechanism names exactly as given in the dict stub")
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
    what = f"{n} tokens stored, final length {length}, max_len={max_len}"
    got = _as_triple(fn(n, length, max_len), what)
    grading.expect_equal(got, want, what=what, hint=_slots_hint(got, want, max_len))


def check_orca_max_slots(fn: Callable[[int, int, int], object]) -> None:
    """02.2: (token_states, reserved, internal) of one Orca (Max) request."""
    with grading.exercise("02.2"):
        for n, length, max_len in [(261, 499, 2048), (1, 500, 512), (16, 40, 40)]:
            _check_slots(fn, n, length, max_len)
        small_sim.slot_stage(lambda *args: _check_slots(fn, *args))  # generated: last steps


def _snapshot_hint(p, o, step, slots, got) -> str:
    """Name the slip from the wrong totals it produced."""
    def total(d: int = 0, kept: bool = False) -> tuple[int, ...]:
        """Running requests (and, ``kept``, finished ones at their end) with d more tokens."""
        n = [(x + min(step, y - 1 if kept else step) + 1 + d, x + y) for x, y in zip(
            p, o, strict=True) if step < y or kept]
        return tuple(map(sum, zip((0, 0, 0), *(slots(*a) for a in n if 1 <= a[0] <= a[1]),
                                  strict=True)))
    if got == total(kept=True):
        return ("a request takes part while step < output_len; finished ones have left and "
                "hold nothing.")
    if got in (total(-1), total(1)) or step and got == batch_snapshot(p, o, step - 1, slots):
        return ("during step s (counting from 0) a request stores prompt + s + 1 tokens: its "
                "prompt plus the token being produced.")
    if step and got == tuple(map(sum, zip(*(batch_snapshot(p, o, s, slots) for s in range(
            step + 1)), strict=True))):
        return "a snapshot is the totals during this one step, not summed over steps 0 .. step."
    return "a request takes part while step < output_len; sum the slots over those only."


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


def _check_snapshot(fn: Callable[..., object], what: str, slots, p, o, step) -> None:
    got = _as_triple(fn(p, o, step, _checked_slots(slots, p, o, step)), what)
    want = batch_snapshot(p, o, step, slots)
    hint = _snapshot_hint(p, o, step, slots, got) if got != want else None
    grading.expect_equal(got, want, what=what, hint=hint)


def check_batch_snapshot(fn: Callable[..., object], block_size: int = 16) -> None:
    """02.4: totals over a batch at one step, then the claim "paging wastes less than one
    block per running request" checked at every step with the learner's function."""
    rng = np.random.default_rng(2)
    prompts = [int(v) for v in rng.integers(1, 300, size=12)]
    outputs = [int(v) for v in rng.integers(1, 400, size=12)]
    policies = {
        "paged": lambda n, length: request_slots("paged", n, length, block_size=block_size),
        "orca-max": lambda n, length: request_slots("orca-max", n, length, max_len=2048),
    }
    with grading.exercise("02.4"):
        for name, slots in policies.items():
            for p, o, step in [([10], [5], 0), ([10], [5], 4), ([10], [5], 5),
                               ([16, 1, 30], [1, 16, 3], 0), ([16, 1, 30], [1, 16, 3], 2)]:
                _check_snapshot(fn, f"{name} snapshot of prompts {p}, outputs {o} at step "
                                    f"{step}", slots, p, o, step)
        small_sim.batch_stage(lambda p, o, step, slots: _check_snapshot(
            fn, "the snapshot", slots, p, o, step))  # generated: tied prompt lengths, edges
        slots = policies["paged"]
        for step in range(max(outputs)):
            running = sum(step < o for o in outputs)
            _, reserved, internal = _as_triple(
                fn(prompts, outputs, step, _checked_slots(slots, prompts, outputs, step)),
                "snapshot")
            grading.expect_true(reserved + internal < block_size * running,
                                f"at step {step}, {running} running requests waste "
                                f"{reserved + internal} slots, not less than one "
                                f"{block_size}-slot block each")


# ------------------------------------------------------------------ 02.3 the derivation

def check_derivation(derive: Callable[[], dict[str, Any]]) -> None:
    """02.3: ``derive() -> dict`` with the keys of :data:`DERIVATION_KEYS`."""
    with grading.exercise("02.3"):
        got = derive()
        grading.expect_true(isinstance(got, dict), f"derive() returned "
                            f"{type(got).__name__}, expected a dict",
                            f"use the keys {list(DERIVATION_KEYS)}")
        missing = [k for k in DERIVATION_KEYS if k not in got]
        grading.expect_true(not missing, f"missing keys: {missing}",
                            f"use exactly the keys {list(DERIVATION_KEYS)}")
        for key, want in derivation_answers().items():
            mine = got[key]
            if isinstance(want, bool):
                grading.expect_true(isinstance(mine, bool), f"{key}: expected True or "
                                    f"False, got {mine!r}", DERIVATION_HINTS[key])
            else:
                grading.expect_int(mine, key)
            grading.expect_equal(mine, want, key, DERIVATION_HINTS[key])


# ------------------------------------------------------------------ 02.5 the simulator

#: Seconds a learner's simulator may take on one trace (the solution needs well under 1).
SIM_TIME_LIMIT_S = 10.0

@contextlib.contextmanager
def _time_limit(seconds: float, what: str) -> Iterator[None]:
    """Stop a learner's loop that never ends (a request that never finishes, a queue that
    never moves) with a verdict instead of a hung notebook. Main thread, Unix only."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not \
            threading.main_thread():
        yield
        return

    def stop(*_: Any) -> None:
        grading.fail(f"{what}: still running after {seconds:.0f} s",
                     "a loop that never ends: does every running request finish after "
                     "output_len steps and give its blocks back, and does time move on "
                     "when nothing can be admitted?")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_paged_simulator(simulate_paged: Callable[..., Any]) -> None:
    """02.5: ``simulate_paged(requests, capacity_tokens, block_size) -> dict``."""
    with grading.exercise("02.5"):
        for name, requests, capacity, block_size, hint in SIM_TRACES:
            want = reference_paged(requests, capacity, block_size)
            with _time_limit(SIM_TIME_LIMIT_S, name):
                got = simulate_paged(list(requests), capacity, block_size)
            grading.expect_true(isinstance(got, dict), f"{name}: expected a dict, got "
                                f"{type(got).__name__}", f"return a dict with keys {SIM_KEYS}")
            missing = [k for k in SIM_KEYS if k not in got]
            grading.expect_true(not missing, f"{name}: missing keys {missing}",
                                f"return a dict with keys {SIM_KEYS}")
            for key in SIM_KEYS:
                grading.expect_int(got[key], f"{name}: {key}")
            wrong = [k for k in SIM_KEYS if got[k] != want[k]]
            if wrong:
                shown = ", ".join(f"{k} {want[k]} (yours {got[k]})" for k in wrong)
                grading.fail(f"{name}: expected {shown}", hint)
        small_sim.trace_stage(simulate_paged, lambda what: _time_limit(SIM_TIME_LIMIT_S, what))


def a100_slots() -> int:
    """The paper's Fig. 2 pool: OPT-13B's KV slots on a 40 GB A100 (chapter 02's cell)."""
    from paged_lib import accounting

    opt = accounting.SPECS["opt-13b"]
    return (40 * accounting.GiB - accounting.weight_bytes(opt)) // \
        accounting.kv_bytes_per_token(opt)


def run_demo(simulate_paged: Callable[..., Any]) -> Any:
    """The chapter's Fig. 2 experiment with the learner's simulator as the paged policy."""
    from paged_lib.course.viz import fragmentation as viz
    from paged_lib.fragmentation import Breakdown, simulate

    requests = sharegpt_like(600, seed=0)
    slots = a100_slots()
    got = grading.on_learner_code(lambda: simulate_paged(requests, slots, 16),
                                  "exercise 02.5", "the chapter's vLLM bar from your simulator")
    if got is None:
        return None
    total = sum(got[c] for c in ("token_states", "reserved", "internal", "external"))
    yours = Breakdown(*(got[c] / total for c in ("token_states", "reserved", "internal",
                                                  "external")))
    same = {k: got[k] for k in SIM_KEYS} == reference_paged(requests, slots, 16)
    print(f"your simulator: {yours.token_states:.1%} token states, {got['preemptions']} "
          f"preemptions, {got['num_steps']} steps "
          f"({'the same as' if same else 'different from'} the library's)")
    results = {p: simulate(requests, p, slots) for p in ("orca-max", "orca-pow2",
                                                        "orca-oracle")}
    results["paged"] = yours
    return viz.plot_breakdown(results, title="Fig. 2 with your paged simulator")
