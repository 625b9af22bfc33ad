"""Show library code inside a notebook instead of copying it there."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def show_source(*objs: Any) -> Any:
    """Display the source of functions or classes as a highlighted Markdown code block.

    Notebooks call this so a learner reads the exact code the tests exercise; the
    chapter never holds a second copy that could drift.
    """
    from IPython.display import Markdown

    # A @triton.jit kernel is a JITFunction wrapping the Python function in ``.fn``.
    parts = [textwrap.dedent(inspect.getsource(getattr(o, "fn", o))).rstrip() for o in objs]
    return Markdown("```python\n" + "\n\n".join(parts) + "\n```")
