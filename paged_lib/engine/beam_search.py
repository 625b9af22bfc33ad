"""One step of beam search over block tables (chapter 08).

After a step every live beam offers candidates, ``(token, logprob)`` pairs for its next
token. :func:`beam_step` keeps the ``beam_width`` best continuations by cumulative
log-probability, across all beams, and settles the block tables:

* a beam chosen as parent once continues in its own table;
* a beam chosen ``k > 1`` times keeps its table for the first child and ``fork()``\\ s it
  for the others (the forks share every block: ref counts go up, nothing is copied);
* a beam nobody continues dies: its table is ``free()``\\ d (ref counts go down; a block
  returns to the pool when no surviving beam holds it).

Nothing is copied here: copy-on-write happens later, in ``append_token``, only where a
child writes into a shared, part-filled last block. The engine calls the function given
as ``LLMEngine(..., hooks=EngineHooks(beam_step=fn))``, so a learner's version can run a
whole beam search.

Around it, :func:`update_beams` runs one step of the whole search for a group, as
transformers' ``generate(num_beams=W, do_sample=False)`` does (and vLLM v0 after it):
the candidates among the best ``W`` of all beams that end in EOS become *finished
hypotheses* (scored ``cumulative_logprob / length ** length_penalty``; the best ``W``
are kept), the best ``W`` that do not end go on through :func:`beam_step`,
and the search stops as ``early_stopping`` says (:func:`search_is_done`). At
``max_tokens`` the ``W`` beams :func:`beam_step` picks all finish. A beam that ends frees
its blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from paged_lib.blocks import BlockTable
from paged_lib.engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

Candidate = tuple[int, float]          # (token, logprob)
Hypothesis = tuple[list[int], float]   # (generated token ids, cumulative logprob)


def beam_step(tables: list[BlockTable], cum_logprobs: list[float],
              candidates: list[list[tuple[int, float]]], beam_width: int
              ) -> list[tuple[int, BlockTable, int, float]]:
    """Keep the ``beam_width`` best continuations and fork / free the tables to match.

    ``tables[i]`` and ``cum_logprobs[i]`` belong to live beam ``i``; ``candidates[i]`` are
    its ``(token, logprob)`` options. Returns ``(parent, table, token, cum_logprob)`` per
    new beam, best first (ties: lower parent index first, then the candidate's order),
    where ``cum_logprob = cum_logprobs[parent] + logprob``.

    Example: two beams at -1.0 and -2.0 with candidates ``[(5, -0.1), (6, -0.5)]`` and
    ``[(7, -0.2)]``, width 2: beam 0 continues twice ((0, tables[0], 5, -1.1) and
    (0, a fork of tables[0], 6, -1.5)); beam 1 dies and its table is freed.
    """
    scored = [(cum_logprobs[i] + lp, i, rank, tok)
              for i, options in enumerate(candidates) for rank, (tok, lp) in enumerate(options)]
    scored.sort(key=lambda c: (-c[0], c[1], c[2]))
    chosen = scored[:beam_width]
    used: set[int] = set()
    new_beams = []
    for cum, parent, _, token in chosen:
        table = tables[parent] if parent not in used else tables[parent].fork()
        used.add(parent)
        new_beams.append((parent, table, token, cum))
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new_beams


def beam_score(hyp: Hypothesis, length_penalty: float) -> float:
    """A finished hypothesis' score: its log-probability over its length (with EOS)
    to the power ``length_penalty`` (1.0: per-token average; 0.0: the sum)."""
    tokens, cum = hyp
    return cum / len(tokens) ** length_penalty


def split_candidates(cum_logprobs: list[float], candidates: list[list[Candidate]],
                     beam_width: int, eos_token_id: int | None
                     ) -> tuple[list[tuple[int, int, float]], list[list[Candidate]]]:
    """Which candidates end their beam at EOS, and which may go on.

    ``candidates[i]`` are beam ``i``'s options, best first. Returns ``(ended, going_on)``:
    ``ended`` lists ``(parent, token, cum_logprob)`` for the EOS candidates among the
    best ``beam_width`` of all beams (by cumulative log-probability); ``going_on[i]``
    holds beam ``i``'s best ``beam_width`` options that are not EOS: without EOS,
    exactly what :func:`beam_step` always got.
    """
    scored = sorted(((cum_logprobs[i] + lp, i, rank, tok)
                     for i, options in enumerate(candidates)
                     for rank, (tok, lp) in enumerate(options)),
                    key=lambda c: (-c[0], c[1], c[2]))
    ended = [(i, tok, cum) for cum, i, _, tok in scored[:beam_width]
             if eos_token_id is not None and tok == eos_token_id]
    going_on = [[c for c in options if c[0] != eos_token_id][:beam_width]
                for options in candidates]
    return ended, going_on


def keep_best(done: list[Hypothesis], new: list[Hypothesis],
              params: SamplingParams) -> list[Hypothesis]:
    """The best ``beam_width`` finished hypotheses, best first; with
    ``early_stopping=True`` a full list takes no more (the search is over)."""
    if params.early_stopping is True and len(done) >= params.beam_width:
        return done
    merged = sorted(done + new, key=lambda h: -beam_score(h, params.length_penalty))
    return merged[:params.beam_width]


def search_is_done(done: list[Hypothesis], best_running_cum: float | None, length: int,
                   params: SamplingParams) -> bool:
    """Can no running beam (the best at ``best_running_cum``, ``length`` tokens long)
    still beat the worst of ``beam_width`` finished hypotheses? (transformers' test)"""
    if best_running_cum is None:
        return True
    if len(done) < params.beam_width:
        return False
    if params.early_stopping is True:
        return True
    if params.early_stopping == "never" and params.length_penalty > 0:
        length = params.max_tokens  # the longest a beam can grow: its best case
    best = best_running_cum / length ** params.length_penalty
    return best <= min(beam_score(h, params.length_penalty) for h in done)


def update_beams(group: SequenceGroup, beams: list[Sequence], candidates: list[list[Candidate]],
                 eos_token_id: int | None, step_fn: Callable = beam_step) -> None:
    """One step of beam search for ``group``, whose live ``beams`` drew ``candidates``
    (best first, each beam's ``beam_width + 1`` best tokens: ``beam_width`` that are not
    EOS).

    Ended hypotheses join ``group.beam_done``; ``step_fn`` (the engine's ``beam_step``
    hook) picks the beams that go on and forks / frees their tables; when the search is
    done, every beam still running is finished and its blocks freed.
    """
    params = group.params
    outputs = [list(b.output_token_ids) for b in beams]  # before anyone changes
    last = len(outputs[0]) + 1 >= params.max_tokens
    # at max_tokens every candidate ends: the best beam_width, EOS or not, as picked below
    eos = None if params.ignore_eos or last else eos_token_id
    cums = [b.cumulative_logprob for b in beams]
    ended, going_on = split_candidates(cums, candidates, params.beam_width, eos)
    group.beam_done = keep_best(group.beam_done,
                                [(outputs[p] + [tok], cum) for p, tok, cum in ended], params)
    new = step_fn([b.block_table for b in beams], cums, going_on, params.beam_width)
    want = min(params.beam_width, sum(len(c) for c in going_on))
    if len(new) != want:
        raise ValueError(f"beam_step returned {len(new)} beams, expected {want}")
    group.seqs = _rebuild(group, beams, outputs, new)
    if last:
        group.beam_done = keep_best(group.beam_done, [(list(s.output_token_ids),
                                                       s.cumulative_logprob)
                                                      for s in group.seqs], params)
    best = max((s.cumulative_logprob for s in group.seqs), default=None)
    if last or search_is_done(group.beam_done, best, len(outputs[0]) + 1, params):
        for beam in group.seqs:
            _end(beam)


def _rebuild(group: SequenceGroup, beams: list[Sequence], outputs: list[list[int]],
             new: list[tuple[int, BlockTable, int, float]]) -> list[Sequence]:
    """The group's sequences after ``beam_step``: a parent's own table continues the
    parent; each fork becomes a new sequence; a beam nobody continued is finished (its
    table was freed by ``beam_step``)."""
    base = max(s.seq_id for s in group.seqs) + 1
    seqs, continued = [], set()
    for parent, table, token, cum in new:
        src = beams[parent]
        if table is src.block_table and parent not in continued:
            continued.add(parent)
            seq = src
            seq.output_token_ids = outputs[parent] + [token]
            seq.cumulative_logprob = cum
        else:
            seq = Sequence(base, src.prompt_token_ids, outputs[parent] + [token], cum,
                           table, src.num_cached, SequenceStatus.RUNNING)
            base += 1
        seqs.append(seq)
    for i, beam in enumerate(beams):
        if i not in continued:
            beam.block_table = None
            beam.status = SequenceStatus.FINISHED
    return seqs


def _end(beam: Sequence) -> None:
    """A beam the search no longer needs: its blocks go back (shared ones stay held)."""
    if beam.block_table is not None:
        beam.block_table.free()
        beam.block_table = None
    beam.status = SequenceStatus.FINISHED
