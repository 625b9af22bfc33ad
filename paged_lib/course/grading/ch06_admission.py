"""Chapter 06's admission exercises (re-exported by :mod:`paged_lib.course.grading.ch06`).

* 06.2 ``num_required_blocks``: the free blocks a waiting group takes, on fresh requests
  (one sequence, ``n`` samples to come), sequences preempted by recompute, and groups of
  several sequences preempted by recompute (the prompt once, each tail, the part-filled
  prompt block's copies), against :func:`paged_lib.engine.block_manager.num_required_blocks`.
  A wrong count is named by recomputing the typical wrong rules on the case.
* 06.3 ``can_admit``: the admission decision on the spec's example and boundary cases of
  each limit (watermark, free blocks, ``max_num_seqs``, ``max_num_batched_tokens``),
  steps already holding decodes and empty ones, groups of several samples; then every
  question the engine asks (replayed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paged_lib.course import grading
from paged_lib.course.grading import generated, replay
from paged_lib.course.grading.generated import small_engine
from paged_lib.engine.block_manager import num_required_blocks as lib_required
from paged_lib.engine.policy import Budget
from paged_lib.engine.policy import can_admit as lib_can_admit
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from paged_lib.util import cdiv

# ------------------------------------------------------------------ 06.2 num_required_blocks


def make_group(prompt_len: int, outputs: list[int], n: int = 1,
               finished: tuple[int, ...] = ()) -> SequenceGroup:
    """A waiting group: one sequence per entry of ``outputs`` (its generated length);
    sequences listed in ``finished`` are done. ``outputs == [0]`` is a fresh request."""
    prompt = [(7 * t + 3) % 251 for t in range(prompt_len)]
    seqs = [Sequence(i, prompt, [(11 * i + t) % 251 for t in range(k)])
            for i, k in enumerate(outputs)]
    for i in finished:
        seqs[i].status = SequenceStatus.FINISHED
    return SequenceGroup(0, seqs, SamplingParams(max_tokens=64, n=n,
                                                 temperature=1.0 if n > 1 else 0.0))


#: (what, prompt length, generated per sequence, n, finished sequences, block size)
_GROUPS: list[tuple[str, int, list[int], int, tuple[int, ...], int]] = [
    ("a fresh request, prompt of 6", 6, [0], 1, (), 4),
    ("a fresh request of n=4 samples, prompt of 6", 6, [0], 4, (), 4),
    ("one sequence preempted by recompute: prompt 6, 5 generated", 6, [5], 1, (), 4),
    ("3 samples preempted by recompute: prompt 5, 3 generated each", 5, [3, 3, 3], 3, (), 4),
    ("3 samples preempted by recompute, prompt of 8 fills its blocks: tails 2, 5, 1", 8,
     [2, 5, 1], 3, (), 4),
    ("3 samples preempted by recompute, one of them finished: prompt 5, tails 4, 9, 2", 5,
     [4, 9, 2], 3, (1,), 4),
]


def _shared(prompt: int, tails: list[int], bs: int, copies: int) -> int:
    base = cdiv(prompt, bs)
    return base + sum(cdiv(prompt + t, bs) - base for t in tails) + copies


def _prompt_len(group: SequenceGroup) -> int:
    return len(group.prompt_token_ids)


def _tails(group: SequenceGroup, live: bool = True) -> list[int]:
    seqs = group.live_seqs() if live else group.seqs
    return [s.num_tokens - _prompt_len(group) for s in seqs]


#: The typical wrong rules: (name, rule, hint). The first whose answer equals the
#: learner's on a failing case names the mistake.
_WRONG_RULES: list[tuple[str, Callable[[SequenceGroup, int], int], str]] = [
    ("per sample", lambda g, bs: g.params.num_seqs * cdiv(_prompt_len(g), bs)
     if len(g.seqs) == 1 and g.params.num_seqs > 1 else -1,
     "a fresh group prefills its prompt once, in one sequence: its n samples fork it "
     "afterwards and share those blocks, so the prompt's blocks count once, not once per "
     "sample"),
    ("prompt only", lambda g, bs: cdiv(_prompt_len(g), bs) if len(g.live_seqs()) == 1 else -1,
     "a sequence preempted by recompute prefills its whole text again: the prompt *and* "
     "the tokens it generated need blocks"),
    ("rounds down", lambda g, bs: g.live_seqs()[0].num_tokens // bs
     if len(g.live_seqs()) == 1 else -1,
     "the partly filled last block counts too: ceil(tokens / block_size), in integers"),
    ("no sharing", lambda g, bs: sum(cdiv(s.num_tokens, bs) for s in g.live_seqs()),
     "a group preempted by recompute gets its prompt back once, shared by all its "
     "sequences: count the prompt's blocks once, then each sequence's own tail"),
    ("no copy-on-write", lambda g, bs: _shared(_prompt_len(g), _tails(g), bs, 0),
     "forgot the copy-on-write of the part-filled last prompt block: every sequence that "
     "writes its tail into it copies it first (all but the last one holding it)"),
    ("copy for all", lambda g, bs: _shared(_prompt_len(g), _tails(g), bs,
                                           len(g.live_seqs()) * bool(_prompt_len(g) % bs)),
     "one copy too many: the last sequence to write into the shared part-filled prompt "
     "block finds it no longer shared and writes in place (copies = sequences - 1)"),
    ("finished too", lambda g, bs: _shared(_prompt_len(g), _tails(g, live=False), bs,
                                           (len(g.seqs) - 1) * bool(_prompt_len(g) % bs)),
     "finished sequences take no blocks: count only group.live_seqs()"),
]


def check_num_required_blocks(num_required_blocks: Callable[..., Any]) -> None:
    """``num_required_blocks(group, block_size) -> int``."""
    with grading.exercise("06.2"):
        for what, prompt, outputs, n, finished, bs in _GROUPS:
            group = make_group(prompt, outputs, n, finished)
            want = lib_required(group, bs)
            got = num_required_blocks(group, bs)
            where = f"group '{what}' (block size {bs})"
            grading.expect_int(got, where)
            grading.expect_true([s.num_tokens for s in group.seqs] == [prompt + k for k in
                                                                      outputs],
                                f"{where}: your function changed the group",
                                "only count: the scheduler allocates after admission")
            if got != want:
                grading.fail(f"{where}: expected {want} blocks, got {got}", _name_rule(
                    group, bs, got))
        replay.check_replay("num_required_blocks", num_required_blocks,
                            lambda call, got: _name_rule(*call.args, got))
        generated.check("num_required_blocks", num_required_blocks, "a fresh request: its "
                        "prompt's blocks; a group of several: the prompt once, each tail's "
                        "blocks past it, and the part-filled prompt block's copies")
        small_engine.required_stage(num_required_blocks, _name_rule)  # samples agree


def _name_rule(group: SequenceGroup, block_size: int, got: int) -> str:
    for _, rule, hint in _WRONG_RULES:
        if rule(group, block_size) == got:
            return hint
    return ("a fresh request: its prompt's blocks; a single sequence: its whole text's; a "
            "group of several: the prompt once, each tail's blocks past it, and the "
            "part-filled prompt block's copies")


# ------------------------------------------------------------------ 06.3 can_admit


def _budget(free, watermark=0, num_seqs=0, max_num_seqs=256, tokens=0, max_tokens=4096):
    return Budget(free, watermark, num_seqs, max_num_seqs, tokens, max_tokens)


#: The spec's example step: 20 free, watermark 2, 5 decodes (5 tokens) of 8 / 512.
_SPEC = dict(free=20, watermark=2, num_seqs=5, max_num_seqs=8, tokens=5, max_tokens=512)

#: (what, blocks_needed, num_seqs, num_tokens, budget, hint if the answer is wrong)
_ADMISSION_CASES = [
    ("the spec's example: a request of 100 tokens needing 13 blocks", 13, 1, 100,
     _budget(**_SPEC),
     "a group whose blocks leave the watermark free and that keeps the step within both "
     "limits joins"),
    ("the spec's example: the same request with n=4 samples", 13, 4, 100, _budget(**_SPEC),
     "the step already holds 5 sequences and the group brings 4 (its samples run "
     "together): 9, past max_num_seqs of 8"),
    ("the spec's example: a request needing 19 blocks", 19, 1, 100, _budget(**_SPEC),
     "after taking 19 of the 20 free blocks only 1 stays free, less than the watermark "
     "of 2: admission never takes the watermark's blocks"),
    ("10 free, watermark 1, the step holds 3 decodes, a group needing 9 (exactly the "
     "watermark stays free)", 9, 1, 70, _budget(10, 1, num_seqs=3, tokens=3),
     "off by one at the watermark: leaving exactly watermark_blocks free is allowed"),
    ("an empty step (nothing running), 10 free, watermark 1, a group needing 10", 10, 1,
     70, _budget(10, 1),
     "the watermark holds in an empty step too: can_admit never lets a group into it "
     "(letting a lone request that needs the whole pool in is the admission loop's "
     "decision, exercise 06.4)"),
    ("10 free, watermark 1, a group of 4 samples needing 7 blocks", 7, 4, 30,
     _budget(10, 1),
     "blocks_needed already counts the whole group (exercise 06.2), and the watermark is "
     "kept once for the pool: neither grows with the group's sequences"),
    ("max_num_seqs 4, the step holds 3, a group of 1", 2, 1, 10,
     _budget(50, 1, num_seqs=3, max_num_seqs=4),
     "reaching max_num_seqs exactly is allowed: that step is the one vLLM profiled"),
    ("max_num_seqs 4, the step holds 2, a group of 3 samples", 2, 3, 10,
     _budget(50, 1, num_seqs=2, max_num_seqs=4),
     "a group brings num_seqs sequences (all its samples run together), not 1"),
    ("max_num_batched_tokens 100, the step holds 60, 40 more", 5, 1, 40,
     _budget(50, 1, tokens=60, max_tokens=100),
     "reaching max_num_batched_tokens exactly is allowed: that step is the one vLLM "
     "profiled"),
    ("max_num_batched_tokens 100, the step holds 60, 41 more", 5, 1, 41,
     _budget(50, 1, tokens=60, max_tokens=100),
     "the step already holds 60 tokens: 41 more make 101, past max_num_batched_tokens "
     "of 100"),
    ("max_num_batched_tokens 100, the step holds 60, a group of 4 samples with a "
     "30-token prompt", 3, 4, 30, _budget(50, 1, tokens=60, max_tokens=100),
     "num_tokens is what the group computes this step: its samples fork the prompt after "
     "one prefill, they do not each compute it"),
]


def check_can_admit(can_admit: Callable[..., Any]) -> None:
    """``can_admit(blocks_needed, num_seqs, num_tokens, budget) -> bool``."""
    with grading.exercise("06.3"):
        for what, need, seqs, tokens, budget, hint in _ADMISSION_CASES:
            want = lib_can_admit(need, seqs, tokens, budget)
            got = can_admit(need, seqs, tokens, budget)
            grading.expect_true(type(got) is bool,
                                f"case '{what}': returned {got!r} ({type(got).__name__}), "
                                "expected a bool",
                                "return True or False (a comparison's result), not a "
                                "number or None")
            grading.expect_equal(got, want, f"case '{what}' with {budget}", hint)
        replay.check_replay("can_admit", can_admit,
                            "the engine asks with what its steps really leave: decodes' "
                            "tokens and sequences already counted, blocks a chunked prompt "
                            "holds, a watermark; look at which of the free blocks, the "
                            "sequences and the tokens decides this answer")
        generated.check("can_admit", can_admit, "after its blocks at least watermark_blocks "
                        "stay free, and the step's sequences and tokens (those already in "
                        "it, decodes included, plus the group's) stay within their maximums")
