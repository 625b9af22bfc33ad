"""An OpenAI-compatible server over the engine (chapter 14): ``python -m paged_lib.serve``.

As vLLM serves its engine to the OpenAI client, with requests arriving while others run:

* :mod:`~paged_lib.serve.async_engine` - one thread steps the engine; requests join and
  leave (aborts free their blocks) between steps; each gets its tokens as its step ends;
* :mod:`~paged_lib.serve.detokenize` - tokens to text pieces safe to stream: whole
  characters, stop strings held back until decided;
* :mod:`~paged_lib.serve.outputs` - pieces to OpenAI's choices, logprobs and usage;
* :mod:`~paged_lib.serve.protocol` - the requests accepted (unknown fields ignored, as vLLM), their
  one mapping to ``SamplingParams``, and the error shape;
* :mod:`~paged_lib.serve.api_server` - the FastAPI routes and server-sent events;
* :mod:`~paged_lib.serve.metrics` - ``/metrics`` under vLLM's names;
* ``__main__`` - the command line, engine options as flags.
"""
