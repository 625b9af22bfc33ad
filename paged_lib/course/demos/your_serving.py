"""The chapters' demos on the learner's own engine pieces (chapters 06-08, 10, 14).

Each ``chapter_NN`` runs at the end of chapter NN's exercise notebook: the chapter's trace
served by the engine with the learner's hooks in place of the library's, next to the
library's own run, and a line that says whether tokens and steps agree. A piece not written
yet gets ⏳ and one that raises gets ❌ (:func:`paged_lib.course.grading.on_learner_code`),
never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from paged_lib.course import grading
from paged_lib.course.demos.engine_compare import (
    PRESSURE_BLOCK_SIZE,
    PRESSURE_BLOCKS,
    pressure_requests,
)
from paged_lib.course.grading import serving
from paged_lib.engine import EngineHooks
from paged_lib.tokenizer import ByteTokenizer

#: the tiny code model's tokenizer (chapter 14's demo decodes with it)
TOKENIZER = ByteTokenizer()


def chapter_07(swap_mapping: Callable[..., Any], choose_victim: Callable[..., Any],
               model: Any = None, preempt_until_fits: Callable[..., Any] | None = None) -> None:
    """The chapter's too-small pool served with the learner's ``choose_victim`` (and
    ``preempt_until_fits`` when given), by recompute and by swap (with the learner's
    mapping), next to the library's runs."""
    from paged_lib.model import load_tiny_code_llama

    model = model if model is not None else load_tiny_code_llama()
    prompts, params = pressure_requests()

    also = "" if preempt_until_fits is None else " (and preempt_until_fits)"
    asked = [0]

    def victim(running: list) -> Any:
        asked[0] += 1
        return choose_victim(running)

    def serve(mode: str, **hooks: Any) -> None:
        asked[0] = 0
        if preempt_until_fits is not None:
            hooks["preempt_until_fits"] = preempt_until_fits
        run = serving.side_by_side(model, PRESSURE_BLOCKS, PRESSURE_BLOCK_SIZE, prompts,
                                   params, EngineHooks(choose_victim=victim, **hooks),
                                   num_cpu_blocks=64, preemption=mode)
        s, r = run.yours.stats, run.library.stats
        print(f"recompute, your choose_victim{also}: {len(prompts)} requests on {PRESSURE_BLOCKS} "
              f"blocks in {s.steps} steps (library: {r.steps}), {s.preemptions} preemptions "
              f"(library: {r.preemptions}), {s.recomputed_tokens} tokens recomputed "
              f"(library: {r.recomputed_tokens})" if mode == "recompute" else
              f"swap, your choose_victim and swap_mapping{also}: {s.preemptions} preemptions, "
              f"{s.swapped_blocks} block copies (library: {r.preemptions}, "
              f"{r.swapped_blocks})")
        print(f"every token {'equals' if run.same_tokens else 'DIFFERS from'} the library "
              "engine's")
        if s.preemptions and not asked[0]:
            print("your preempt_until_fits never asked step.hooks.choose_victim: these "
                  "victims are its own choice, not your choose_victim's")

    grading.on_learner_code(lambda: serve("recompute"), "exercises 07.2 and 07.3",
                            "recompute with your choose_victim")
    grading.on_learner_code(lambda: serve("swap", swap_mapping=swap_mapping),
                            "exercises 07.1-07.3", "swap with your functions")


def chapter_10(block_hashes_fn: Callable[..., Any], longest_cache_hit_fn: Callable[..., Any],
               free_queue_cls: type, allocate_slots_fn: Callable[..., Any] | None = None,
               model: Any = None) -> None:
    """Chapter 10's demos on the learner's pieces: vLLM's worked example (the first three),
    then the six shared-prefix requests served one after another on a 12-block pool
    through the engine's hooks (``allocate_slots_fn`` too, if given), next to the
    library's runs."""
    from paged_lib.course.demos import prefix_cache as demo

    def example() -> None:
        mine = demo.worked_example(free_queue_cls, block_hashes_fn, longest_cache_hit_fn)
        same = mine == demo.worked_example()
        last = mine[-1]
        print(f"vLLM's worked example with your pieces: {'equals' if same else 'DIFFERS from'}"
              f" the library's at every step; request 2 hits {last.hits.get('request 2')}, "
              f"evicts {last.evicted}")

    def engine() -> None:
        from paged_lib.engine import EngineHooks, LLMEngine, SamplingParams
        from paged_lib.model import load_tiny_code_llama

        m = model if model is not None else load_tiny_code_llama()
        prompts = demo.shared_prefix_prompts()
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        mine = dict(block_hashes=block_hashes_fn, longest_cache_hit=longest_cache_hit_fn,
                    FreeBlockQueue=free_queue_cls)
        if allocate_slots_fn is not None:
            mine["allocate_slots"] = allocate_slots_fn
        hooks = EngineHooks(**mine)
        yours = LLMEngine(m, 12, 8, enable_prefix_caching=True, hooks=hooks)
        outs, hits = demo.serve_one_by_one(yours, prompts, params)
        lib = LLMEngine(m, 12, 8, enable_prefix_caching=True)
        ref_outs, ref_hits = demo.serve_one_by_one(lib, prompts, params)
        pool = yours.block_manager.gpu
        print(f"engine, 12 blocks of 8, {len(prompts)} prompts one after another with your "
              f"hooks: prompt tokens from the cache {hits} (library: {ref_hits})")
        print(f"tokens {'equal' if outs == ref_outs else 'DIFFER from'} the library engine's;"
              f" afterwards {pool.num_free} of {pool.num_blocks} blocks free"
              f"{'' if pool.num_free == pool.num_blocks else ' (a LEAK)'}")

    grading.on_learner_code(example, "exercises 10.1-10.3", "vLLM's worked example")
    grading.on_learner_code(engine, "exercises 10.1-10.4", "the engine with your pieces")


def chapter_14(cls: Any, prompt: str = "def add(a, b):", max_tokens: int = 60,
               stop: Sequence[str] = ("string",)) -> None:
    """Stream the tiny model's greedy answer through the learner's class, a token at a
    time, and print each piece the client would get (in brackets) and why it ended."""

    def run() -> None:
        from paged_lib.engine import LLMEngine, SamplingParams
        from paged_lib.model import load_tiny_code_llama

        engine = LLMEngine(load_tiny_code_llama(), 64, 16)
        out = engine.generate([TOKENIZER.encode(prompt)],
                              SamplingParams(max_tokens=max_tokens, temperature=0.0))
        det = cls(TOKENIZER.decode, list(stop))
        pieces = [det.add([t]) for t in out[0].outputs[0].token_ids]
        pieces.append(det.finish())
        print(f"{sum(1 for p in pieces if p)} pieces from "
              f"{len(out[0].outputs[0].token_ids)} tokens:")
        print("".join(f"[{p}]" for p in pieces if p))
        print(f"stopped at {det.stopped!r}")

    grading.on_learner_code(run, "exercise 14.1", "the streaming demo")
