"""Studies: the chapters' measurements, comparisons and experiments, built on the system.

A study asks a question of the system (how much does sharing save? which block size?
is SGLang's radix tree better than vLLM's hash chain?) and answers it with numbers a
chapter prints or plots. The serving system (``paged_lib`` outside ``studies`` and
``course``) never imports a study, and a study never imports :mod:`paged_lib.course`;
``tests/test_layout.py`` checks both. Nothing is imported here: import the study you
need, e.g. ``from paged_lib.studies import sharing``.

======================  =======  ====================================================
module                  chapter  question
======================  =======  ====================================================
``block_formats``       03       vLLM's padded block tables vs FlashInfer's CSR pages
``swap_cost``           07       swap or recompute a preempted request, by block size
``sharing``             08       KV memory sharing saves (parallel sampling, beams)
``sharing_engine``      08       the same, read off the engine's own samples and beams
``block_size``          09       block size: memory, engine and kernel cost
``prefix_workloads``    10       seeded prompts that share prefixes
``radix_tree``          10       SGLang's radix tree of cached prefixes
``prefix_compare``      10       hash chain vs radix tree on the same workloads
``chat_prefix``         10       prefix-cache hits of a chat served on a real template
``chunked_ttft``        10       what chunked prefill costs a long prompt's first token
``kv_quant_eval``       11       int8 / fp8 KV blocks: accuracy and bytes
``streaming``           11       a sliding window with attention sinks, measured
``kv_tier``             11       a CPU tier under the GPU's blocks: LRU vs CLOCK
======================  =======  ====================================================
"""
