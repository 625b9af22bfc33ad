"""Chapter 13: an engine built from the learner's saved pieces (:mod:`paged_lib.course.mine`).

* :func:`gather` reads ``mine/`` and says, piece by piece, whose code runs: the learner's
  (saved when its check passed) or the library's (not saved yet, or saved but not
  importable);
* :func:`build` makes an :class:`~paged_lib.engine.LLMEngine` with those pieces: the
  engine's hooks (:data:`paged_lib.course.exercises.HOOKS`: chapters 06, 07, 08, 10 and
  later), the block table's
  ``append_token`` and ``fork`` and the allocator's ``free`` (03), the slot mapping (05.6)
  in the step's metadata; :func:`your_decode_kernel` lets the learner's Triton decode
  kernel (05.5) compute the decode attention of every layer while a block runs;
* :class:`YourLLM` is vLLM's ``LLM`` over the learner's engine.

Each piece is checked on its own scenarios by
:mod:`~paged_lib.course.demos.your_engine_scenarios`; the whole engine serves the real
model in :mod:`~paged_lib.course.demos.your_engine_check`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_lib.blocks import BlockTable
from paged_lib.course import mine
from paged_lib.course.exercises import HOOKS, SAVED
from paged_lib.engine import LLM, EngineHooks, LLMEngine
from paged_lib.model import AttentionMetadata, TinyLlama

#: (exercise id, id of the piece) -> (the piece, None or what its scenarios found), as
#: :func:`paged_lib.course.demos.your_engine_scenarios.check_piece` last said
VERDICTS: dict[tuple[str, int], tuple[Any, str | None]] = {}


def replaced(pieces: dict[str, Any]) -> dict[str, Any]:
    """``pieces`` without those whose scenarios found a difference (the library's run in
    their place), with a line naming them; a piece not checked yet stays."""
    failed = sorted(k for k, v in pieces.items()
                    if (known := VERDICTS.get((k, id(v)))) is not None and known[0] is v
                    and known[1] is not None)
    if failed:
        print(f"the library's {', '.join(failed)} in place of yours (named ❌ above)")
    return {k: v for k, v in pieces.items() if k not in failed}


@dataclass(frozen=True)
class Part:
    ex_id: str
    role: str
    yours: bool
    note: str = ""

    def line(self) -> str:
        who = "yours  " if self.yours else "library"
        return f"{self.ex_id}  {who}  {self.role}" + (f"  ({self.note})" if self.note else "")


def gather(folder: Path | None = None) -> tuple[dict[str, Any], list[Part]]:
    """(the learner's pieces by exercise id, one :class:`Part` per piece of the engine)."""
    pieces: dict[str, Any] = {}
    parts = []
    for ex_id, piece in SAVED.items():
        try:
            obj = mine.load(ex_id, folder)
            note = "" if obj is not None else f"exercise {ex_id} not passed yet"
        except ImportError as err:
            obj, note = None, f"saved but {err}"
        if obj is not None:
            pieces[ex_id] = obj
        parts.append(Part(ex_id, piece.role, obj is not None, note))
    return pieces, parts


def summary(parts: list[Part]) -> str:
    mine_count = sum(p.yours for p in parts)
    return f"{mine_count} of {len(parts)} pieces of the engine are yours"


def _with_slot_mapping(build_metadata, slot_mapping):
    """05.6 inside the step: the learner's slot mapping, from the padded tables, must
    agree with the metadata's (a ValueError says which step they disagree in)."""
    def build(tables, seq_lens, query_lens, block_size) -> AttentionMetadata:
        meta = build_metadata(tables, seq_lens, query_lens, block_size)
        seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)),
                                          torch.tensor(query_lens))
        slots = slot_mapping(meta.block_tables, seq_ids, meta.positions, block_size)
        if not torch.equal(slots.to(torch.int64), meta.slot_mapping):
            raise ValueError(f"slot_mapping (05.6) gives {slots.tolist()}, build_metadata "
                             f"(06.1) {meta.slot_mapping.tolist()}")
        return meta
    return build


def build(model: TinyLlama, num_blocks: int, block_size: int = 16,
          pieces: dict[str, Any] | None = None, **options) -> LLMEngine:
    """An engine over ``model`` running ``pieces`` (default: :func:`gather`'s) in place
    of the library's; ``options`` go to :class:`LLMEngine`."""
    pieces = gather()[0] if pieces is None else pieces
    hooks = {HOOKS[k]: v for k, v in pieces.items() if k in HOOKS}
    if "05.6" in pieces:
        from paged_lib.engine.model_runner import build_metadata
        hooks["build_metadata"] = _with_slot_mapping(hooks.get("build_metadata",
                                                               build_metadata), pieces["05.6"])
    table = {name: pieces[k] for k, name in (("03.1", "append_token"), ("03.2", "fork"))
             if k in pieces}
    if table:
        hooks["BlockTable"] = type("YourBlockTable", (BlockTable,), table)
    tp = options.get("tensor_parallel_size", 1)
    if "12.3" in pieces and tp > 1:  # every rank's attention is the learner's (12.3)
        options = {**options, "tensor_parallel_size": 1}
    engine = LLMEngine(model, num_blocks, block_size, hooks=EngineHooks(**hooks), **options)
    if "12.3" in pieces and tp > 1:
        from paged_lib.course.grading.ch12 import Shipped
        from paged_lib.engine.tensor_parallel import TensorParallelRunner

        engine.runner = TensorParallelRunner(  # the saved piece's code travels to the ranks
            model, num_blocks, block_size, options.get("num_cpu_blocks", 0),
            tensor_parallel_size=tp, rank_attention=Shipped(pieces["12.3"]))
    bm = engine.block_manager
    if "03.3" in pieces:
        free_block = pieces["03.3"]
        for pool in (bm.gpu, bm.cpu):
            if pool is not None:  # nothing is allocated yet: the class can change
                pool.__class__ = type(f"Your{type(pool).__name__}", (type(pool),), {
                    "free": lambda self, b: free_block(b, self.ref_counts,
                                                       self.free_block_ids)})
    return engine


class AttentionDiffers(ValueError):
    """The learner's decode kernel computed another attention than the library's."""


@contextlib.contextmanager
def your_decode_kernel(kernel: Any | None, compare: bool = False) -> Iterator[None]:
    """While the block runs, every decode row's attention is the learner's Triton kernel
    (05.5's launch: one program per sequence and KV head); ``None`` changes nothing.
    ``compare``: each call is also computed by the library, and a difference over 1e-4
    raises :class:`AttentionDiffers` saying where."""
    import paged_lib.model as model_module

    if kernel is None:
        yield
        return
    library = model_module.paged_attention
    calls = [0]

    def attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, **options):
        out = run_kernel(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale)
        calls[0] += 1
        if compare:
            want = library(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, **options)
            err = (out - want).abs().max().item()
            if not err <= 1e-4:  # (NaN too)
                raise AttentionDiffers(
                    f"decode attention call {calls[0]} (sequence lengths "
                    f"{seq_lens.tolist()}, blocks of {k_cache.shape[1]}): your kernel's "
                    + (NAN_READ if out.isnan().any() and not want.isnan().any() else
                       f"output is {err:.3g} away from the library's"))
        return out

    model_module.paged_attention = attention
    try:
        yield
    finally:
        model_module.paged_attention = library


NAN_READ = ("output is NaN: it read outside what the sequence holds (a slot past "
            "seq_len, a block of the table's padding, or memory before or after the tensors, "
            "which the check surrounds with NaN)")


def _guarded(t: torch.Tensor, pad: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``t`` inside a buffer with ``pad`` elements of ``fill`` on each side (a
    kernel's read or write just outside ``t`` lands there, not in memory it does not own);
    (the copy, the whole buffer)."""
    buf = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype)
    inner = buf[pad:pad + t.numel()]
    inner.copy_(t.reshape(-1))
    return inner.view(t.shape), buf


def run_kernel(kernel: Any, q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """05.5's launch: one program per sequence and KV head, on copies of the inputs fenced
    with NaN (the caches: two blocks each side; a table's padding id -1 reads NaN there)
    and tables fenced with -1; a write outside the output raises
    :class:`AttentionDiffers`."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    block = k_cache[0].numel()
    nan = float("nan")
    q, _ = _guarded(q, q[0].numel(), nan)
    k_cache, _ = _guarded(k_cache, 2 * block, nan)
    v_cache, _ = _guarded(v_cache, 2 * block, nan)
    block_tables, _ = _guarded(block_tables, 2 * block_tables.shape[-1] + 1, -1)
    seq_lens, _ = _guarded(seq_lens, 1, 0)
    out, fence = _guarded(torch.empty_like(q), q[0].numel(), nan)
    kernel[(num_seqs, kv_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens,
        scale if scale is not None else 1 / math.sqrt(head_dim), block_tables.shape[1],
        NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(1, 1 << (group - 1).bit_length()),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1])
    pad = q[0].numel()
    if not bool(fence[:pad].isnan().all() and fence[-pad:].isnan().all()):
        raise AttentionDiffers("your kernel wrote outside its output tensor: store only the "
                               "query heads of its own program (mask the padded group)")
    return out.clone()


class YourLLM(LLM):
    """vLLM's ``LLM`` (:class:`paged_lib.engine.llm.LLM`) over an engine of the learner's
    pieces (default: :func:`gather`'s), except those its scenarios named wrong
    (:func:`replaced`: the library's stands in, as in the chat workload). Attention runs
    the library's kernels: the decode kernel (05.5) is checked on its own scenario and on
    one layer of the real model."""

    def __init__(self, model, pieces: dict[str, Any] | None = None, **options):
        pieces = replaced(gather()[0] if pieces is None else pieces)
        super().__init__(model, **options)
        engine_options = {k: v for k, v in options.items()
                          if k not in ("tokenizer", "num_blocks", "block_size", "dtype", "device")}
        e = self.engine
        engine_options["max_model_len"] = e.max_model_len  # the front's choice (2048)
        e.close()
        self.engine = build(e.model, e.num_blocks, e.block_size, pieces,
                            tokenizer=self.tokenizer, **engine_options)


def error_line(err: BaseException) -> str:
    """``err``'s message on one line: its first ('' if none), with a traceback's last line
    (the error) when the first introduces one (a tensor-parallel rank's)."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()] or [""]
    return f"{lines[0]} {lines[-1]}" if len(lines) > 1 and lines[0].endswith(":") else lines[0]


PADDED_GROUP = ("one decode call with 3 query heads per KV head (the tiny model has 2; "
                "SmolLM2 3: the group padded to 4)")


def check_padded_group(kernel: Any) -> str | None:
    """The kernel on :data:`PADDED_GROUP` beside the library's attention: what differs."""
    from paged_lib.kernels import paged_attention

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 6, 4, 2, 8, generator=g)
    args = (torch.randn(2, 6, 8, generator=g), k, v,
            torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32),
            torch.tensor([9, 12], dtype=torch.int32))
    try:
        out = run_kernel(kernel, *args)
    except Exception as err:  # noqa: BLE001 - a learner's kernel: a line, no traceback
        what = str(err) if isinstance(err, AttentionDiffers) else \
            f"raised {type(err).__name__}: {error_line(err)[:300]}"
        return f"on {PADDED_GROUP}: {what}"
    err = (out - paged_attention(*args, backend="torch")).abs().max().item()
    return None if err <= 1e-4 else f"on {PADDED_GROUP}: your kernel's " + (
        NAN_READ if out.isnan().any() else f"output is {err:.3g} away from "
        "the library's (mask the padded query heads of the group)")


def main() -> int:
    """Run chapter 13's notebook on what ``mine/`` holds and print its text outputs (the
    fork's grade workflow does this after ``make grade``); 1 if a check failed."""
    from paged_lib.course import notebooks
    from paged_lib.course.chapters import REPO
    from paged_lib.course.grading.scoreboard import _text

    nb = notebooks.execute(REPO / "notebooks" / "13_your_engine.ipynb", keep_going=True)
    failed = False
    for _, cell in notebooks.code_cells(nb):
        text = _text(cell.outputs)
        errors = [f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error"]
        print(text + "".join(f"ERROR {e}\n" for e in errors), end="")
        failed |= bool(errors) or "❌" in text
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
