"""The chapters' demos on the learner's own engine pieces (chapters 06-08, 10, 14).

Each ``chapter_NN`` runs at the end of chapter NN's exercise notebook: the chapter's trace
served by the engine with the learner's hooks in place of the library's, next to the
library's own run, and a line that says whether tokens and steps agree. A piece not written
yet gets ⏳ and one that raises gets ❌ (:func:`paged_lib.course.grading.on_learner_code`),
never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paged_lib.course import grading
from paged_lib.course.demos import engine_compare as ec
from paged_lib.course.grading.ch08 import on_copies, run_beam_search
from paged_lib.engine import EngineHooks, LLMEngine, SamplingParams
from paged_lib.model import load_tiny_code_llama
from paged_lib.studies import sharing
from paged_lib.tokenizer import ByteTokenizer
from paged_lib.workloads import alpaca_like


def tokens_of(outs: list) -> list[list[list[int]]]:
    """Each request's completions' token ids."""
    return [[c.token_ids for c in o.outputs] for o in outs]


@dataclass
class SideBySide:
    yours: LLMEngine      # served with the learner's hooks
    library: LLMEngine    # the same requests, every piece the library's
    outs: list            # the learner's engine's outputs
    same_tokens: bool

    @property
    def same_steps(self) -> bool:
        """Batch sizes, blocks in use and preemptions equal at every step."""
        s, r = self.yours.stats, self.library.stats
        return (s.batch_sizes, s.blocks_used, s.preemptions) == \
            (r.batch_sizes, r.blocks_used, r.preemptions)


def side_by_side(model: Any, num_blocks: int, block_size: int, prompts: list, params: Any,
                 hooks: EngineHooks, **kw: Any) -> SideBySide:
    """``prompts`` served by an engine with ``hooks`` and by the library's (the engine's
    default backend, ``kw`` for both)."""
    yours = LLMEngine(model, num_blocks, block_size, hooks=hooks, **kw)
    outs = yours.generate(prompts, params)
    library = LLMEngine(model, num_blocks, block_size, **kw)
    ref = library.generate(prompts, params)
    return SideBySide(yours, library, outs, tokens_of(outs) == tokens_of(ref))


#: the tiny code model's tokenizer (chapter 14's demo decodes with it)
TOKENIZER = ByteTokenizer()


def chapter_06(build_metadata: Callable[..., Any], num_required_blocks: Callable[..., Any],
               can_admit: Callable[..., Any], model: Any = None,
               schedule_waiting: Callable[..., Any] | None = None) -> list[Any]:
    """Serve the chapter's trace with the learner's functions inside the engine (the
    three, and ``schedule_waiting`` when given).

    Prints what the run did and whether every token and every step's numbers equal the
    library engine's; then serves chapter 07's pressure trace (recompute: preempted
    groups of two samples come back with their shared prompt) with the learner's
    admission the same way. Returns the chapter's two figures drawn from the learner's run.
    """
    from paged_lib.course.viz import engine as viz

    model = model if model is not None else load_tiny_code_llama()
    hooks = EngineHooks(can_admit=can_admit, build_metadata=build_metadata,
                        num_required_blocks=num_required_blocks,
                        **({} if schedule_waiting is None else
                           {"schedule_waiting": schedule_waiting}))

    def run():
        def said(same: bool) -> str:
            return "equal" if same else "DIFFER from"
        trace = ec.chapter_trace()
        r = side_by_side(model, ec.NUM_BLOCKS, ec.BLOCK_SIZE,
                         *ec.chapter_requests(trace), hooks)
        s = r.yours.stats
        print(f"your engine served {len(r.outs)} requests in {s.steps} steps "
              f"({s.generated_tokens} tokens, {s.preemptions} preemptions, "
              f"peak {s.peak_blocks_used} of {s.num_blocks} blocks)")
        print(f"tokens {said(r.same_tokens)} the library engine's; batch sizes and blocks "
              f"per step {said(r.same_steps)} it")
        r7 = side_by_side(model, ec.PRESSURE_BLOCKS, ec.PRESSURE_BLOCK_SIZE,
                          *ec.pressure_requests(), hooks)
        print(f"chapter 07's pressure trace ({len(r7.outs)} requests on "
              f"{r7.yours.stats.num_blocks} blocks, {r7.yours.stats.preemptions} "
              f"preemptions): tokens {said(r7.same_tokens)} the library's; steps "
              f"{said(r7.same_steps)} it")
        return [viz.plot_batching({"paged (your engine)": s,
                                   "static, max-length": ec.static_stats(trace)}),
                viz.plot_timeline(s, "your engine: requests over time")]

    return grading.on_learner_code(run, "exercises 06.1-06.4",
                                   "the engine with your functions") or []


def chapter_07(swap_mapping: Callable[..., Any], choose_victim: Callable[..., Any],
               model: Any = None, preempt_until_fits: Callable[..., Any] | None = None) -> None:
    """The chapter's too-small pool served with the learner's ``choose_victim`` (and
    ``preempt_until_fits`` when given), by recompute and by swap (with the learner's
    mapping), next to the library's runs."""

    model = model if model is not None else load_tiny_code_llama()
    prompts, params = ec.pressure_requests()

    also = "" if preempt_until_fits is None else " (and preempt_until_fits)"
    asked = [0]

    def victim(running: list) -> Any:
        asked[0] += 1
        return choose_victim(running)

    def serve(mode: str, **hooks: Any) -> None:
        asked[0] = 0
        if preempt_until_fits is not None:
            hooks["preempt_until_fits"] = preempt_until_fits
        run = side_by_side(model, ec.PRESSURE_BLOCKS, ec.PRESSURE_BLOCK_SIZE, prompts,
                           params, EngineHooks(choose_victim=victim, **hooks),
                           num_cpu_blocks=64, preemption=mode)
        s, r = run.yours.stats, run.library.stats
        print(f"recompute, your choose_victim{also}: {len(prompts)} requests on "
              f"{ec.PRESSURE_BLOCKS} blocks in {s.steps} steps (library: {r.steps}), "
              f"{s.preemptions} preemptions "
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


def chapter_08(apply_slot: Callable[..., Any], beam_step: Callable[..., Any]) -> list[Any]:
    """The chapter's demos on the learner's two functions; returns the beam-tree figure.

    Parallel sampling on a NaN-filled cache written by ``apply_slot``; a synthetic beam
    search and its saving on 20 Alpaca-like requests, then a real one in the engine
    (width 4 on the chapter's tiny random Llama), both driven by ``beam_step`` and
    compared with the library's.
    """
    from paged_lib.course.viz import sharing as viz

    def sampling() -> None:
        demo = sharing.parallel_sampling_demo(apply_slot)
        ok = demo.max_error < 1e-5
        print(f"parallel sampling, your apply_slot: copies {demo.copies}; paged attention "
              f"{'equals' if ok else 'DIFFERS from'} SDPA on each sample's own tokens")

    def synthetic() -> list[Any]:
        frames = run_beam_search(beam_step, prompt_len=6, output_len=10, beam_width=3,
                                 block_size=4, seed=0)
        same = frames == sharing.record_beam_search(seed=0)[0]
        shared = unshared = 0
        for i, r in enumerate(alpaca_like(20, seed=0)):
            u = sharing.beam_search_usage(r.prompt_len, r.output_len, 4, block_size=16,
                                          seed=i, step_fn=beam_step)
            shared, unshared = shared + sum(u.shared), unshared + sum(u.unshared)
        print(f"synthetic beam search, your beam_step: tree {'equals' if same else 'DIFFERS from'}"
              f" the library's; width 4 on 20 Alpaca-like requests saves "
              f"{1 - shared / unshared:.1%} of the block-steps")
        return [viz.draw_beam_tree(frames, upto=6)]

    def engine() -> None:
        import torch

        _, model = sharing.tiny_random_llama()
        prompt = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
        params = SamplingParams(max_tokens=12, beam_width=4)
        run = side_by_side(model, 64, 4, [prompt], params,
                           EngineHooks(beam_step=on_copies(beam_step)))
        print(f"engine beam search (width 4), your beam_step: beams "
              f"{'equal' if run.same_tokens else 'DIFFER from'} the engine's own; peak blocks "
              f"{run.yours.stats.peak_blocks_used} vs {run.library.stats.peak_blocks_used}")

    grading.on_learner_code(sampling, "exercise 08.1", "parallel sampling")
    figs = grading.on_learner_code(synthetic, "exercise 08.2", "synthetic beam search") or []
    grading.on_learner_code(engine, "exercise 08.2", "engine beam search")
    return figs


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
