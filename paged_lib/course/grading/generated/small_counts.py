"""Generated inputs for 09.2 (choosing a block size: budgets a slot off a size's waste, pools
up to 10**10 slots), 11.2 (KV bytes per token) and 12.1 (KV bytes per rank): real configurations
(:data:`MODELS`) in fp8, fp16 and fp32, on 1 to 32 ranks (some that vLLM refuses).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from paged_lib.accounting import ModelSpec, kv_bytes_per_token
from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.studies.block_size import choose_block_size, internal_waste

# ------------------------------------------------------------------ 09.2 choose_block_size

_BUDGET = {"at": "exactly the waste of size {b}",
           "below": "the waste of size {b} less one slot", "above": "the waste of size {b} "
           "and one slot more", "value": "a budget of {b!r}"}


@dataclass(frozen=True)
class Choice:
    """09.2: ``budget`` is (how, size or value), as in ``_BUDGET``."""

    seed: int
    lengths: tuple[int, ...]
    allowed: tuple[int, ...]
    budget: tuple[str, Any]

    def max_waste(self) -> float:
        how, x = self.budget
        if how == "value":
            return x
        held = sum(-(-n // x) * x for n in self.lengths)
        empty = held - sum(self.lengths) + {"at": 0, "below": -1, "above": 1}[how]
        return internal_waste(list(self.lengths), x) if how == "at" else \
            min(max(empty, 0) / held, math.nextafter(1.0, 0.0))

    def describe(self) -> str:
        how, x = self.budget
        return (f"choose_block_size({list(self.lengths)}, {list(self.allowed)}, "
                f"{self.max_waste()!r}) (" + _BUDGET[how].format(b=x) + ")")

    def states(self) -> list[str]:
        return numeric.reached(
            (f"a budget {self.budget[0]} a waste", self.budget[0] in ("below", "above")),
            ("a pool past 2**32 slots", sum(self.lengths) > 2 ** 32),
            ("a size listed twice", len(set(self.allowed)) < len(self.allowed)))

    def smaller(self) -> Iterator[Choice]:
        n, a, (how, x) = self.lengths, self.allowed, self.budget
        for i in range(len(n) if len(n) > 1 else 0):
            yield dataclasses.replace(self, lengths=n[:i] + n[i + 1:])
        for i, b in enumerate(a):
            if len(a) > 1 and (how == "value" or b != x or a.count(b) > 1):
                yield dataclasses.replace(self, allowed=a[:i] + a[i + 1:])


#: lengths and sizes up to pools of 10**10 slots, where one slot is a share of 1e-10
_LENGTHS = [1, 7, 16, 33, 100, 255, 1000, 4097, 9 * 10 ** 9 + 7, 10 ** 10 + 1, 3 * 10 ** 10]
_SIZES = [1, 3, 5, 8, 12, 16, 24, 48, 64, 96, 100, 256, 3 * 10 ** 9, 10 ** 10]


def _draw_choice(seed: int) -> Choice:
    pick = rng(9201 + seed)
    lengths = tuple(pick(_LENGTHS) for _ in range(pick([1, 1, 2, 3, 5])))
    allowed = tuple(pick(_SIZES) for _ in range(pick([1, 2, 3, 4])))
    # not exactly at a waste: the fixed cases have those, as typed decimals
    how = ("below", "value", "above", "below", "value")[seed % 5]
    x = pick([0.0, 0.05, 0.1, 0.3, 0.35, 0.5]) if how == "value" else pick(allowed)
    if seed % 10 == 0:  # a pool of 10**10 slots and more: one slot is a share of 1e-10
        lengths = lengths[:1] + tuple(pick(_LENGTHS[-3:]) for _ in range(pick([1, 2])))
        x = pick(_SIZES[-2:])
        allowed = allowed[:2] + (x,)
    return Choice(seed, lengths, allowed, (how, x))


def choice_cases(count: int = 40) -> list[Choice]:
    return [_draw_choice(seed) for seed in range(count)]


def choice_stage(fn: Callable) -> None:
    """09.2's generated stage."""
    def run(p: Choice) -> None:
        budget = p.max_waste()
        got = fn(list(p.lengths), list(p.allowed), budget)
        grading.expect_int(got, "the size returned")
        grading.expect_equal(int(got), choose_block_size(list(p.lengths), list(p.allowed),
                                                         budget), "the size returned", hint=(
            "the largest allowed size whose waste (held - tokens) / held is <= max_waste as "
            "floats; if none, the least wasteful, the smaller on a tie"))

    numeric.check("09.2", choice_cases(), run, (Contrast(
        lambda p: dataclasses.replace(p, budget=("at", p.budget[1]))
        if p.budget[0] == "below" else None,
        "it passes when the budget is exactly a size's waste and fails when that size wastes "
        "one slot more than the budget: it does not fit, however many slots the pool holds; "
        "compare waste <= max_waste as floats (no relative tolerance such as math.isclose's)"),))


# ------------------------------------------------------------------ 11.2 and 12.1 models

#: Published configurations (config.json): name, layers, hidden size, query heads, KV heads,
#: head size, MLA latent, MLA RoPE key. The first four's head size is not hidden / heads.
MODELS = [
    ("Gemma 7B", 28, 3072, 16, 16, 256, 0, 0), ("Gemma 2 9B", 42, 3584, 16, 8, 256, 0, 0),
    ("Gemma 2 27B", 46, 4608, 32, 16, 128, 0, 0),
    ("Mistral NeMo 12B", 40, 5120, 32, 8, 128, 0, 0),
    ("Qwen3 32B", 64, 5120, 64, 8, 128, 0, 0), ("Qwen2 7B", 28, 3584, 28, 4, 128, 0, 0),
    ("Phi-3 mini", 32, 3072, 32, 32, 96, 0, 0), ("Llama 3.2 1B", 16, 2048, 32, 8, 64, 0, 0),
    ("Falcon 7B", 32, 4544, 71, 1, 64, 0, 0),
    ("DeepSeek-V2-Lite", 27, 2048, 16, 16, 128, 512, 64),
    ("DeepSeek-V3", 61, 7168, 128, 128, 128, 512, 64),
    ("MiniCPM3 4B", 62, 2560, 40, 40, 64, 256, 32)]
_BYTES = {1: "fp8", 2: "fp16", 4: "fp32"}


def _odd(s: ModelSpec) -> bool:
    return s.head_dim != s.hidden_size // s.num_heads and not s.kv_lora_rank


def _about(s: ModelSpec) -> str:
    return (f"{s.name} ({s.attention}, {s.num_layers} layer{'s' * (s.num_layers > 1)}, "
            f"hidden {s.hidden_size}, {s.num_heads} query heads, {s.num_kv_heads} KV "
            f"head{'s' * (s.num_kv_heads > 1)} of {s.head_dim}"
            + (f" (not {s.hidden_size} / {s.num_heads} = {s.hidden_size // s.num_heads})"
               if _odd(s) else "")
            + (f", latent {s.kv_lora_rank}, RoPE key {s.qk_rope_head_dim}"
               if s.kv_lora_rank else "") + f", {_BYTES[s.dtype_bytes]})")


_HEAD_DIM = Contrast(lambda p: dataclasses.replace(p, hidden=p.spec().num_heads
                                                 * p.spec().head_dim) if _odd(p.spec()) else None,
                     "it passes on models whose head_dim is hidden_size // num_heads and "
                     "fails on this one, whose is not (as Gemma's, Mistral NeMo's, Qwen3 "
                     "32B's): use spec.head_dim, never derive it from hidden_size")


@dataclass(frozen=True)
class PerToken:
    """11.2: a model of :data:`MODELS`, ``layers`` of it (None: all), ``hidden`` another."""

    seed: int
    model: int
    layers: int | None
    dtype_bytes: int
    hidden: int | None = None

    def spec(self) -> ModelSpec:
        name, n, size, heads, kv, d, latent, rope = MODELS[self.model]
        return ModelSpec(name, n if self.layers is None else self.layers, self.hidden or size,
                         heads, kv, d, dtype_bytes=self.dtype_bytes, kv_lora_rank=latent,
                         qk_rope_head_dim=rope)

    def describe(self) -> str:
        return f"kv_bytes_per_token of {_about(self.spec())}"

    def states(self) -> list[str]:
        s = self.spec()
        return ["head_dim not hidden / heads"] * _odd(s) + [f"{s.attention} in "
                                                            f"{_BYTES[s.dtype_bytes]}"]

    def smaller(self) -> Iterator[PerToken]:
        yield from numeric.fewer(self, layers=[1], dtype_bytes=[2])


def token_cases() -> list[PerToken]:
    """11.2's cases: every model, in a dtype of its own, all its layers (seeds 0, 1 ...)."""
    return [PerToken(i, i, None, (2, 4, 1)[i % 3]) for i in range(len(MODELS))]


def token_stage(fn: Callable) -> None:
    """11.2's generated stage."""
    def run(p: PerToken) -> None:
        got = fn(p.spec())
        grading.expect_int(got, "bytes per token")
        grading.expect_equal(int(got), kv_bytes_per_token(p.spec()), "bytes per token", hint=(
            "MHA/GQA/MQA: 2 x layers x KV heads x head_dim x bytes; MLA: layers x (latent + "
            "RoPE key) x bytes"))

    numeric.check("11.2", token_cases(), run, (_HEAD_DIM,))


@dataclass(frozen=True)
class PerRank(PerToken):
    """12.1 (models without a latent: 12.1 counts KV heads)."""

    tp: int = 1
    tokens: int = 1

    def describe(self) -> str:
        return (f"kv_bytes_per_rank of {_about(self.spec())}, tp_size {self.tp}, "
                f"{self.tokens:,} tokens")

    def states(self) -> list[str]:
        return super().states() + ["more ranks than KV heads"] * (
            self.tp > self.spec().num_kv_heads) + ["2**33 tokens"] * (self.tokens > 2 ** 32)

    def smaller(self) -> Iterator[PerRank]:
        yield from numeric.fewer(self, tokens=[1] if self.tokens > 1 else [], layers=[1],
                                 dtype_bytes=[2], tp=[1])


def rank_cases() -> list[PerRank]:
    """12.1's cases: each model without a latent on 1 to 32 ranks (some refused)."""
    plain = [i for i, m in enumerate(MODELS) if not m[6]]
    return [PerRank(seed, plain[seed % len(plain)], None, pick([1, 2, 4]),
                    tp=pick([1, 2, 3, 4, 8, 16, 32]), tokens=pick([0, 1, 7, 4096, 2 ** 33]))
            for seed, pick in ((s, rng(1201 + s)) for s in range(3 * len(plain)))]
