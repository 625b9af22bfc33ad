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
as ``LLMEngine(..., beam_step=fn)``, so a learner's version can run a whole beam search.

Beam search here runs every beam to ``max_tokens`` (the end-of-sequence token is an
ordinary token), as transformers does with ``early_stopping=False`` and no EOS.
"""

from __future__ import annotations

from paged_lib.blocks import BlockTable


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
