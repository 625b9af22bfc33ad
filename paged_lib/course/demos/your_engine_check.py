"""Chapter 13's checks: the learner's engine serving SmolLM2-135M-Instruct.

* :func:`chat_workload`: chat questions on the real model that use every piece (greedy
  answers, seeded top-k/top-p sampling, parallel samples, a beam search, a question asked
  twice for the prefix cache, a pool small enough to swap);
* :func:`check`: each saved piece on its own scenarios first
  (:mod:`~paged_lib.course.demos.your_engine_scenarios`, the tiny model), then the chat
  workload on an engine of all of them, compared with the library engine (tokens and
  schedule) and with transformers (tokens);
* :func:`capture_decode` and :func:`kernel_on_one_layer`: the learner's Triton decode
  kernel, which Triton's interpreter runs as Python on a CPU (the chapter measures one
  call interpreted and compiled), on one real decode call of the real model, beside the
  library's attention; :func:`kernel_story` says ✅ or ❌ with a hint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from paged_lib.course.demos import your_engine, your_engine_scenarios
from paged_lib.engine import SamplingParams
from paged_lib.model import TinyLlama
from paged_lib.studies.wall_clock import fastest_ms

QUESTIONS = ["What is the capital of France?", "Explain how a hash table works.",
             "Give three tips for learning a new language.", "Write a haiku about the sea.",
             "Describe the water cycle.", "What is the capital of France?"]
#: the pool for the chat workload: blocks of 16 tokens, small enough that it swaps
NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS = 14, 16, 64
OPTIONS = dict(preemption="swap", num_cpu_blocks=NUM_CPU_BLOCKS, enable_prefix_caching=True,
               watermark=0.0, max_model_len=2048)


def chat_workload(tokenizer) -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """Prompts (the chat template applied: its default system prompt is a prefix every
    request shares), params, arrivals:
    two greedy answers, a seeded top-k/top-p one, 2 samples, a beam search of width 2,
    and the first question again when its blocks are cached."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True) for q in QUESTIONS]
    params = [SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=28, temperature=0.0),
              SamplingParams(max_tokens=24, temperature=0.8, top_k=40, top_p=0.9, seed=7),
              SamplingParams(max_tokens=20, temperature=1.0, n=2, seed=3),
              SamplingParams(max_tokens=12, beam_width=2),
              SamplingParams(max_tokens=24, temperature=0.0)]
    return prompts, params, [0, 0, 0, 1, 2, 12]


def serve(model: TinyLlama, pieces: dict[str, Any], workload, tokenizer=None,
          capture: dict | None = None):
    """``workload`` on an engine of ``pieces``: (outputs, the schedule step by step).
    ``capture`` (a dict) receives the first decode attention call of layer 0
    (:func:`capture_decode`)."""
    steps: list[dict] = []
    engine = your_engine.build(model, NUM_BLOCKS, BLOCK_SIZE, pieces, tokenizer=tokenizer,
                               on_step=lambda o, s: your_engine_scenarios.record(o, s, steps),
                               **OPTIONS)
    with capture_decode(model, capture):
        outputs = engine.generate(*workload)
    return outputs, your_engine_scenarios.Served(
        [[c.token_ids for c in o.outputs] for o in outputs], steps)


def hf_reference(hf, outputs, params: list[SamplingParams]) -> dict[int, bool]:
    """Request index -> whether transformers gives the same tokens, for every request it
    samples the same way. Greedy: one batched forward along prompt + answer, whose argmax
    at every position must be the engine's next token (by induction, what ``generate``
    would give); seeded top-k/top-p: ``generate(do_sample=True)`` after
    ``torch.manual_seed(seed)``."""
    eos = hf.config.eos_token_id
    same = {}
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0 and sp.n == 1
              and sp.beam_width is None]
    texts = [outputs[i].prompt_token_ids + outputs[i].outputs[0].token_ids for i in greedy]
    width = max(map(len, texts))
    ids = torch.tensor([t + [eos] * (width - len(t)) for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask).logits
    for i, row in zip(greedy, logits, strict=True):
        start, answer = len(outputs[i].prompt_token_ids), outputs[i].outputs[0].token_ids
        same[i] = row[start - 1:start - 1 + len(answer)].argmax(-1).tolist() == answer
    for i, sp in enumerate(params):
        if sp.temperature > 0 and sp.n == 1 and sp.seed is not None:
            prompt = torch.tensor([outputs[i].prompt_token_ids])
            torch.manual_seed(sp.seed)
            with torch.no_grad():
                want = hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=sp.max_tokens, do_sample=True,
                                   temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                                   pad_token_id=eos)[0, prompt.shape[1]:].tolist()
            same[i] = want == outputs[i].outputs[0].token_ids
    return same


def check(model: TinyLlama, tokenizer, hf, pieces: dict[str, Any],
          capture: dict | None = None) -> tuple[bool, list | None, list[dict]]:
    """Each piece on its scenarios (a failing one is named before anything else runs),
    then the chat workload on an engine of all that passed (the library's for the rest):
    tokens and schedule equal the library engine's, tokens equal transformers'. Prints
    what matched; ``capture``
    receives one decode attention call of the library's run (:func:`capture_decode`).
    Returns (all matched, the learner's engine's outputs and its steps (:func:`serve`);
    None and the library's steps if it raised)."""
    verdicts = your_engine_scenarios.check_pieces(pieces)
    ok = all(v is None for _, v in verdicts)
    failed = [ex for ex, v in verdicts if v is not None]
    if failed:  # the chat workload runs the pieces that passed, the library's for the rest
        print(f"the chat workload runs the library's {', '.join(failed)} in place of yours")
        pieces = {k: v for k, v in pieces.items() if k not in failed}
    workload = chat_workload(tokenizer)
    _, library = serve(model, {}, workload, tokenizer, capture=capture)
    try:
        outputs, got = serve(model, pieces, workload, tokenizer)
    except Exception as err:
        line = your_engine.error_line(err)
        print(f"❌ your engine raised {type(err).__name__}: {line}")
        return False, None, library.steps
    same = hf_reference(hf, outputs, workload[1])
    what = your_engine_scenarios.difference(library, got)
    preempted = sum(len(s["preempted"]) for s in got.steps)
    print(f"the chat workload ({len(got.steps)} steps, {preempted} "
          f"preemption{'' if preempted == 1 else 's'}): the library "
          f"engine's tokens and schedule: {what is None}; transformers' tokens "
          f"({len(same)} requests): {all(same.values())}")
    if what is not None:
        print(f"❌ your engine, all pieces together: {what}")
    return ok and what is None and all(same.values()), outputs, got.steps


# ------------------------------------------------------------------ the kernel, one layer

@contextlib.contextmanager
def capture_decode(model: TinyLlama, seen: dict | None, layer: int = 0) -> Iterator[None]:
    """While the block runs, ``seen`` receives copies of the inputs and output of the
    first decode attention call of ``layer`` (the cache goes on changing after it);
    ``None`` changes nothing."""
    import paged_lib.model as model_module

    if seen is None:
        yield
        return
    library, calls = model_module.paged_attention, [0]

    def spy(q, k_cache, v_cache, block_tables, seq_lens, **options):
        out = library(q, k_cache, v_cache, block_tables, seq_lens, **options)
        if calls[0] % model.config.num_layers == layer and not seen:
            seen.update(q=q.clone(), k_cache=k_cache.clone(), v_cache=v_cache.clone(),
                        block_tables=block_tables.clone(), seq_lens=seq_lens.clone(),
                        out=out.clone())
        calls[0] += 1
        return out

    model_module.paged_attention = spy
    try:
        yield
    finally:
        model_module.paged_attention = library


class KernelRun(NamedTuple):
    error: float            # largest difference from the library's attention (inf: raised)
    seconds: float          # the kernel in Triton's interpreter
    library_seconds: float  # the attention the engine serves with (auto), same call
    problem: str | None     # what it raised, or that it read outside the sequence


def kernel_on_one_layer(kernel: Any | None, call: dict) -> KernelRun:
    """``kernel`` (None: the library's own Triton decode kernel) on a captured call,
    beside the attention the engine serves with (``attention_backend="auto"``: the C
    decode kernel on a CPU, Triton's compiled kernels on a GPU) on the same call."""
    from paged_lib.kernels import paged_attention

    args = [call[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
    from paged_lib.kernels.backends import resolve_backend

    served = resolve_backend("auto", args[0].device)  # what the chat workload ran
    library_seconds = fastest_ms(lambda: paged_attention(*args, backend=served), 3) / 1e3
    problem = None
    try:
        out = paged_attention(*args, backend="triton") if kernel is None else \
            your_engine.run_kernel(kernel, *args)
        start = time.perf_counter()  # a second time, warm: what each further call costs
        out = paged_attention(*args, backend="triton") if kernel is None else \
            your_engine.run_kernel(kernel, *args)
        seconds = time.perf_counter() - start
        error = (out - call["out"]).abs().max().item()
        if out.isnan().any():
            error, problem = float("inf"), f"'s {your_engine.NAN_READ}"
    except Exception as err:  # noqa: BLE001 - a learner's kernel: a line, no traceback
        line = your_engine.error_line(err)
        error, problem = float("inf"), f"raised {type(err).__name__}: {line}"
        seconds = float("nan")
    return KernelRun(error, seconds, library_seconds, problem)


def kernel_story(kernel: Any | None, call: dict, run: KernelRun) -> str:
    """The verdict on :func:`kernel_on_one_layer`'s run, ✅ or ❌ with a hint."""
    seqs, heads, _ = call["q"].shape
    who = "your" if kernel is not None else "the library's"
    what = (f"on SmolLM2's layer 0 ({seqs} sequences of {call['seq_lens'].tolist()} "
            f"tokens, {heads} query heads in {call['k_cache'].shape[2]} groups), {who} "
            "Triton decode kernel")
    if run.error <= 1e-4:
        return f"✅ {what} agrees with the library's attention (within 1e-4)"
    why = run.problem or f"is {run.error:.3g} away from the library's attention"
    sep = "" if why.startswith("'") else " "
    return (f"❌ {what}{sep}{why}\n   hint: a group's query heads share their KV head's "
            "blocks: each program walks its sequence's block table to seq_len, masks the "
            "slots past it and the padded heads of the group, and scales q . k by "
            "1 / sqrt(head_dim) (05.5's spec)")



def decode_steps(steps: list[dict]) -> int:
    """The steps of a traced run (:func:`serve`) that decoded at least one sequence."""
    return sum(any(kind == "decode" for *_, kind, _ in step["ran"]) for step in steps)
