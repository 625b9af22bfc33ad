"""Benchmarks, one module per job:

* :mod:`~paged_lib.bench.attention` - the decode kernel vs contiguous attention
  (``cpu_ratios``, ``gpu_sweep``);
* :mod:`~paged_lib.bench.engine` - the engine;
* :mod:`~paged_lib.bench.floor` - this machine's bandwidth and FLOP/s, measured in the
  same run, and the least time a step can take: the floor every CPU figure is set beside;
* :mod:`~paged_lib.bench.gpu_check` - the first run on a real GPU, with a stored report;
* :mod:`~paged_lib.bench.checks` (nothing unchecked is timed), :mod:`~paged_lib.bench.timing`,
  :mod:`~paged_lib.bench.hardware` (spec bandwidths), :mod:`~paged_lib.bench.report`
  (tables and goals).

    python -m paged_lib.bench attention
    python -m paged_lib.bench engine ...
"""
