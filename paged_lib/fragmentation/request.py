"""One request at one step: the slots it holds under each policy, and in which category.

A request that stores ``num_tokens`` token states now and ends with ``final_len`` holds
``reservation(...)`` slots (see :mod:`paged_lib.fragmentation` for the policies); of those,
``request_slots`` says how many hold a token, how many it will still fill (reserved) and how
many it never will (internal fragmentation), as in the paper's Fig. 2.
"""

from __future__ import annotations

from paged_lib.contiguous import next_pow2
from paged_lib.util import cdiv

POLICIES = ("static-max", "orca-max", "orca-pow2", "orca-oracle", "buddy", "paged")


def reservation(policy: str, num_tokens: int, final_len: int, block_size: int = 16,
                max_len: int = 2048, prompt_len: int | None = None) -> int:
    """Slots a request holds under ``policy`` while it stores ``num_tokens`` token states
    and will end with ``final_len`` (``orca-pow2`` also needs its ``prompt_len``)."""
    if policy in ("static-max", "orca-max"):
        return max_len
    if policy == "orca-pow2":
        if prompt_len is None or not 0 <= prompt_len < final_len:
            raise ValueError("orca-pow2 reserves the prompt plus the output length rounded "
                             "up to a power of two: pass prompt_len (0 <= prompt_len < "
                             f"final_len={final_len}), got {prompt_len!r}")
        return min(max_len, prompt_len + next_pow2(final_len - prompt_len))
    if policy == "buddy":
        return next_pow2(final_len)
    if policy == "orca-oracle":
        return final_len
    if policy == "paged":
        return cdiv(num_tokens, block_size) * block_size
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")


def request_slots(policy: str, num_tokens: int, final_len: int, block_size: int = 16,
                  max_len: int = 2048, prompt_len: int | None = None) -> tuple[int, int, int]:
    """(token states, reserved, internal) slots of one running request right now.

    Reserved slots are held slots the request will still fill (up to its final length);
    internal fragmentation is every held slot past the final length.
    """
    if not 1 <= num_tokens <= final_len:
        raise ValueError(f"need 1 <= num_tokens <= final_len, got {num_tokens} and {final_len}")
    held = reservation(policy, num_tokens, final_len, block_size, max_len, prompt_len)
    will_use = min(held, final_len)
    return num_tokens, will_use - num_tokens, held - will_use
