"""Paged decode as a small compiled C kernel: ``backend="cpu"``.

The torch backend (:mod:`paged_lib.kernels.torch_backend`) is built from PyTorch ops, so
it must first *gather* each sequence's blocks into a contiguous buffer and then attend:
two passes over the K/V bytes, the first a full copy. That costs it about 1.5x the best
contiguous baseline on a CPU (chapter 04; ``python -m paged_lib.bench attention``). A
kernel that reads K and V straight out of their blocks needs no copy, which is what the
Triton kernel does on a GPU and what vLLM's CPU backend does in C++. This is that
kernel for a CPU, in about 300 lines of C (``csrc/paged_decode.c``): a work item is a
sequence (or some of its KV heads), streamed block by block; the query heads that share a
KV head are attended together, so each K/V row is read once; the online softmax of
chapter 04 per block; nothing read past a sequence's length.

It is compiled at first use with the machine's C compiler (``$CC``, else ``cc``, ``gcc``
or ``clang``; ``-O3 -march=native`` where the compiler takes it; GNU C, for its vector
types) into ``~/.cache/paged_lib`` (``$PAGED_LIB_CACHE`` to move it), under a name that hashes the
source, the compiler and the flags, so an edit or another machine's compiler builds
afresh. Loaded with :mod:`ctypes` (which lets go of the GIL); up to
``torch.get_num_threads()`` threads run it at once and share one work counter; a small
batch (under :data:`MIN_BYTES_PER_THREAD` of K/V per thread,
:data:`MIN_BYTES_PER_TEAM_THREAD` on PyTorch's threads) runs on fewer. Which threads:
where PyTorch's OpenMP runtime is GNU libgomp (Linux wheels), the kernel is built with
``-fopenmp`` and runs on PyTorch's own OpenMP threads, the ones its matmuls use; elsewhere
on a pool of Python threads. The pool is the fallback only: its threads run beside
PyTorch's, which keep spinning for a while after each matmul, so with as many torch threads
as cores they fight for the cores and the attention gained nothing from a second thread.
Prefill goes through the same kernel (:func:`paged_prefill_cpu`): each new token is a
decode row whose length ends at its own position, the definition of causal attention over
the cache (``kernels.reference.ref_paged_prefill`` says it the same way). Each row reads its
sequence's K/V again, from the caches by then; against the torch backend's per-sequence
gather and masked SDPA it was 2.5-5x faster on SmolLM2's shapes from 38 to 1,024 new tokens
(measured 2026-12-07, two threads). The cache write of ``backend="cpu"`` is the torch
backend's (the model does it in :mod:`paged_lib.kernels.cpu_layer`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from paged_lib.util import cache_root, cdiv

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "paged_decode.c"
#: Built into one library: this kernel, the layer's small steps of
#: :mod:`paged_lib.kernels.cpu_layer` (both include ``vec.h``), the linear maps of
#: :mod:`paged_lib.kernels.cpu_linear`, and a decode step's layers on one thread team
#: (``decode_layer.c``, which calls the other three through ``team.h``).
SOURCES = (SOURCE, CSRC / "layer_ops.c", CSRC / "linear.c", CSRC / "decode_layer.c")
HEADERS = (CSRC / "vec.h", CSRC / "team.h")
#: Flag sets tried in order; the first the compiler accepts is kept.
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: K/V bytes below which one more thread costs more than it saves (one thread reads about
#: 4.5 GB/s here, so 512 KB is ~0.1 ms of work: about what a hand-off to a thread costs).
MIN_BYTES_PER_THREAD = 512 * 1024
#: The same on PyTorch's OpenMP team, whose threads are still spinning from the last
#: matmul and start within microseconds: two threads gain from ~512 KB (1.3x at 720 KB,
#: 1.0x at 240 KB, timed between matmuls at 2 threads here).
MIN_BYTES_PER_TEAM_THREAD = 256 * 1024
#: Added to the first flag set where PyTorch runs on GNU libgomp (:func:`_torch_libgomp`).
OPENMP_FLAGS = ("-fopenmp",)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_info: dict | None = None
_pool: ThreadPoolExecutor | None = None


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here: no C compiler, or one that refused
    the source (``backend="torch"`` needs neither)."""


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise KernelUnavailable("backend='cpu' compiles a small C kernel (paged_lib/kernels/csrc/"
                            "paged_decode.c) at first use and found no C compiler: set CC or "
                            "install gcc; backend='torch' needs none")


def _cache_dir() -> Path:
    """Where the compiled kernel goes: :func:`paged_lib.util.cache_root`."""
    try:
        return cache_root()
    except OSError:
        raise KernelUnavailable("backend='cpu' found no writable folder for its compiled "
                                "kernel: set PAGED_LIB_CACHE to one") from None


def _torch_libgomp() -> bool:
    """Is PyTorch's OpenMP runtime, already loaded in this process, GNU libgomp under its
    usual name? Then a kernel built with ``-fopenmp`` is handed that same runtime by the
    loader (one runtime, one thread team). Linux only (it reads ``/proc/self/maps``)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps") as maps:
            names = {Path(line.split()[-1]).name for line in maps if "libgomp" in line}
    except OSError:
        return False
    return names == {"libgomp.so.1"}


def _build() -> tuple[ctypes.CDLL, dict]:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    source = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    errors = []
    flag_sets = ((*FLAG_SETS[0], *OPENMP_FLAGS),) if _torch_libgomp() else ()
    for flags in (*flag_sets, *FLAG_SETS):
        flags = (*flags, "-shared", "-fPIC", "-std=gnu11")
        key = hashlib.sha256(source + version.encode() + " ".join(flags).encode()).hexdigest()
        target = _cache_dir() / f"paged_decode-{key[:16]}.so"
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                run = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(built),
                                      "-lm"],
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    errors.append(f"{cc} {' '.join(flags)}: {run.stderr.strip()[-400:]}")
                    continue
                os.replace(built, target)  # atomic: a second process never sees half a file
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as err:
            errors.append(f"{target}: {err}")
            continue
        fn = lib.paged_decode
        fn.restype = None
        fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3
                       + [ctypes.c_int] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_float]
                       + [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)])
        openmp = hasattr(lib, "paged_decode_team")
        if openmp:
            lib.paged_decode_team.restype = None
            lib.paged_decode_team.argtypes = [*fn.argtypes, ctypes.c_int]
        return lib, {"compiler": cc, "version": version.splitlines()[0] if version else "",
                     "flags": list(flags), "library": str(target),
                     "threads": "PyTorch's OpenMP team" if openmp else "Python threads"}
    raise KernelUnavailable("could not build or load paged_lib/kernels/csrc/*.c:\n"
                            + "\n".join(errors))


def library() -> ctypes.CDLL:
    """The compiled kernel, built on first use (raises :class:`KernelUnavailable`)."""
    global _library, _info
    with _lock:
        if _library is None:
            _library, _info = _build()
    return _library


def build_info() -> dict:
    """Compiler, flags and path of the library in use (building it if need be)."""
    library()
    return dict(_info)


def available() -> bool:
    """True if the kernel is (or can be) built on this machine."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True


def kv_heads_per_item(num_seqs: int, num_kv_heads: int, threads: int) -> int:
    """A work item's KV heads: all of a sequence's (whole blocks streamed), unless that
    leaves fewer than two items per thread; then the heads are split between items."""
    per_item = num_kv_heads
    while per_item > 1 and num_seqs * cdiv(num_kv_heads, per_item) < 2 * threads:
        per_item = cdiv(per_item, 2)
    return per_item


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        *, num_threads: int | None = None) -> torch.Tensor:
    """Decode attention through block tables with the C kernel; inputs validated by the
    dispatcher (:func:`paged_lib.kernels.paged_attention`). Shapes as there; computes in
    float32 and returns ``q.dtype``."""
    if q.device.type != "cpu":
        raise ValueError(f"backend='cpu' runs on CPU tensors, but q is on {q.device}")
    if k_cache.dtype not in KINDS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"backend='cpu' reads float32, float16 or bfloat16 caches of one "
                         f"dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("backend='cpu' needs caches whose last dimension is contiguous "
                         "and whose K and V strides are equal")
    lib = library()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    qf = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
    tables, lens, tokens = _step_metadata(block_tables, seq_lens)
    out = torch.empty_like(qf)
    threads = max(1, num_threads or torch.get_num_threads())
    team = hasattr(lib, "paged_decode_team")
    if num_threads is None:  # a thread's hand-off has a cost: only for enough work
        kv_bytes = 2 * tokens * num_kv_heads * head_dim * k_cache.element_size()
        least = MIN_BYTES_PER_TEAM_THREAD if team else MIN_BYTES_PER_THREAD
        threads = min(threads, max(1, kv_bytes // least))
    per_item = kv_heads_per_item(num_seqs, num_kv_heads, threads)
    counter = ctypes.c_int64(0)
    args = (qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KINDS[k_cache.dtype],
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
            num_kv_heads, head_dim, block_size, tables.shape[1], k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), float(scale), per_item, ctypes.byref(counter))
    threads = min(threads, num_seqs * cdiv(num_kv_heads, per_item))
    if threads == 1:
        lib.paged_decode(*args)
    elif team:  # PyTorch's own threads
        lib.paged_decode_team(*args, threads)
    else:
        helpers = [_workers().submit(lib.paged_decode, *args) for _ in range(threads - 1)]
        lib.paged_decode(*args)  # this thread works too
        for h in helpers:
            h.result()
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def paged_prefill_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal prefill through the decode kernel, one query row at a time: new token ``i``
    of sequence ``s`` is a decode row of length ``seq_lens[s] - query_lens[s] + i + 1``
    through ``s``'s block table, so it sees exactly its own position and those before.
    Inputs validated by the dispatcher (:func:`paged_lib.kernels.paged_prefill`)."""
    new = query_lens.long()
    owner = torch.repeat_interleave(torch.arange(new.shape[0], device=q.device), new)
    first_row = torch.cumsum(new, 0) - new  # each sequence's first row in q
    lens = ((seq_lens.long() - new - first_row)[owner]
            + torch.arange(q.shape[0], device=q.device) + 1)
    return paged_attention_cpu(q, k_cache, v_cache, block_tables[owner],
                               lens.to(torch.int32), scale)


#: The last step's block tables and lengths as the kernel reads them (int32, contiguous) and
#: their token count, with the tensors they came from: every layer of a step passes the same
#: two tensors, so the conversions and the sum (a read of the lengths) are done once a step.
_last_step: tuple | None = None


def _step_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    global _last_step
    last = _last_step
    if (last is not None and last[0] is block_tables and last[1] is seq_lens
            and last[2] == (block_tables._version, seq_lens._version)):
        return last[3]
    lens = seq_lens.to(torch.int32).contiguous()
    prepared = (block_tables.to(torch.int32).contiguous(), lens, int(lens.sum()))
    _last_step = (block_tables, seq_lens, (block_tables._version, seq_lens._version), prepared)
    return prepared


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                       thread_name_prefix="paged_decode")
    return _pool
