"""Checks for chapter 4's exercises: attention over blocks.

Each ``check_*`` calls the learner's function on several shapes and edge cases (a block
whose scores are all ``-inf``, one-token sequences, a sequence that fills a block
exactly, NaN-poisoned cache slots) and prints one verdict line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_lib import attention as A
from paged_lib import grading
from paged_lib.kernels.reference import gather_kv as _ref_gather_kv
from paged_lib.kernels.reference import ref_paged_attention

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


def check_merge_states(merge_states: Callable) -> None:
    """04.1: merging two blocks' (m, l, acc) equals the state of both blocks together."""
    with grading.exercise("04.1", "Merge two partial softmax states"):
        g = torch.Generator().manual_seed(41)
        for shape, n_a, n_b, d in [((), 5, 3, 4), ((4,), 8, 8, 16), ((2, 3), 1, 7, 8)]:
            s = torch.randn(*shape, n_a + n_b, generator=g, dtype=torch.float64) * 3
            v = torch.randn(*shape, n_a + n_b, d, generator=g, dtype=torch.float64)
            a = _state_of(s[..., :n_a], v[..., :n_a, :])
            b = _state_of(s[..., n_a:], v[..., n_a:, :])
            whole = _state_of(s, v)
            _expect_state(merge_states(a, b), whole,
                          f"merge of blocks of {n_a} and {n_b} scores (batch shape {shape})",
                          hint="m = max(m_a, m_b); rescale each side by exp(m_side - m) "
                               "before adding its l and acc")
            _expect_state(merge_states(b, a), whole, "merge in the other order",
                          hint="merging must not depend on which block came first")
        # Large scores: exp(1000) overflows unless the max is subtracted.
        s = torch.tensor([1000.0, 999.0, 998.0, 1001.0], dtype=torch.float64)
        v = torch.arange(8, dtype=torch.float64).view(4, 2)
        _expect_state(merge_states(_state_of(s[:2], v[:2]), _state_of(s[2:], v[2:])),
                      _state_of(s, v), "scores around 1000",
                      hint="never compute exp(m); only exp of differences like m_a - m")
        # A fully masked block (all scores -inf): m = -inf, l = 0, acc = 0.
        empty = (torch.tensor([NEG_INF, 1.0], dtype=torch.float64),
                 torch.tensor([0.0, 1.0], dtype=torch.float64),
                 torch.tensor([[0.0, 0.0], [2.0, 3.0]], dtype=torch.float64))
        real = _state_of(torch.tensor([[0.5, -1.0], [2.0, 0.0]], dtype=torch.float64),
                         torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]],
                                      dtype=torch.float64))
        hint_inf = ("exp(-inf - (-inf)) is NaN: when the common max is -inf use 0 in its "
                    "place (torch.where), so the empty block's weight is exp(-inf) = 0")
        _expect_state(merge_states(empty, real), tuple(A.merge(A.SoftmaxState(*empty),
                                                               A.SoftmaxState(*real))),
                      "merge with a fully masked block (m = -inf)", hint=hint_inf)
        both = tuple(t.clone() for t in empty)
        both[0][1] = NEG_INF
        both[1][1] = 0.0
        both[2][1] = 0.0
        _expect_state(merge_states(both, both), both,
                      "merge of two fully masked blocks (should stay m=-inf, l=0, acc=0)",
                      hint=hint_inf)


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


def _table(g: torch.Generator, n_used: int, max_blocks: int, num_blocks: int) -> list[int]:
    """A random block table: ``n_used`` real entries (repeats allowed), then garbage ids."""
    real = torch.randint(0, num_blocks, (n_used,), generator=g).tolist()
    return real + [num_blocks + 1000] * (max_blocks - n_used)


def _cases(block_size: int) -> list[int]:
    return [1, block_size, block_size + 1, 3 * block_size + 5]


def _sequences(g: torch.Generator, block_size: int, num_blocks: int,
               spare: int) -> tuple[list[int], list[list[int]]]:
    """The edge-case lengths and a block table for each, ``spare`` unused entries wide."""
    lens = _cases(block_size)
    max_blocks = max(-(-n // block_size) for n in lens) + spare
    return lens, [_table(g, -(-n // block_size), max_blocks, num_blocks) for n in lens]


def check_gather_kv(gather_kv: Callable) -> None:
    """04.2: the first ``seq_len`` tokens of one sequence, gathered through its block table."""
    with grading.exercise("04.2", "Gather K/V through a block table"):
        g = torch.Generator().manual_seed(42)
        for block_size, kv_heads, d in [(4, 1, 2), (16, 2, 8), (8, 3, 5)]:
            num_blocks = 12
            lens, tables = _sequences(g, block_size, num_blocks, spare=2)
            cache, _ = _poisoned_cache(g, num_blocks, block_size, kv_heads, d, tables, lens)
            for table, n in zip(tables, lens, strict=True):
                bt = torch.tensor(table, dtype=torch.int32)
                grading.expect_tensor_close(
                    gather_kv(cache, bt, n), _ref_gather_kv(cache, bt, n),
                    f"seq_len={n}, block_size={block_size}, block table {table}",
                    atol=0, rtol=0,
                    hint="token t lives in physical block block_table[t // block_size] at "
                         "offset t % block_size; return only the first seq_len tokens, "
                         "shape [seq_len, num_kv_heads, head_dim]")


def check_paged_decode(paged_decode: Callable) -> None:
    """04.3: one sequence's decode attention, block by block through its block table."""
    with grading.exercise("04.3", "Blockwise attention through a block table"):
        g = torch.Generator().manual_seed(43)
        for (num_heads, kv_heads), d, block_size in [((1, 1), 4, 4), ((4, 4), 8, 8),
                                                     ((8, 2), 16, 16), ((5, 1), 6, 4)]:
            num_blocks = 16
            lens, tables = _sequences(g, block_size, num_blocks, spare=1)
            k, v = _poisoned_cache(g, num_blocks, block_size, kv_heads, d, tables, lens)
            q = torch.randn(len(lens), num_heads, d, generator=g, dtype=torch.float64)
            safe = torch.tensor([[b % num_blocks for b in t] for t in tables], dtype=torch.int32)
            ref = ref_paged_attention(q, k, v, safe, torch.tensor(lens, dtype=torch.int32))
            for s, (table, n) in enumerate(zip(tables, lens, strict=True)):
                got = paged_decode(q[s], k, v, torch.tensor(table, dtype=torch.int32), n,
                                   d ** -0.5)
                grading.expect_tensor_close(
                    got, ref[s], f"seq_len={n}, heads {num_heads}/{kv_heads} (query/KV), "
                    f"block_size={block_size}", atol=1e-9, rtol=1e-9,
                    hint="visit blocks j = 0 .. ceil(seq_len / block_size) - 1; in the last "
                         "one mask slots past seq_len (scores -inf AND values zeroed: they "
                         "may be NaN); query head h uses KV head h // (num_heads // "
                         "num_kv_heads)")


#: Exercise 04.4: statement, answer ("flash", "paged" or "both"), hint if wrong.
STATEMENTS: list[tuple[str, str, str]] = [
    ("Splits the computation into tiles so the full row of scores never has to be written "
     "to slow memory.", "flash",
     "this is about *computing* attention with less memory traffic"),
    ("Stores a sequence's keys and values in fixed-size blocks that need not be contiguous.",
     "paged", "this is about *where* K/V live"),
    ("Relies on the online softmax: a running max and sum, merged block by block.", "both",
     "does either method need the whole score row at once?"),
    ("Its saving is memory traffic (IO) during the attention computation.", "flash",
     "which one was designed around SRAM vs HBM bandwidth?"),
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
]


def statements() -> str:
    """The statements of exercise 04.4, numbered, for the notebook to print."""
    return "\n".join(f"{i}. {text}" for i, (text, _, _) in enumerate(STATEMENTS, 1))


def check_flash_vs_paged(classify: Callable[[], dict[int, str]]) -> None:
    """04.4: classify each statement as "flash", "paged" or "both"."""
    with grading.exercise("04.4", "FlashAttention vs PagedAttention"):
        answers = classify()
        grading.expect_true(isinstance(answers, dict),
                            f"expected a dict {{statement number: answer}}, got "
                            f"{type(answers).__name__}")
        missing = [i for i in range(1, len(STATEMENTS) + 1) if i not in answers]
        grading.expect_true(not missing, f"no answer for statement(s) {missing}",
                            hint=f"keys are 1 .. {len(STATEMENTS)}")
        wrong = []
        for i, (_, answer, hint) in enumerate(STATEMENTS, 1):
            got = str(answers[i]).strip().lower()
            grading.expect_true(got in ("flash", "paged", "both"),
                                f"statement {i}: answer {answers[i]!r} is not one of "
                                "'flash', 'paged', 'both'")
            if got != answer:
                wrong.append((i, got, hint))
        if wrong:
            i, got, hint = wrong[0]
            grading.fail(f"{len(STATEMENTS) - len(wrong)} of {len(STATEMENTS)} right; "
                         f"statement {i} is not {got!r}", hint)
