"""Benchmarks: the attention kernels (:mod:`~paged_lib.bench.attention`), the engine
(:mod:`~paged_lib.bench.engine`) and the GPU report (:mod:`~paged_lib.bench.gpu_check`).

    python -m paged_lib.bench attention
    python -m paged_lib.bench engine ...
"""
