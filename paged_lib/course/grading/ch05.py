"""Checks for chapter 05's exercises: a Triton ramp, the paged decode kernel, slots, merge.

Kernels are launched on tiny grids (a few programs) so that each check takes about a
second in Triton's interpreter. Two kinds of evidence, because each proves something
the other cannot:

* **NaN poisoning**: every cache slot (or matrix element) the kernel must not use holds
  NaN, so poison that reaches the output shows up as NaN there;
* **the load trace** (:mod:`paged_lib.instruments.load_trace`, interpreter only): every
  element each program loaded, so a read past a sequence's end fails even when
  ``tl.where`` hid its value, and the message names the program and the slot.

On a GPU (kernels compiled, not interpreted) only the first kind runs.

The checks live in ``ch05_puzzles`` (05.1-05.4), ``ch05_decode`` (05.5) and
``ch05_around`` (05.6-05.7), on ``ch05_common``'s launcher and guarded buffers; this
module is the chapter's grader (``TWINS``, ``EQUIVALENT_MUTANTS``, every ``check_*``).
"""


from __future__ import annotations

from paged_lib.course.grading.ch05_around import check_merge_partials, check_slot_mapping
from paged_lib.course.grading.ch05_common import Guarded, launch
from paged_lib.course.grading.ch05_decode import (
    check_paged_decode_kernel,
    decode_case,
    run_decode_kernel,
)
from paged_lib.course.grading.ch05_puzzles import (
    check_gather_rows,
    check_online_attention,
    check_row_softmax,
    check_scale_tile,
)

__all__ = ["EQUIVALENT_MUTANTS", "Guarded", "check_gather_rows",
           "check_merge_partials", "check_online_attention", "check_paged_decode_kernel",
           "check_row_softmax", "check_scale_tile", "check_slot_mapping", "decode_case", "launch",
           "run_decode_kernel"]


#: Mutants (tools/mutants.py) of the solutions that compute the same thing.
EQUIVALENT_MUTANTS: dict[str, dict[str, str]] = {
    "05.2": {"constant: `0` -> `-1` in `rows = tl.load(idx_ptr + i, mask=live, other=0)"
             ".to(tl.int64)`": "a masked lane's row id is never used: the row load is masked "
                               "by the same condition",
             "constant: `0` -> `1` in `rows = tl.load(idx_ptr + i, mask=live, other=0)"
             ".to(tl.int64)`": "the same: any row id will do for a masked lane"},
    "05.6": {"constant: `0` -> `-1` in `pos = positions.clamp(min=0)  # a padding token's -1 "
             "must not index the table`": "a padding token's slot is replaced by -1 "
                                          "afterwards; index -1 is a valid column meanwhile"},
}
