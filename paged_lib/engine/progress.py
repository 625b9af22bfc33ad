"""vLLM's progress bar for ``LLM.generate(..., use_tqdm=True)``: prompts done, tokens/s.

As vLLM's ``LLM._run_engine``: a ``tqdm`` bar "Processed prompts" over the requests,
advanced as each finishes, with the estimated input and output speeds (prompt tokens and
generated tokens of the finished requests, over the time since the bar started) as its
postfix. ``use_tqdm`` may also be a ``tqdm``-like class, as in vLLM.

One difference: with ``use_tqdm=True`` (the default, as in vLLM) the bar is drawn only when
standard error is a terminal, so notebooks, test logs and the course's stored outputs stay
as they were; pass a class (``use_tqdm=tqdm.tqdm``) to draw it anywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from paged_lib.engine.sequence import SequenceGroup


class Progress:
    """The bar over ``total`` requests; :meth:`finished` is the engine's ``on_finish``."""

    def __init__(self, total: int, make_bar: Callable):
        self.bar = make_bar(total=total, desc="Processed prompts", dynamic_ncols=True,
                            postfix=_speeds(0.0, 0.0))
        self.input_tokens = self.output_tokens = 0

    def finished(self, group: SequenceGroup) -> None:
        self.input_tokens += len(group.prompt_token_ids)
        if group.params.beam_width is not None:
            self.output_tokens += sum(len(tokens) for tokens, _ in group.beam_done)
        else:
            self.output_tokens += sum(len(s.output_token_ids) for s in group.seqs)
        elapsed = self.bar.format_dict.get("elapsed") or 0.0
        if elapsed > 0:
            self.bar.postfix = _speeds(self.input_tokens / elapsed, self.output_tokens / elapsed)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def progress(total: int, use_tqdm: bool | Callable) -> Progress | None:
    """The bar ``use_tqdm`` asks for, or ``None`` (``False``; ``True`` off a terminal)."""
    if callable(use_tqdm):
        return Progress(total, use_tqdm)
    if not use_tqdm or not sys.stderr.isatty():
        return None
    from tqdm import tqdm  # (installed with openai, a dependency)

    return Progress(total, tqdm)


def _speeds(input_speed: float, output_speed: float) -> str:
    return f"est. speed input: {input_speed:.2f} toks/s, output: {output_speed:.2f} toks/s"
