"""Checks for chapter 4 (attention over blocks): 04.1 and 04.2 run the generated cases of
:mod:`.generated.small_attention`, 04.2 on caches that watch every block read
(:mod:`paged_lib.instruments.block_reads`); 04.3 is a quiz."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric, small_attention
from paged_lib.course.grading.slips import decode_slips, expect_attention
from paged_lib.instruments import block_reads
from paged_lib.util import cdiv


def check_merge_states(merge_states: Callable) -> None:
    """04.1: merging two blocks' (m, l, acc) equals the state of both blocks together."""
    def typed(a: tuple, b: tuple) -> object:  # a float64 constant promotes float32 states
        got = merge_states(a, b)
        for name, g in zip(("m", "l", "acc"), got if isinstance(got, tuple | list) else (),
                           strict=False):
            grading.expect_true(not isinstance(g, torch.Tensor) or g.dtype == a[0].dtype,
                                f"{name}: expected dtype {a[0].dtype} (the states'), got "
                                f"{getattr(g, 'dtype', None)}", hint="compute in the states' "
                                "own dtype: no float64 constant or .double() mixed in")
        return got

    with grading.exercise("04.1"):
        numeric.check("04.1", small_attention.merge_cases(), lambda p: small_attention.run_merge(
            typed, p), small_attention.MERGE_CONTRASTS + (numeric.Contrast(
            lambda p: dataclasses.replace(p, two_dims=False) if p.two_dims else None,
            "it passes with one leading dimension and fails with two: m and l are [...], acc "
            "[..., d]; give a weight acc's last axis with w[..., None] (not w[:, None])"),))


def check_paged_online(paged_decode: Callable) -> None:
    """04.2: one sequence's decode attention, one block at a time, through its block table
    (gathering all tokens first, or a softmax over the whole score row, fails)."""
    with grading.exercise("04.2"):
        numeric.check("04.2", small_attention.paged_cases(), lambda p: _paged_case(
            paged_decode, p), small_attention.PAGED_CONTRASTS)


def _paged_case(paged_decode: Callable, p: small_attention.Paged) -> None:
    q, k, v, table, n, scale, ref = p.build()
    what = f"seq_len={n}, heads {q.shape[0]}/{k.shape[2]} (query/KV), block_size={k.shape[1]}"
    got = _run_watched(paged_decode, q.clone(), k, v, table, n, scale, what)
    grading.expect_true(isinstance(got, torch.Tensor),
                        f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    got = got.as_subclass(torch.Tensor)
    grading.expect_true(got.dtype == q.dtype, f"{what}: expected dtype {q.dtype}, "
                        f"got {got.dtype}", hint="compute in q's dtype")
    overflow = ("exp of a raw score overflows beyond 709: keep a running max m, exponentiate "
                "scores - m and rescale l and acc by exp(m_old - m_new) when m grows")
    expect_attention(
        got, ref, what, 1e-9,
        lambda: {name: out[0] for name, out in decode_slips(q[None], k, v, [table], [n],
                                                            scale).items()},
        "compare with the spec element by element: each query head's softmax over this "
        "sequence's first seq_len keys (times the scale you are given), times its values",
        loud=overflow if p.loud > 1 else None, poison=small_attention.BELOW_HINT if p.below else
        "mask the last block's slots at or past seq_len: score -inf AND value 0 (0 * NaN is NaN); "
        "a full last block (seq_len % block_size == 0) has block_size slots in use, not 0")


def _run_watched(paged_decode: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 table: list[int], n: int, scale: float, what: str) -> torch.Tensor:
    k_watch, v_watch, log = block_reads.watch(k, v, q.shape[0])
    error = None
    with block_reads.active(log):
        try:
            got = paged_decode(q, k_watch, v_watch, torch.tensor(table).int(), n, scale)
        except NotImplementedError:
            raise
        except Exception as err:  # report a broken read rule before the crash it caused
            error = err
    if log.problem is None and error is None:
        block_reads.check_order(log, table[:cdiv(n, k.shape[1])])
    if log.problem is not None:
        grading.fail(f"{what}: {log.problem}", log.hint)
    if isinstance(error, IndexError) and q.shape[0] > k.shape[2] and \
            str(error).endswith(f"size {k.shape[2]}"):  # a query head's index as a KV head's
        grading.fail(f"{what}: your function raised IndexError: {error}", "query head h "
                     "reads KV head h // (num_heads // num_kv_heads), not h // num_kv_heads")
    if error is not None:
        raise error
    return got


#: Exercise 04.3: statement, answer ("flash", "paged" or "both"), hint if wrong.
#: "paged" means the vLLM paper's PagedAttention *and vLLM's own CUDA kernels* (v1: one
#: sequence's logits in shared memory, a two-pass softmax; v2: 512-token partitions and a
#: reduce kernel); the online softmax belongs to FlashAttention and the FlashAttention-,
#: FlashInfer- and Triton-style paged kernels that combine the two.
STATEMENTS: list[tuple[str, str, str]] = [
    ("Was designed to cut the traffic between GPU memory (HBM) and on-chip SRAM while "
     "computing attention over one contiguous sequence.", "flash",
     "which one was designed around SRAM vs HBM bandwidth?"),
    ("Stores a sequence's keys and values in fixed-size blocks that need not be contiguous.",
     "paged", "this is about *where* K/V live"),
    ("Its kernel never holds a whole row of scores: a running max and sum are merged tile by "
     "tile (the online softmax).", "flash",
     "vLLM's own kernels are not like that: v1 keeps the logits of a sequence in shared "
     "memory and runs a two-pass max/sum softmax; v2 adds partitions and a reduce"),
    ("Its original kernel (vLLM v1) keeps one sequence's logits in shared memory and "
     "computes the softmax in two passes: first the max, then the sum.", "paged",
     "which paper's own CUDA kernel is described here?"),
    ("Its saving is KV-cache capacity: no reservation for the maximum length, at most one "
     "partly filled block per sequence.", "paged", "think of fragmentation"),
    ("Lets two sequences share the same physical K/V memory (parallel sampling, beam "
     "search).", "paged", "sharing needs an indirection: a table that can point twice"),
    ("Gives the same output as the naive softmax attention, up to rounding.", "both",
     "is either of them an approximation?"),
    ("Needs a per-sequence table to find the physical location of token t's key.", "paged",
     "which one adds an indirection?"),
    ("In its original form, assumes each sequence's K/V is one contiguous tensor.", "flash",
     "which one was written before KV caches were paged?"),
    ("Is part of the kernels vLLM runs today through its FlashAttention, FlashInfer and "
     "Triton backends (online softmax over K/V read through a block table).", "both",
     "those backends are FlashAttention-style kernels that read a paged cache"),
]


def statements() -> str:
    """The statements of exercise 04.3, numbered, for the notebook to print."""
    return "\n".join(f"{i}. {text}" for i, (text, _, _) in enumerate(STATEMENTS, 1))


def check_flash_vs_paged(classify: Callable[[], dict[int, str]]) -> None:
    """04.3: classify each statement as "flash", "paged" or "both"."""
    with grading.exercise("04.3"):
        answers, count = classify(), len(STATEMENTS)
        grading.expect_true(isinstance(answers, dict), f"expected a dict {{statement number: "
                            f"answer}}, got {type(answers).__name__}", hint=f"return {{1: "
                            f"'flash', 2: ..., {count}: ...}}: the keys are the statement "
                            "numbers, so a list's order is not relied on")
        text_keys = [k for k in answers if isinstance(k, str)]
        if text_keys:
            grading.fail(f"the keys are strings, like {text_keys[0]!r}",
                         hint=f"the keys are the statement numbers as ints, 1 .. {count}")
        missing = [i for i in range(1, count + 1) if i not in answers]
        if 0 in answers and missing == [count]:
            grading.fail(f"no answer for statement {count}; an answer for statement 0",
                         hint=f"the statements are numbered from 1 (as printed), not from "
                              f"0: keys 1 .. {count}")
        grading.expect_true(not missing, f"no answer for statement(s) {missing}",
                            hint=f"keys are 1 .. {count}")
        wrong = []
        for i, (_, answer, hint) in enumerate(STATEMENTS, 1):
            got = str(answers[i]).strip().lower()
            grading.expect_true(got in ("flash", "paged", "both"), f"statement {i}: answer "
                                f"{answers[i]!r} is not one of 'flash', 'paged', 'both'",
                                hint="answer with one of the three words exactly: 'flash' "
                                     "(FlashAttention only), 'paged' (PagedAttention only) "
                                     "or 'both'")
            wrong += [(i, got, hint)] * (got != answer)
        if wrong:
            i, got, hint = wrong[0]
            grading.fail(f"{count - len(wrong)} of {count} right; statement {i} is not "
                         f"{got!r}", hint)
