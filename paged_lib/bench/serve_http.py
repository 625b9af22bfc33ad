"""``bench serve --base-url URL``: the same load sent to a running OpenAI-compatible server.

Each request is a streamed ``/v1/completions`` call (token-id prompt, ``max_tokens`` its
output length, greedy, ``ignore_eos`` as vLLM's extra field) started when the wall clock
passes its arrival; every streamed chunk with text is stamped when it comes. All requests
run concurrently on one asyncio loop with the official ``openai`` client (installed with
the course's test extra).
"""

from __future__ import annotations

import asyncio
import time

from paged_lib.bench.load import LoadRequest, Served


async def _one(client, model: str, req: LoadRequest, served: Served, start: float) -> None:
    await asyncio.sleep(max(0.0, req.arrival - (time.perf_counter() - start)))
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.output_len, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                served.token_times.append(time.perf_counter() - start)
    except Exception as err:  # noqa: BLE001 - a failed request is counted, not raised
        served.error = f"{type(err).__name__}: {err}"


def serve_load_http(base_url: str, load: list[LoadRequest], model: str | None = None,
                    timeout: float = 600.0) -> tuple[list[Served], float]:
    """Send ``load`` to the server at ``base_url`` (e.g. ``http://127.0.0.1:8000``); returns
    what each request saw and the duration (first arrival to last chunk, s). ``model``:
    the name to ask for (default: the first the server lists)."""
    import openai

    async def run() -> list[Served]:
        async with openai.AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="none",
                                      max_retries=0, timeout=timeout) as client:
            name = model or (await client.models.list()).data[0].id
            served = [Served(r.arrival, r.output_len) for r in load]
            start = time.perf_counter()
            await asyncio.gather(*(_one(client, name, r, s, start)
                                   for r, s in zip(load, served, strict=True)))
            return served

    served = asyncio.run(run())
    ends = [s.token_times[-1] for s in served if s.token_times]
    first = min((s.arrival for s in served), default=0.0)
    return served, max(ends, default=first) - first
