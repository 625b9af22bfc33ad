import sys
sys.path.insert(0, "tests")
from test_graders_ch00_03 import fork_ok, append_ok
from paged_lib.course.grading import ch03
from paged_lib.blocks import Slot
def fork_reversed(t):
    for b in t.blocks: t.allocator.incref(b)
    return type(t)(t.allocator, t.block_size, t.blocks[::-1], t.num_tokens)
def fork_drops_last(t):
    for b in t.blocks[:-1]: t.allocator.incref(b)
    return type(t)(t.allocator, t.block_size, t.blocks[:-1], t.num_tokens)
def fork_no_tokens(t):
    for b in t.blocks: t.allocator.incref(b)
    c = type(t)(t.allocator, t.block_size); c._blocks = list(t.blocks); return c
def fork_tokens_off(t):
    c = fork_ok(t); c._num_tokens = t.num_tokens + 1; return c
for f in [fork_reversed, fork_drops_last, fork_no_tokens, fork_tokens_off]:
    print(f.__name__); ch03.check_fork(f)
def append_cow_no_copy_reported(table):
    s = append_ok(table); return Slot(s.block, s.offset, None)
def append_empty_crash(table):
    offset = table._num_tokens % table.block_size
    if table.allocator.refcount(table._blocks[-1]) > 1 and offset: return append_ok(table)
    return append_ok(table)
def append_cow_same_offset0(table):  # copies a shared full block instead of new block? (tested)
    return append_ok(table)
def append_cow_takes_block_before_check(table):
    new = table.allocator.allocate()
    offset = table._num_tokens % table.block_size
    if offset == 0:
        table._blocks.append(new); table._num_tokens += 1; return Slot(new, 0)
    if table.allocator.refcount(table._blocks[-1]) > 1:
        src = table._blocks[-1]; table.allocator.free(src); table._blocks[-1] = new; table._num_tokens += 1
        return Slot(new, offset, (src, new))
    table.allocator.free(new); table._num_tokens += 1
    return Slot(table._blocks[-1], offset)
def append_cow_forgets_swap(table):
    offset = table._num_tokens % table.block_size
    if offset and table.allocator.refcount(table._blocks[-1]) > 1:
        src, dst = table._blocks[-1], table.allocator.allocate()
        table.allocator.free(src); table._num_tokens += 1
        return Slot(dst, offset, (src, dst))
    return append_ok(table)
for f in [append_cow_no_copy_reported, append_empty_crash, append_cow_takes_block_before_check, append_cow_forgets_swap]:
    print(f.__name__); ch03.check_append_token(f)
