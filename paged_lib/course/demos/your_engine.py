"""Chapter 13: an engine built from the learner's saved pieces (:mod:`paged_lib.course.mine`).

* :func:`gather` reads ``mine/`` and says, piece by piece, whose code runs: the learner's
  (saved when its check passed) or the library's (not saved yet, or saved but not
  importable);
* :func:`build` makes an :class:`~paged_lib.engine.LLMEngine` with those pieces: the
  engine's hooks (06, 07, 08, 10), the block table's ``append_token`` and ``fork`` and the
  allocator's ``free`` (03), the slot mapping (05.6) in the step's metadata;
  :func:`your_decode_kernel` lets the learner's Triton decode kernel (05.5) compute the
  decode attention of every layer while a block runs;
* :func:`mixed_workload` is what it serves (sampling, beams, a shared prefix with prefix
  caching, preemption by swap); :func:`check` compares the tokens with transformers'
  and the library engine's, and :func:`blame` names the pieces that change them;
* :class:`YourLLM` is vLLM's ``LLM`` over the learner's engine.
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
from paged_lib.engine import LLM, EngineHooks, LLMEngine, SamplingParams
from paged_lib.model import AttentionMetadata, TinyLlama
from paged_lib.tokenizer import ByteTokenizer

#: exercise id -> the EngineHooks field its piece goes to (the saved piece's own name)
HOOKS = {"06.1": "build_metadata", "06.2": "num_required_blocks", "06.3": "can_admit",
         "07.1": "swap_mapping", "07.2": "choose_victim", "08.2": "beam_step",
         "10.1": "block_hashes", "10.2": "longest_cache_hit", "10.3": "FreeBlockQueue",
         "10.4": "allocate_slots",
         "11.3": "write_int8_blocks", "11.4": "drop_oldest"}


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
    for ex_id, piece in mine.PIECES.items():
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
    engine = LLMEngine(model, num_blocks, block_size, hooks=EngineHooks(**hooks), **options)
    bm = engine.block_manager
    if "03.3" in pieces:
        free_block = pieces["03.3"]
        for pool in (bm.gpu, bm.cpu):
            if pool is not None:  # nothing is allocated yet: the class can change
                pool.__class__ = type(f"Your{type(pool).__name__}", (type(pool),), {
                    "free": lambda self, b: free_block(b, self.ref_counts,
                                                       self.free_block_ids)})
    return engine


@contextlib.contextmanager
def your_decode_kernel(kernel: Any | None) -> Iterator[None]:
    """While the block runs, every decode row's attention is the learner's Triton kernel
    (05.5's launch: one program per sequence and KV head); ``None`` changes nothing."""
    import paged_lib.model as model_module

    if kernel is None:
        yield
        return
    library = model_module.paged_attention

    def attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, **_):
        num_seqs, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        out = torch.empty_like(q)
        kernel[(num_seqs, kv_heads)](
            out, q, k_cache, v_cache, block_tables, seq_lens,
            scale if scale is not None else 1 / math.sqrt(head_dim), block_tables.shape[1],
            NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(1, 1 << (group - 1).bit_length()),
            HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1])
        return out

    model_module.paged_attention = attention
    try:
        yield
    finally:
        model_module.paged_attention = library


# ------------------------------------------------------------------ the workload

#: the pool (blocks of 16 tokens), small enough that the workload preempts
NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS = 15, 16, 32
OPTIONS = dict(preemption="swap", num_cpu_blocks=NUM_CPU_BLOCKS, enable_prefix_caching=True,
               watermark=0.0)
PREFIX = "def mean(values):\n    \"\"\"The average of a list of numbers.\"\"\"\n"


def mixed_workload() -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """Prompts (token ids), their params and arrival steps: two greedy requests sharing
    a prefix (the second arrives later, when the prefix's blocks are cached), a sampled
    one (top-k, top-p, seeded), parallel samples, a beam search."""
    tok = ByteTokenizer()
    texts = [PREFIX + "    total = ", "import os\n", "class Stack:\n    def ",
             "for i in range(", PREFIX + "    if not values:"]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.95, seed=1,
                             ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, n=3, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=12, beam_width=3),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)]
    return [tok.encode(t) for t in texts], params, [0, 0, 0, 1, 3]


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def hf_reference(hf, prompts: list[list[int]], params: list[SamplingParams]
                 ) -> dict[int, list[int]]:
    """transformers' tokens for every request with one output that it samples the same
    way (greedy, or seeded sampling with ``top_k`` / ``top_p``): request index -> tokens."""
    want = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        if sp.beam_width is not None or sp.n > 1:
            continue
        kw = dict(do_sample=False) if sp.temperature == 0 else dict(
            do_sample=True, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
        if sp.seed is not None:
            torch.manual_seed(sp.seed)
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=sp.max_tokens,
                              eos_token_id=None, pad_token_id=0, **kw)
        want[i] = out[0, len(p):].tolist()
    return want


def kernel_workload() -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """A small greedy batch for the decode kernel: Triton's interpreter runs each of its
    programs as Python on a CPU, too slow for the whole workload."""
    tok = ByteTokenizer()
    return [tok.encode("def "), tok.encode("import ")], \
        [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)] * 2, \
        [0, 0]


def serve(model: TinyLlama, pieces: dict[str, Any], workload=None, decode_kernel=None):
    """``workload`` (default :func:`mixed_workload`) on an engine of ``pieces``, with
    ``decode_kernel`` (if given) computing the decode attention; (outputs, stats)."""
    prompts, params, arrivals = mixed_workload() if workload is None else workload
    engine = build(model, NUM_BLOCKS, BLOCK_SIZE, pieces, **OPTIONS)
    with your_decode_kernel(decode_kernel):
        outputs = engine.generate(prompts, params, arrivals)
    return outputs, engine.stats


def outcome(outputs, stats) -> tuple[list, dict]:
    """What must not depend on whose pieces run: the tokens, and the schedule (steps,
    preemptions, swaps, prefix-cache hits, blocks held)."""
    return token_ids(outputs), {**stats.summary(),
                                "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens}


def blame(model: TinyLlama, pieces: dict[str, Any], expected, workload=None
          ) -> list[tuple[str, str]]:
    """The learner's pieces that, alone among the library's, change ``workload``'s
    :func:`outcome` from ``expected`` (or raise): ``(exercise id, what went wrong)``.
    The kernel (05.5) is tried on :func:`kernel_workload` only."""
    found = []
    for ex_id, obj in pieces.items():
        if ex_id == "05.5":
            continue
        try:
            tokens, schedule = outcome(*serve(model, {ex_id: obj}, workload))
        except Exception as err:  # a learner's bug: named, not a traceback
            found.append((ex_id, f"raised {type(err).__name__}: {err}"))
            continue
        if tokens != expected[0]:
            found.append((ex_id, "changed the generated tokens"))
        elif schedule != expected[1]:
            changed = [k for k in schedule if schedule[k] != expected[1][k]]
            found.append((ex_id, f"changed the schedule ({', '.join(changed)})"))
    return found


def check(model: TinyLlama, hf, pieces: dict[str, Any], parts: list[Part]) -> bool:
    """Serve both workloads on the learner's engine and print what matched: the library
    engine's tokens and schedule, transformers' tokens, and which piece broke them."""
    ok = True
    for name, workload, kernel in (("the mixed workload", mixed_workload(), None),
                                   ("the kernel's batch", kernel_workload(),
                                    pieces.get("05.5"))):
        library = outcome(*serve(model, {}, workload))
        want = hf_reference(hf, workload[0], workload[1])
        try:
            got = outcome(*serve(model, pieces, workload, kernel))
        except Exception as err:
            got, error = (None, None), f"{type(err).__name__}: {err}"
        same_hf = got[0] is not None and all(got[0][i][0] == t for i, t in want.items())
        print(f"{name}: tokens equal the library engine's: {got[0] == library[0]}, and "
              f"transformers' ({len(want)} requests): {same_hf}; the same schedule: "
              f"{got[1] == library[1]}")
        if got[0] is None:
            print(f"   your engine raised {error}")
        if got != library or not same_hf:
            ok = False
            try:  # the kernel alone to blame when the other pieces serve this right
                without = outcome(*serve(model, pieces, workload)) if kernel else None
            except Exception:
                without = None
            bad = [("05.5", "changed the decoded tokens")] if without == library else \
                blame(model, pieces, library, workload)
            for ex_id, what in bad:
                print(f"   ❌ your {ex_id} ({mine.PIECES[ex_id].role}) {what}")
    return ok


class YourLLM(LLM):
    """vLLM's ``LLM`` (:class:`paged_lib.engine.llm.LLM`) over an engine of the learner's
    pieces (default: :func:`gather`'s). Attention runs the library's kernels: the decode
    kernel (05.5) serves :func:`kernel_workload` in :func:`check`."""

    def __init__(self, model, pieces: dict[str, Any] | None = None, **options):
        super().__init__(model, **options)
        engine_options = {k: v for k, v in options.items()
                          if k not in ("tokenizer", "num_blocks", "block_size", "dtype", "device")}
        e = self.engine
        self.engine = build(e.model, e.num_blocks, e.block_size, pieces,
                            tokenizer=self.tokenizer, **engine_options)


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
