"""Checks for chapter 01 (KV bytes): named cases (01.1, 01.4), then the generated ones of
:mod:`.generated.small_ints`; each hint names the slip from the number it produced."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import numpy as np

from paged_lib.accounting import SPECS, ModelSpec, kv_bytes_per_token, num_blocks
from paged_lib.course import grading
from paged_lib.course.grading import slips
from paged_lib.course.grading.generated import numeric, small_ints

# A tiny model whose numbers are all different, so a swapped field shows up.
TOY = ModelSpec("toy-gqa", num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=2,
                head_dim=16, dtype_bytes=4)


def _kv_hint(spec: ModelSpec, got: object) -> str:
    right = kv_bytes_per_token(spec)
    slips = [
        (right // 2, "K and V are both cached: multiply by 2."),
        (right * spec.group_size, "only KV heads are cached (num_kv_heads, not num_heads): "
                                  "with GQA several query heads share one KV head."),
        (2 * spec.num_layers * spec.hidden_size * spec.dtype_bytes,
         "hidden_size counts query heads x head_dim; the cache holds num_kv_heads x head_dim "
         "per layer."),
        (right // spec.dtype_bytes, "the answer is in bytes: multiply by spec.dtype_bytes."),
        (right // spec.num_layers, "every layer has its own K and V: multiply by num_layers."),
    ]
    # on a 2-byte model "forgot x2" and "forgot dtype_bytes" look the same: both named
    return " Or: ".join(hint for wrong, hint in slips if wrong != right and got == wrong) \
        or "2 (K and V) x num_layers x num_kv_heads x head_dim x dtype_bytes."


def _check_kv(fn: Callable[[ModelSpec], int], spec: ModelSpec) -> None:
    got = fn(spec)
    grading.expect_equal(got, kv_bytes_per_token(spec),
                         what=f"bytes per token of {spec.name} ({spec.attention}, "
                              f"{spec.dtype_bytes} B per value)", hint=_kv_hint(spec, got))
    grading.expect_int(got, f"bytes per token of {spec.name}")


def check_kv_bytes_per_token(fn: Callable[[ModelSpec], int]) -> None:
    """01.1: bytes of KV per token, on MHA, GQA and MQA models and other dtypes."""
    with grading.exercise("01.1"):
        for spec in [SPECS["llama-2-70b"], SPECS["opt-13b"], SPECS["llama-2-7b"],
                     SPECS["falcon-7b"], SPECS["mistral-7b"].with_dtype("fp8"),
                     SPECS["llama-2-13b"].with_dtype("fp32"), TOY]:
            _check_kv(fn, spec)
        small_ints.kv_stage(lambda spec: _check_kv(fn, spec))  # generated: real configs


def _tokens(n: int) -> str:
    return f"{n} token" + "s" * (n != 1)


def check_logical_blocks(fn: Callable[[int, int], int]) -> None:
    """01.2: logical blocks for a request (ceil division, 0 tokens -> 0 blocks)."""
    small_ints.check_division("01.2", "logical_blocks", fn)


def _fill_slips(case: tuple[int, int]) -> dict[str, float]:
    """hint -> what that typical wrong fill returns for ``case`` (n, bs)."""
    n, bs = case
    want = small_ints.fill(n, bs)
    return {numeric.Named(hint): wrong for hint, wrong in {
        "when num_tokens is a multiple of block_size the last block is full (1.0), not empty: "
        "`n % bs` is 0 there.": (n % bs) / bs,
        "0 tokens: 0.0 (there is no last block to fill).": (n % bs or bs) / bs,
        "return a fraction (0.5), not a percentage (50).": 100 * want,
        "that is the empty share of the last block (its waste): the fill is the share of "
        "its slots that hold tokens.": 1 - want,
        "that is the fill of all the blocks together; asked is the last block alone.":
            n / (num_blocks(n, bs) * bs) if n else 0.0,
        "`//` floors the fraction to 0 or 1: divide with `/`.": (n % bs or bs) // bs if n else 0,
        "one token off: the last block holds the tokens left after the full blocks before it "
        "(num_tokens - (blocks - 1) x block_size).": ((n - 1) % bs) / bs if n else 0.0,
        "float32 keeps about 7 digits: return a Python float.": float(np.float32(want)),
    }.items()}  # named: no contrast (a block size that is a power of two) replaces them


def check_last_block_fill(fn: Callable[[int, int], float]) -> None:
    """01.3: share of the last block that holds tokens (1.0 when it is full)."""
    def run(n: int, bs: int) -> None:
        got, want = fn(n, bs), small_ints.fill(n, bs)
        grading.expect_true(isinstance(got, numbers.Real) and not isinstance(got, bool),
                            f"fill for {_tokens(n)}: got {got!r}", "return one number "
                            "between 0 and 1 (a float)")
        hint = slips.name_mistake((n, bs), got, want, [(c.n, c.b) for c in small_ints.
                                  count_cases()], _fill_slips, lambda c: fn(*c), (
            small_ints.FLOAT_HINT if n > 2 ** 40 else "tokens in the last block / block_size; "
            "the last block holds what is left after the full ones. 0 tokens: 0.0."))
        grading.expect_close(got, want, f"fill of the last block for {_tokens(n)} at block "
                             f"size {bs}", rel=1e-9, hint=hint)

    with grading.exercise("01.3"):
        small_ints.count_stage("01.3", run)


def _max_requests_hint(spec: ModelSpec, budget: int, ctx: int, bs: int, got: object,
                       want: int) -> str:
    per_token, blocks = kv_bytes_per_token(spec), num_blocks(ctx, bs)
    block, whole = bs * per_token, ("only whole requests run: the blocks left after the last "
                                    "whole request hold no one, so round the number of "
                                    "requests down.")
    if isinstance(got, float) and got != int(got):
        return "only whole requests run: round down."
    slips = [
        (budget // (ctx * per_token), f"each request takes whole blocks: {_tokens(ctx)} at "
         f"block size {bs} occupy {blocks} blocks, i.e. {blocks * bs} token slots."),
        (budget // per_token // blocks, f"a block holds block_size = {_tokens(bs)}, so it "
         f"takes {bs} x {per_token:,} bytes: the budget holds {budget // block:,} blocks, "
         f"not {budget // per_token:,}."),
        (-(-budget // block) // blocks, "a remainder of the budget smaller than a block is "
         "unusable: round the number of blocks in the budget down (//), not up."),
        (round(budget // block / blocks), whole), (-(-(budget // block) // blocks), whole),
        (budget // (block // 2) // blocks, f"{spec.name} caches K and V: {per_token:,} bytes "
         "per token (check your kv_bytes_per_token from 01.1: did it multiply by 2?)."),
        *((budget // (bs * w) // blocks, f"{spec.name} caches {per_token:,} bytes per token, "
           f"not {w:,}: num_kv_heads x head_dim per layer, as in 01.1 (not hidden_size, not "
           "num_heads).") for w in (2 * spec.num_layers * spec.hidden_size * spec.dtype_bytes,
                                    per_token * spec.group_size)),
        (budget // block // num_blocks(ctx + 1, bs), f"a request holds context_len = "
         f"{_tokens(ctx)}, no slot for a next one: ceil({ctx} / {bs}) = {blocks} blocks."),
    ]
    return next((hint for wrong, hint in slips if got == wrong != want),
                "blocks in the budget = budget // (block_size x bytes per token); each request "
                "needs ceil(context_len / block_size) of them.")


def _check_max(fn: Callable[..., int], spec: ModelSpec, budget: int, ctx: int,
               bs: int) -> None:
    got = fn(spec, budget, ctx, bs)
    want = (budget // (bs * kv_bytes_per_token(spec))) // num_blocks(ctx, bs)
    what = f"{spec.name}, budget {budget:,} B, {_tokens(ctx)}, block size {bs}"
    grading.expect_equal(got, want, what, _max_requests_hint(spec, budget, ctx, bs, got, want))
    grading.expect_int(got, what)


def check_max_requests(fn: Callable[[ModelSpec, int, int, int], int]) -> None:
    """01.4: how many requests fit in a KV budget, counting whole blocks."""
    l7 = SPECS["llama-2-7b"]
    blk7 = 16 * kv_bytes_per_token(l7)  # one 16-token block of llama-2-7b: 8 MiB
    with grading.exercise("01.4"):
        for budget, ctx in [(2560 * blk7, 2048),  # 20 GiB: 2560 blocks / 128 per request
                            (100 * blk7, 1000),  # 100 / 63 = 1.59 requests: round(...) says 2
                            (125 * blk7, 1000),  # 63 blocks per request, not 62.5: only 1
                            (128 * blk7 - 1, 2048),  # one byte short of a request: 0
                            (0, 2048)]:
            _check_max(fn, l7, budget, ctx, 16)
        small_ints.budget_stage(lambda *args: _check_max(fn, *args))  # generated: real
        # configurations, block sizes that are not powers of two, budgets past 2**32
