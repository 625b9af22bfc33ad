"""12.3 ``rank_attention(x, w, cos, sin, kv_cache, meta, rank, tp_size, all_reduce)`` (re-exported
by ``ch12``), in order:

1. named steps (a prefill from an empty cache, a batch of decodes, a mixed step with a
   prefix hit, a GQA group split across ranks, biases as Qwen2's, 4 ranks for 2 KV heads
   and for 1), then generated ones (:class:`Rank`: sharded as real models are, 3 ranks
   too, GQA groups of 1 to 7, heads wider or narrower than ``hidden / num_heads``, blocks
   of 1 to 8 tokens, louder inputs; a failing one shrunk),
   in this process, every rank in turn with the all-reduce replayed (each rank's partial
   sums recorded, then every rank run again with their sum): each rank's output against
   the single-device layer, its cache against the library rank's (unused slots are NaN);
   a difference is named by recomputing the typical mistakes;
2. two real ``gloo`` ranks (:class:`~paged_lib.engine.tensor_parallel.TensorParallelRunner`)
   with the learner's function as every layer's attention of the shipped model replay
   every step a single-device engine ran (prefix caching, chunked prefill, samples, swaps):
   rank 0's logits must be the single-device engine's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.machinery
import multiprocessing as mp
import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.grading.generated import numeric
from paged_lib.course.grading.generated.numeric import Contrast, fewer, shorter
from paged_lib.engine.model_runner import build_metadata, check_metadata
from paged_lib.model import rope_cos_sin
from paged_lib.parallel import AttentionWeights, rank_attention, rank_heads, tp_size_problem

__all__ = ["ENGINE", "RANK_CONTRASTS", "Rank", "Step", "check_generated",
           "check_rank_attention", "compare", "engine_calls", "rank_cases", "replayed",
           "share", "shipped", "single_device", "steps"]

BLOCK_SIZE, NUM_BLOCKS, HIDDEN = 4, 16, 32


@dataclass
class Step:
    name: str
    tp: int
    w: AttentionWeights
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cache: tuple[torch.Tensor, torch.Tensor]  # every KV head, before the step
    meta: Any
    lens: list[tuple[int, int]]               # (cached, new) per sequence
    hint: str


def _step(name: str, tp: int, heads: int, kv_heads: int, lens: list[tuple[int, int]],
          hint: str, seed: int, bias: bool = False, head_dim: int = 8,
          block_size: int = BLOCK_SIZE, hidden: int = HIDDEN, loud: float = 1.0) -> Step:
    """A step of ``lens`` ((cached, new) per sequence), its history written in a cache
    whose other slots are NaN; ``loud`` scales the new tokens' input."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    d, bs = head_dim, block_size
    w = AttentionWeights(rand(heads * d, hidden), rand(kv_heads * d, hidden),
                         rand(kv_heads * d, hidden), rand(hidden, heads * d), heads, kv_heads,
                         d, *((rand(heads * d), rand(kv_heads * d), rand(kv_heads * d),
                               rand(hidden)) if bias else ()))
    need = [-(-(cached + new) // bs) for cached, new in lens]
    num_blocks = max(NUM_BLOCKS, sum(need) + 2)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[order.pop() for _ in range(n)] for n in need]
    k = torch.full((num_blocks, bs, kv_heads, d), float("nan"))
    v = k.clone()
    for table, (cached, _) in zip(tables, lens, strict=True):
        for pos in range(cached):  # the history, written by earlier steps
            k[table[pos // bs], pos % bs] = rand(kv_heads, d)
            v[table[pos // bs], pos % bs] = rand(kv_heads, d)
    meta = build_metadata(tables, [c + n for c, n in lens], [n for _, n in lens], bs)
    check_metadata(meta, num_blocks, bs)
    cos, sin = rope_cos_sin(meta.positions, d, 10000.0, torch.float32)
    x = rand(int(meta.query_lens.sum()), hidden) * 3 * loud
    return Step(name, tp, w, x, cos, sin, (k, v), meta, lens, hint)


_SPLIT = ("a rank computes num_heads / tp contiguous query heads and keeps the KV heads "
          "they read: the rows of q, k, v (and of their biases) for those heads")
_REPLICA = ("with fewer KV heads than ranks each KV head is replicated: rank r keeps the one "
            "its query heads read, KV head r // (tp / num_kv_heads), and writes it too")


_NAN = ("NaN: your attention read cache slots that were never written (they hold NaN): "
        "write the new tokens' K and V into the rank's cache at meta.slot_mapping first")


def steps() -> list[Step]:
    """The named steps (2 and 4 ranks), the same on every call."""
    return [
        _step("a prefill of 2 sequences (5 and 3 tokens) from an empty cache; 4 query "
              "heads, 2 KV heads, 2 ranks", 2, 4, 2, [(0, 5), (0, 3)], _SPLIT, 1),
        _step("a batch of 3 decodes (6, 9 and 1 tokens cached); 4 query heads, 2 KV heads",
              2, 4, 2, [(6, 1), (9, 1), (1, 1)],
              "a decode row is a query of one token over every cached one", 2),
        _step("a mixed step: 2 decodes (7 and 4 cached), then a prefill of 4 tokens that "
              "starts after 6 cached (a prefix hit)", 2, 4, 2, [(7, 1), (4, 1), (6, 4)],
              "the new tokens attend to the cached ones and to each other, causally", 3),
        _step("GQA split across ranks: 2 query heads share 1 KV head, one query head per "
              "rank (prefill of 3 after 5 cached, and a decode)", 2, 2, 1, [(5, 3), (2, 1)],
              _REPLICA, 5),
        _step("biases on q, k, v and o_proj (as Qwen2 has on q, k, v); 4 query heads, 2 KV "
              "heads (prefill of 4 after 2 cached, a decode)", 2, 4, 2, [(2, 4), (5, 1)],
              "q, k, v's biases are sliced with their rows; o_proj's bias is added once, "
              "after the sum (vLLM's RowParallelLinear adds it on one rank only)", 7,
              bias=True),
        _step("4 ranks for 2 KV heads: 8 query heads, each KV head on 2 neighbouring ranks "
              "(a decode, a prefill of 3 after 4 cached)", 4, 8, 2, [(9, 1), (4, 3)],
              _REPLICA, 8),
        _step("4 ranks for 1 KV head (MQA), with biases (a prefill of 5)", 4, 4, 1,
              [(0, 5)], _REPLICA, 9, bias=True),
    ]


def share(step: Step, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s cache before the step: its KV heads of every block (a copy)."""
    _, kv = rank_heads(step.w.num_heads, step.w.num_kv_heads, step.tp, rank)
    return tuple(c[:, :, kv[0]:kv[-1] + 1].clone() for c in step.cache)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def single_device(step: Step) -> tuple[torch.Tensor, tuple]:
    """The whole layer on one device (every head: ``tp_size=1``) and its cache after."""
    cache = tuple(c.clone() for c in step.cache)
    return rank_attention(step.x, step.w, step.cos, step.sin, cache, step.meta, 0, 1,
                          _identity), cache


def _recorder(calls: list) -> Callable:
    def all_reduce(t: torch.Tensor) -> None:  # in place, returns nothing: as torch's
        calls.append(t.detach().clone())
    return all_reduce


def _summer(sums) -> Callable:
    def all_reduce(t: torch.Tensor) -> None:
        t.copy_(next(sums))
    return all_reduce


def _copies(step: Step) -> tuple:
    """(x, w, cos, sin) as the learner's function gets them: copies, so that nothing it
    changes in place reaches the next rank, the next step or the library's answer."""
    return step.x.clone(), copy.deepcopy(step.w), step.cos.clone(), step.sin.clone()


def replayed(fn: Callable, step: Step) -> list[tuple[torch.Tensor, tuple]]:
    """Every rank's (output, cache after) from ``fn`` with the all-reduce replayed: each
    rank runs once with its partial sums recorded, then again with their sums."""
    partials: list[list[torch.Tensor]] = []
    for rank in range(step.tp):
        calls: list[torch.Tensor] = []
        fn(*_copies(step), share(step, rank), copy.deepcopy(step.meta), rank, step.tp,
           _recorder(calls))
        partials.append(calls)
    counts = [len(c) for c in partials]
    if 0 in counts or len(set(counts)) > 1:
        grading.fail(f"step '{step.name}': your ranks called all_reduce {counts} times "
                     "(rank 0 first)", "every rank calls all_reduce exactly as often (once, "
                     "on its partial output); a rank that calls it alone waits forever")
    for i in range(counts[0]):
        shapes = {tuple(c[i].shape) for c in partials}
        if len(shapes) > 1:
            grading.fail(f"step '{step.name}': call {i + 1} of all_reduce got shapes "
                         f"{sorted(shapes)} on different ranks", "an all-reduce sums tensors "
                         "of one shape: each rank's partial output [tokens, hidden]")
    sums = [sum(c[i] for c in partials) for i in range(counts[0])]
    results = []
    for rank in range(step.tp):
        cache, it = share(step, rank), iter(sums)
        out = fn(*_copies(step), cache, copy.deepcopy(step.meta), rank, step.tp, _summer(it))
        results.append((out, cache))
    return results


def _token(step: Step, row: int) -> str:
    for s, (cached, new) in enumerate(step.lens):
        if row < new:
            return f"sequence {s}'s position {cached + row}"
        row -= new
    return f"row {row}"


def _heads_out(step: Step, rank: int, rotated_cache: bool = True) -> torch.Tensor:
    """Rank ``rank``'s attention output per head ``[tokens, its heads * head_dim]``, keys
    cached rotated (the library) or (``rotated_cache`` False) before RoPE."""
    from paged_lib.kernels import paged_prefill, reshape_and_cache
    from paged_lib.model import apply_rope

    w, n, d = step.w, step.x.shape[0], step.w.head_dim
    q_heads, kv_heads = rank_heads(w.num_heads, w.num_kv_heads, step.tp, rank)

    def project(weight, bias, heads):
        rows = slice(heads[0] * d, (heads[-1] + 1) * d)
        y = step.x @ weight[rows].T
        return (y if bias is None else y + bias[rows]).view(n, len(heads), d)

    q = apply_rope(project(w.q, w.q_bias, q_heads), step.cos, step.sin)
    k = project(w.k, w.k_bias, kv_heads)
    k = apply_rope(k, step.cos, step.sin) if rotated_cache else k
    k_cache, v_cache = share(step, rank)
    reshape_and_cache(k, project(w.v, w.v_bias, kv_heads), k_cache, v_cache,
                      step.meta.slot_mapping, backend="torch")
    return paged_prefill(q.contiguous(), k_cache, v_cache, step.meta.block_tables,
                         step.meta.seq_lens, step.meta.query_lens,
                         backend="torch").reshape(n, -1)


def _slipped(step: Step, rank: int) -> list[tuple[torch.Tensor, str]]:
    """What rank ``rank`` returns, after the all-reduce, with each of three mistakes whose
    outputs the heads' hint does not describe: (output, the hint that names it)."""
    w, d = step.w, step.w.head_dim
    cols = [slice(rank_heads(w.num_heads, w.num_kv_heads, step.tp, r)[0][0] * d,
                  (rank_heads(w.num_heads, w.num_kv_heads, step.tp, r)[0][-1] + 1) * d)
            for r in range(step.tp)]
    b = w.o_bias if w.o_bias is not None else torch.zeros(step.x.shape[1])
    raw = [_heads_out(step, r, rotated_cache=False) for r in range(step.tp)]
    heads = [_heads_out(step, r) for r in range(step.tp)]
    out = [(sum(h @ w.o[:, c].T for h, c in zip(raw, cols, strict=True)) + b,
            "keys go into the cache rotated: apply RoPE to k first, then write it at "
            "meta.slot_mapping (a cached key is read at every later step with its position "
            "already in it)"),
           (sum(heads) @ w.o[:, cols[rank]].T + b,
            "all_reduce comes after o_proj: each rank multiplies its heads' output by its "
            "columns of o_proj, and the ranks' [tokens, hidden] partial outputs are summed "
            "(a sum of different heads' outputs mixes heads that o_proj keeps apart)")]
    try:  # o[its heads' rows, :]: multiplies only where hidden == num_heads * head_dim
        rows = sum(h @ w.o[c, :] for h, c in zip(heads, cols, strict=True)) + b
        out.append((rows, "o_proj is row-parallel: a rank multiplies by the columns of o_proj "
                    "that its heads feed, o[:, its heads].T (nn.Linear stores W as [out, "
                    "in]), not by rows of it"))
    except RuntimeError:
        pass
    return out


def _mistake(step: Step, rank: int, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """The typical mistake whose output is ``got`` on this step and rank."""
    lib = rank_attention(step.x, step.w, step.cos, step.sin, share(step, rank), step.meta,
                         rank, step.tp, _identity)
    b = step.w.o_bias if step.w.o_bias is not None else torch.zeros(step.x.shape[1])
    close = lambda a: a.shape == got.shape and torch.allclose(got, a, 1e-4, 1e-5)  # noqa: E731
    if close(lib):
        return "that is this rank's own partial output: all_reduce (sum) the ranks' partial " \
               "outputs, each its heads times its columns of o_proj"
    if step.w.o_bias is not None and close(want + (step.tp - 1) * b):
        return "o_proj's bias was added on every rank before the sum, so it counts tp times: " \
               "add it once, after all_reduce"
    if close((want - b) / step.tp + b):
        return "the partial outputs were averaged: all_reduce sums them (the output is the " \
               "sum over every head)"
    return next((hint for out, hint in _slipped(step, rank) if close(out)), None)


def compare(step: Step, results: list) -> None:
    """Every rank's output against the single-device layer, its cache against the library
    rank's: the first difference as a story."""
    want, _ = single_device(step)
    for rank, (out, cache) in enumerate(results):
        what = f"step '{step.name}', rank {rank} of {step.tp}"
        grading.expect_true(isinstance(out, torch.Tensor), f"{what}: returned "
                            f"{type(out).__name__}", "return the layer's output, a tensor "
                            "[tokens, hidden]")
        grading.expect_true(tuple(out.shape) == tuple(want.shape), f"{what}: output of shape "
                            f"{tuple(out.shape)}, expected {tuple(want.shape)}",
                            "return [tokens, hidden]: after o_proj, not the heads")
        bad = ~torch.isclose(out.detach().float(), want, 1e-4, 1e-5)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            grading.fail(f"{what}: {_token(step, row)}, output {col}: the single-device "
                         f"layer gives {want[row, col]:.5f}, yours {float(out[row, col]):.5f}",
                         _NAN if out[row, col].isnan() else
                         _mistake(step, rank, out.detach().float(), want) or step.hint)
        lib = share(step, rank)
        rank_attention(step.x, step.w, step.cos, step.sin, lib, step.meta, rank, step.tp,
                       _identity)
        for name, mine, ref in zip("KV", cache, lib, strict=True):
            same = torch.isclose(mine, ref, 1e-5, 1e-6, equal_nan=True)
            if not bool(same.all()):
                blk, off, head = (int(i) for i in (~same).nonzero()[0][:3])
                grading.fail(f"{what}: your cache's {name} of block {blk}, slot {off}, the "
                             f"rank's KV head {head}: expected {float(ref[blk, off, head, 0]):.4f}"
                             f", got {float(mine[blk, off, head, 0]):.4f} (nan: never written)",
                             _REPLICA if step.w.num_kv_heads < step.tp else
                             "write this rank's KV heads (rotated K, and V) of the new tokens at "
                             "meta.slot_mapping, into the cache it is given")


# ------------------------------------------------------------------ generated steps

#: (ranks, query heads, KV heads), as models shard: split KV heads, replicated ones (more
#: ranks than KV heads), MHA, MQA, groups of 3 and 7
_SHARDS = [(2, 4, 2), (2, 6, 2), (2, 14, 2), (2, 4, 4), (2, 2, 1), (3, 6, 3), (3, 3, 1),
           (3, 12, 3), (3, 6, 1), (4, 8, 2), (4, 4, 1), (4, 8, 4), (4, 16, 8), (4, 12, 4)]


@dataclass(frozen=True)
class Rank:
    """One generated step of 12.3."""

    seed: int
    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    block_size: int
    lens: tuple[tuple[int, int], ...]  # (cached, new) per sequence
    bias: bool
    loud: float

    def describe(self) -> str:
        kv = (f"{self.kv_heads} KV heads, {self.kv_heads // self.tp} per rank"
              if self.kv_heads >= self.tp else
              f"{self.kv_heads} KV head(s), each on {self.tp // self.kv_heads} ranks")
        return (f"{self.tp} ranks, {self.heads} query heads on {kv}, head_dim "
                f"{self.head_dim} with hidden {self.hidden} ("
                + ("=" if self.heads * self.head_dim == self.hidden else "!=")
                + f" heads x head_dim), blocks of {self.block_size}, sequences (cached, new) "
                f"{list(self.lens)}" + (", biases on q, k, v and o" if self.bias else "")
                + (f", inputs x {self.loud:g}" if self.loud != 1 else ""))

    def states(self) -> list[str]:
        """The states of this step that the named steps of 12.3 do not have."""
        out = [f"{self.tp} ranks"] if self.tp == 3 else []
        group = self.heads // self.kv_heads
        out += [f"GQA groups of {group}"] if group not in (1, 2, 4, 8) else []
        out += [f"hidden {self.hidden}"] if self.hidden != 32 else []
        out += [f"head_dim {self.head_dim}"] if self.head_dim != 8 else []
        out += [f"blocks of {self.block_size}"] if self.block_size != 4 else []
        out += ["a sequence over 10 tokens"] if max(c + n for c, n in self.lens) > 10 else []
        out += ["louder inputs"] if self.loud > 1 else []
        return out

    def smaller(self) -> Iterator[Rank]:
        lens = self.lens
        for i, (cached, new) in enumerate(lens):
            if len(lens) > 1:
                yield dataclasses.replace(self, lens=lens[:i] + lens[i + 1:])
            for c in shorter(cached, 0):
                yield dataclasses.replace(self, lens=lens[:i] + ((c, new),) + lens[i + 1:])
            for n in shorter(new):
                yield dataclasses.replace(self, lens=lens[:i] + ((cached, n),) + lens[i + 1:])
        for tp, heads, kv in _SHARDS:
            if (heads, kv) < (self.heads, self.kv_heads) and tp <= self.tp:
                yield dataclasses.replace(self, tp=tp, heads=heads, kv_heads=kv)
        yield from fewer(self, bias=[False], loud=[1.0], block_size=[4],
                         head_dim=[d for d in (4, 8) if d < self.head_dim])


def _draw(seed: int) -> Rank:
    g = torch.Generator().manual_seed(1230 + seed)

    def pick(xs: list | tuple):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    tp, heads, kv = pick(_SHARDS)
    d = pick([4, 6, 8, 10, 12, 16])
    hidden = pick([heads * d, 24, 40, 48])
    lens = []
    for _ in range(pick([1, 2, 3])):
        kind = pick(["decode", "decode", "prefill", "chunk"])
        cached = 0 if kind == "prefill" else pick([1, 3, 4, 8, 15, 16, 30])
        lens.append((cached, 1 if kind == "decode" else pick([1, 2, 5, 8])))
    return Rank(seed, tp, heads, kv, d, hidden, (1, 2, 3, 4, 5, 8)[seed % 6], tuple(lens),
                seed % 4 == 1, (1.0, 1.0, 4.0)[seed % 3])


def rank_cases(count: int = 24) -> list[Rank]:
    """12.3's generated steps (seeds 0, 1, ...), every one a sharding that exists."""
    out = [_draw(seed) for seed in range(count)]
    assert not any(tp_size_problem(p.heads, p.kv_heads, p.tp) for p in out)
    return out


RANK_CONTRASTS = (
    Contrast(lambda p: dataclasses.replace(p, tp=4, heads=p.heads // p.tp * 4)
             if p.kv_heads == 1 and p.tp == 3 else None,
             "it passes on 4 ranks for one KV head and fails on 3: rank r keeps KV head "
             "r // (tp_size // num_kv_heads), a division; a shift (r >> log2(...)) or a "
             "mask is that only when each KV head sits on 2 or 4 ranks"),
    Contrast(lambda p: dataclasses.replace(p, hidden=p.heads * p.head_dim)
             if p.hidden != p.heads * p.head_dim else None,
             "it passes when hidden == num_heads x head_dim and fails otherwise: a rank's "
             "rows of q, k and v and its columns of o are its heads x head_dim, counted in "
             "head_dim (w.head_dim), not hidden / num_heads or hidden / tp (Gemma's heads "
             "are wider than hidden / num_heads)"),
    Contrast(lambda p: dataclasses.replace(p, block_size=4) if p.block_size != 4 else None,
             "it passes with blocks of 4 and fails with other block sizes: read the block "
             "size from the cache (its dimension 1) and the slots from meta.slot_mapping"),
    Contrast(lambda p: dataclasses.replace(p, tp=2, heads=4, kv_heads=2)
             if (p.tp, p.heads, p.kv_heads) != (2, 4, 2) else None,
             "it passes on 2 ranks with 4 query heads and 2 KV heads and fails on this "
             "sharding: a rank owns num_heads / tp contiguous query heads, and the KV heads "
             "they read: num_kv_heads / tp of them, or with fewer KV heads than ranks the "
             "one KV head r // (tp / num_kv_heads)"),
)


def _ask(fn: Callable, step: Step) -> None:
    """Every rank's answer to ``step`` (the all-reduce replayed), compared."""
    try:
        results = replayed(fn, step)
    except (grading.CheckFailed, NotImplementedError):
        raise
    except Exception as err:  # noqa: BLE001 - told with the step that raised it
        grading.fail(f"step '{step.name}': your function raised {type(err).__name__}: {err}",
                     step.hint)
    compare(step, results)


def check_generated(fn: Callable) -> None:
    """The generated steps (:func:`rank_cases`), each asked as the named ones; a failing
    one is shrunk."""
    numeric.check("12.3", rank_cases(), lambda p: _ask(fn, _step(
        "generated", p.tp, p.heads, p.kv_heads, list(p.lens),
        _REPLICA if p.kv_heads < p.tp else _SPLIT, p.seed, p.bias, p.head_dim, p.block_size,
        p.hidden, p.loud)), RANK_CONTRASTS)


# ------------------------------------------------------------------ on two gloo ranks

#: seconds the check waits for the two gloo ranks to answer one step
GLOO_TIMEOUT = 60


def shipped(fn: Callable) -> tuple[str, Any]:
    """``fn`` in a form a spawned process can rebuild: by reference when its module can be
    imported there, else its source with the imports and helpers it uses
    (:func:`paged_lib.course.mine.section_text`: a notebook's ``__main__`` is not)."""
    module = getattr(fn, "__module__", "__main__")
    if module != "__main__" and "<locals>" not in getattr(fn, "__qualname__", "<locals>"):
        if _importable(module):
            try:
                return "pickle", pickle.dumps(fn)
            except Exception:  # noqa: BLE001 - not picklable: try the source
                pass
        path = getattr(sys.modules.get(module), "__file__", None)
        if path:  # a module loaded from its file (mine/ch12.py): the file travels
            text = Path(path).read_text()
            if fn.__name__ != "rank_attention":
                text += f"\nrank_attention = {fn.__name__}\n"
            return "source", text
    from paged_lib.course import mine

    return "source", mine.section_text(fn, "rank_attention")


def _importable(module: str) -> bool:
    """Can a spawned process import ``module`` by name (pickle's way of sending a function)?"""
    try:  # looked up on sys.path, not in sys.modules (mine/ch12.py is loaded by file)
        return importlib.machinery.PathFinder.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _rebuilt(kind: str, body: Any) -> Callable:
    if kind == "pickle":
        return pickle.loads(body)
    space: dict[str, Any] = {"__name__": "your_rank_attention"}
    exec(compile(body, "<your rank_attention>", "exec"), space)  # noqa: S102
    return space["rank_attention"]


class _Sent:
    """The learner's function as a spawned rank rebuilds it (:func:`shipped`), called on
    copies of its inputs (what it changes in place must not reach the model)."""

    def __init__(self, body: tuple[str, Any]):
        self.body, self.fn = body, None

    def __call__(self, x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
        if self.fn is None:
            self.fn = _rebuilt(*self.body)
        return self.fn(x.clone(), copy.deepcopy(w), cos.clone(), sin.clone(), kv_cache,
                       copy.deepcopy(meta), rank, tp, all_reduce)


#: the engine whose model calls are replayed on the ranks: the shipped model, prefix
#: caching, chunks of 12 tokens, samples, swaps on a pool of 14 blocks of 4
ENGINE = dict(num_blocks=14, block_size=4, num_cpu_blocks=32, preemption="swap",
              enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=12, max_num_seqs=4, watermark=0)


@functools.cache
def engine_calls() -> list[tuple[Any, torch.Tensor]]:
    """(ModelInput, logits) of every step a single-device engine ran on a small workload."""
    from paged_lib.engine import LLMEngine, SamplingParams
    from paged_lib.model import load_tiny_code_llama
    from paged_lib.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    head = "def area(w, h):\n    "
    prompts = [tok.encode(head + t) for t in ("return w * h", "# the area", "pass")]
    params = [SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=3),
              SamplingParams(max_tokens=7, temperature=0.0)]
    engine = LLMEngine(load_tiny_code_llama(), **ENGINE)
    calls, execute = [], engine.runner.execute

    def record(inp):
        logits = execute(inp)
        calls.append((pickle.loads(pickle.dumps(inp)), logits.clone()))
        return logits

    engine.runner.execute = record
    engine.generate(prompts, params)
    return calls


def _on_gloo_ranks(fn: Callable) -> None:
    """Every step of :func:`engine_calls` on two gloo ranks with ``fn`` as every layer's
    attention: rank 0's logits against the single-device engine's."""
    from paged_lib.engine.tensor_parallel import TensorParallelRunner
    from paged_lib.model import load_tiny_code_llama

    try:
        body = shipped(fn)
    except Exception as err:  # noqa: BLE001 - mine.CannotSave and the like
        grading.fail(f"your function cannot be sent to the rank processes: {err}",
                     "define rank_attention with def at the top of its cell; it may use "
                     "imports, constants and functions of the notebook")
    calls = engine_calls()
    try:
        runner = TensorParallelRunner(load_tiny_code_llama(), ENGINE["num_blocks"],
                                      ENGINE["block_size"], ENGINE["num_cpu_blocks"],
                                      timeout=GLOO_TIMEOUT, rank_attention=_Sent(body))
    except Exception as err:  # noqa: BLE001 - the check's machinery, not the learner's code
        grading.fail(f"the check could not start its two rank processes ({type(err).__name__}"
                     f": {err}); this is not your function", "run the check from a notebook, "
                     "or from a script whose checks sit under `if __name__ == \"__main__\":` "
                     "(each rank process is started with multiprocessing's spawn)")
    try:
        for k, (inp, want) in enumerate(calls):
            try:
                got = runner.execute(inp)
            except RuntimeError as err:  # a rank raised, or did not answer
                grading.fail(f"on two gloo ranks, engine step {k + 1}: "
                             f"{str(err).strip().splitlines()[-1]}",
                             "the function runs in a fresh process on each rank: it may use "
                             "only its arguments (the all_reduce it is given), imports and the "
                             "notebook's functions and constants; each rank calls all_reduce "
                             "once per layer (a rank that waits for a sum the other never "
                             "sends hangs)")
            if got.shape == want.shape and torch.allclose(got, want, 1e-3, 1e-3):
                continue
            s = int((got - want).abs().amax(1).argmax()) if got.shape == want.shape else 0
            new = inp.query_lens[s]
            grading.fail(
                f"serving a workload on two gloo ranks with your attention in every layer of "
                f"the shipped model (prefix caching, chunked prefill, samples, swaps): at "
                f"engine step {k + 1}, sequence {s} ({new} new token{'s' if new > 1 else ''} "
                f"at positions {inp.seq_lens[s] - new} to {inp.seq_lens[s] - 1}): the "
                f"single-device engine's next token is {int(want[s].argmax())}, yours "
                f"{int(got[s].argmax())} (largest logit difference "
                f"{float((got[s] - want[s]).abs().max()):.3g})",
                "the steps above pass, the engine's do not: compare this step's state (its "
                "block table, a prefill that starts mid-sequence) with theirs")
    finally:
        runner.close()


def _in_a_rank_bootstrapping() -> bool:
    """True in a process that spawn started and that is still importing the parent's
    main module (a learner's script with no ``__main__`` guard runs its checks again
    there; starting ranks from it is what multiprocessing calls "before the current
    process has finished its bootstrapping phase")."""
    return mp.parent_process() is not None and bool(
        getattr(mp.current_process(), "_inheriting", False))


def check_rank_attention(fn: Callable[..., torch.Tensor]) -> None:
    """12.3: one rank's attention layer, its all-reduce included."""
    if _in_a_rank_bootstrapping():
        return  # a script re-imported by a spawned rank: the parent prints the verdict
    with grading.exercise("12.3"):
        for step in steps():
            _ask(fn, step)
        check_generated(fn)
        _on_gloo_ranks(fn)
