"""Instruments that watch the system work, used by graders and pictures alike.

- :mod:`~paged_lib.instruments.load_trace`: every load a Triton kernel makes in the
  interpreter (which program, which address, masked or not).
- :mod:`~paged_lib.instruments.block_reads`: a KV-cache proxy that logs every block read.
"""
