"""Checks for chapter 4's exercises: attention over blocks.

Each ``check_*`` calls the learner's function on several shapes and edge cases (a block
whose scores are all ``-inf``, one-token sequences, a sequence that fills a block
exactly, NaN-poisoned cache slots) and prints one verdict line. Exercise 04.2 reads its
caches through :mod:`paged_lib.instruments.block_reads`, which sees every block read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_lib import attention as A
from paged_lib.course import grading
from paged_lib.course.grading.generated import small_attention
from paged_lib.course.grading.slips import decode_slips, name_slip
from paged_lib.instruments import block_reads
from paged_lib.kernels.reference import ref_paged_attention
from paged_lib.util import cdiv

NEG_INF = float("-inf")


def _state_of(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(A.block_state(scores, v))


def _expect_state(got, expected, what: str, hint: str) -> None:
    grading.expect_true(isinstance(got, tuple | list) and len(got) == 3,
                        f"{what}: expected a tuple (m, l, acc), got {type(got).__name__}",
                        hint="return m, l, acc")
    for name, g, e in zip(("m", "l", "acc"), got, expected, strict=True):
        if isinstance(g, torch.Tensor) and (g.isnan() & ~e.isnan()).any():
            grading.fail(f"{what}: {name} contains NaN", hint)
        grading.expect_tensor_close(g, e, f"{what}, {name}", atol=1e-9, rtol=1e-9, hint=hint)


def _merge_slips(a, b) -> list[tuple[tuple, str]]:
    """The states typical wrong merges return for ``a`` and ``b``, and what each got wrong."""
    (ma, la, acca), (mb, lb, accb) = a, b
    m = torch.maximum(ma, mb)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(ma - safe), torch.exp(mb - safe)
    lo = torch.minimum(ma, mb)
    lo_safe = torch.where(torch.isinf(lo), torch.zeros_like(lo), lo)
    va, vb = torch.exp(ma - lo_safe), torch.exp(mb - lo_safe)
    ia, ib = torch.exp(safe - ma), torch.exp(safe - mb)
    return [
        ((m, la + lb, acca + accb), "no rescale: l and acc of each side count exp(score - "
                                    "m_side); before adding, multiply each by exp(m_side - m)"),
        ((m, wa * la + wb * lb, acca + accb), "l was rescaled but acc was not: acc needs the "
                                              "same factor exp(m_side - m) as l"),
        ((m, la + lb, wa[..., None] * acca + wb[..., None] * accb),
         "acc was rescaled but l was not: l needs the same factor exp(m_side - m) as acc"),
        ((lo, va * la + vb * lb, va[..., None] * acca + vb[..., None] * accb),
         "the common m is the larger max, max(m_a, m_b), not the smaller one"),
        ((m, ia * la + ib * lb, ia[..., None] * acca + ib[..., None] * accb),
         "the factor is exp(m_side - m) (at most 1), not exp(m - m_side)"),
        ((m, wb * la + wa * lb, wb[..., None] * acca + wa[..., None] * accb),
         "each side's factor goes with its own l and acc: a's weight exp(m_a - m) "
         "multiplies l_a and acc_a"),
        ((ma, wa * la + wb * lb, wa[..., None] * acca + wb[..., None] * accb),
         "the merged m is max(m_a, m_b), not m_a"),
    ]


def _named_merge_slip(got, a, b) -> str | None:
    if not (isinstance(got, tuple | list) and len(got) == 3
            and all(isinstance(t, torch.Tensor) for t in got)):
        return None
    for wrong, hint in _merge_slips(a, b):
        try:
            if all(g.shape == w.shape and torch.allclose(g.double(), w.double(), rtol=1e-9,
                                                         atol=1e-9, equal_nan=True)
                   for g, w in zip(got, wrong, strict=True)):
                return hint
        except RuntimeError:
            continue
    return None


def check_merge_states(merge_states: Callable) -> None:
    """04.1: merging two blocks' (m, l, acc) equals the state of both blocks together."""
    with grading.exercise("04.1"):
        g = torch.Generator().manual_seed(41)
        for shape, n_a, n_b, d in [((), 5, 3, 4), ((4,), 8, 8, 16), ((2, 3), 1, 7, 8)]:
            s = torch.randn(*shape, n_a + n_b, generator=g, dtype=torch.float64) * 3
            v = torch.randn(*shape, n_a + n_b, d, generator=g, dtype=torch.float64)
            a = _state_of(s[..., :n_a], v[..., :n_a, :])
            b = _state_of(s[..., n_a:], v[..., n_a:, :])
            whole = _state_of(s, v)
            got = merge_states(a, b)
            _expect_state(got, whole,
                          f"merge of blocks of {n_a} and {n_b} scores (batch shape {shape})",
                          hint=_named_merge_slip(got, a, b) or
                          "m = max(m_a, m_b); rescale each side by exp(m_side - m) before "
                          "adding its l and acc")
            got = merge_states(b, a)
            _expect_state(got, whole, "merge in the other order",
                          hint=_named_merge_slip(got, b, a) or
                          "merging must not depend on which block came first")
        # generated: masked rows anywhere, mixed with real ones; ties; float32
        small_attention.merge_stage(merge_states)


def _poisoned_cache(g: torch.Generator, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_dim: int, tables: list[list[int]], lens: list[int],
                    dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V caches whose slots not holding any sequence's token are NaN."""
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=dtype)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for table, n in zip(tables, lens, strict=True):
        for t in range(n):
            written[table[t // block_size], t % block_size] = True
    k[~written] = float("nan")
    v[~written] = float("nan")
    return k, v


def _sequences(g: torch.Generator, block_size: int, num_blocks: int
               ) -> tuple[list[int], list[list[int]]]:
    """Edge-case lengths (1, a full block, one more, several blocks) and their tables.

    Tables hold distinct random blocks (no two sequences share one here, although chapter
    03's fork can share even a partly filled block) and one padding entry ``-1`` after
    the last used block.
    """
    lens = [1, block_size, block_size + 1, 3 * block_size + 5]
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(cdiv(n, block_size))] + [-1] for n in lens]
    return lens, tables


#: (query heads, KV heads), head_dim, block_size, q scale: every case has a sequence of 4
#: blocks, and two blocks laid end to end are longer than any dimension of one block's
#: tensors. The last case's scores run in the hundreds: exp of a raw score overflows
#: float64 past 709, so code with no running max fails there.
PAGED_CASES = [((1, 1), 4, 4, 1.0), ((8, 2), 6, 8, 1.0), ((5, 1), 6, 4, 300.0)]


def check_paged_online(paged_decode: Callable) -> None:
    """04.2: one sequence's decode attention, one block at a time, through its block table.

    The caches are :class:`~paged_lib.instruments.block_reads.BlockCache` proxies: the check
    sees every block read and what the learner's code still holds, so gathering all
    tokens first, or a softmax that needs the whole score row, fails even though its
    numbers are right.
    """
    with grading.exercise("04.2"):
        g = torch.Generator().manual_seed(43)
        for (num_heads, kv_heads), d, block_size, q_scale in PAGED_CASES:
            lens, tables = _sequences(g, block_size, 16)
            k, v = _poisoned_cache(g, 16, block_size, kv_heads, d, tables, lens)
            q = torch.randn(len(lens), num_heads, d, generator=g, dtype=torch.float64) * q_scale
            width = max(len(t) for t in tables)
            safe = torch.tensor([[max(b, 0) for b in t] + [0] * (width - len(t))
                                 for t in tables], dtype=torch.int32)
            ref = ref_paged_attention(q, k, v, safe, torch.tensor(lens, dtype=torch.int32))
            for s, (table, n) in enumerate(zip(tables, lens, strict=True)):
                _paged_case(paged_decode, q[s], k, v, table, n, d ** -0.5, ref[s], q_scale > 1)
        # generated: scales of Gemma 2 and MLA, several -1 after the table, GQA
        small_attention.paged_stage(paged_decode, _paged_case)


def _paged_case(paged_decode: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                table: list[int], n: int, scale: float, ref: torch.Tensor, loud: bool) -> None:
    """One sequence: the learner's function on watched caches, next to ``ref``."""
    what = f"seq_len={n}, heads {q.shape[0]}/{k.shape[2]} (query/KV), block_size={k.shape[1]}"
    got = _run_watched(paged_decode, q, k, v, table, n, scale, what)
    grading.expect_true(isinstance(got, torch.Tensor),
                        f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    got = got.as_subclass(torch.Tensor)
    grading.expect_true(got.dtype == q.dtype, f"{what}: expected dtype {q.dtype}, "
                        f"got {got.dtype}", hint="compute in q's dtype")
    same = got.shape == ref.shape
    if loud and same and not got.isfinite().all():
        grading.fail(f"{what}, scores in the hundreds: the output contains NaN or inf",
                     hint="exp of a raw score overflows beyond 709: keep a running max m, "
                          "exponentiate scores - m and rescale l and acc by exp(m_old - "
                          "m_new) when m grows")
    if same and (got.isnan() & ~ref.isnan()).any():
        grading.fail(f"{what}: the output contains NaN: a slot past seq_len reached it (the "
                     "last block's tail holds NaN)",
                     hint="mask the last block's slots at or past seq_len: score -inf AND "
                          "value 0 (0 * NaN is NaN)")
    named = None
    if same and not torch.allclose(got, ref, atol=1e-9, rtol=1e-9):
        named = name_slip(got[None], ref[None], decode_slips(q[None], k, v, [table], [n],
                                                             scale))
    grading.expect_tensor_close(
        got, ref, what, atol=1e-9, rtol=1e-9,
        hint=named or "compare with the spec element by element: each query head's softmax "
                      "over this sequence's first seq_len keys (times the scale you are "
                      "given), times its values")


def _run_watched(paged_decode: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 table: list[int], n: int, scale: float, what: str) -> torch.Tensor:
    """Call the learner's function on watched caches; fail on the first broken read rule."""
    k_watch, v_watch, log = block_reads.watch(k, v, q.shape[0])
    bt = torch.tensor(table, dtype=torch.int32)
    error = None
    with block_reads.active(log):
        try:
            got = paged_decode(q, k_watch, v_watch, bt, n, scale)
        except NotImplementedError:
            raise
        except Exception as err:  # report a broken read rule before the crash it caused
            error = err
    if log.problem is None and error is None:
        block_reads.check_order(log, table[:cdiv(n, k.shape[1])])
    if log.problem is not None:
        grading.fail(f"{what}: {log.problem}", log.hint)
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
        answers = classify()
        count = len(STATEMENTS)
        grading.expect_true(isinstance(answers, dict),
                            f"expected a dict {{statement number: answer}}, got "
                            f"{type(answers).__name__}",
                            hint=f"return {{1: 'flash', 2: ..., {count}: ...}}: the keys are "
                                 "the statement numbers, so a list's order is not relied on")
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
        got = {i: str(answers[i]).strip().lower() for i in range(1, count + 1)}
        for i in range(1, count + 1):
            grading.expect_true(got[i] in ("flash", "paged", "both"),
                                f"statement {i}: answer {answers[i]!r} is not one of "
                                "'flash', 'paged', 'both'",
                                hint="answer with one of the three words exactly: 'flash' "
                                     "(FlashAttention only), 'paged' (PagedAttention only) "
                                     "or 'both'")
        wrong = [(i, hint) for i, (_, answer, hint) in enumerate(STATEMENTS, 1)
                 if got[i] != answer]
        if wrong:
            i, hint = wrong[0]
            grading.fail(f"{count - len(wrong)} of {count} right; statement {i} is not "
                         f"{got[i]!r}", hint)
