"""`redjax bench serve`: an async load generator for any OpenAI-compatible completions or chat endpoint.

Requests stream (`stream_options.include_usage`) and arrive as a Poisson process at a rate (gamma
with `burstiness`) or all at once, optionally capped at a concurrency; each records its time to
first token, the gaps between content chunks and its end. Output tokens are counted from `usage`,
not from chunks (a chunk may carry several tokens, or none).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import httpx

from worker.bench.prompts import Prompt


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float | None = None  # seconds to the first chunk with text; None if none had any (a model
    # whose tokens all decode to nothing: ids past its tokenizer's vocabulary), not a latency of zero
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server says
    output_tokens: int = 0
    unreached: bool = False  # nothing answered at the URL (connection refused: a server not up yet)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None without two tokens, or without a first text)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Load:
    num_prompts: int
    request_rate: float = float("inf")  # arrivals per second; inf: all at once
    concurrency: int | None = None  # requests in flight at most
    output_len: int = 128  # max_tokens of prompts without their own
    seed: int = 0
    burstiness: float = 1.0  # shape of the gamma-distributed gaps: 1 Poisson, < 1 burstier, > 1 steadier
    endpoint: str = "completions"  # or "chat": /v1/chat/completions with the prompt as one user message
    ignore_eos: bool = True  # False: requests may end before max_tokens (and servers without the extension work)
    temperature: float = 0.0  # 0: greedy
    top_p: float | None = None  # None: not sent (the server's default)
    top_k: int | None = None  # an extension (vLLM's, redjax's); None: not sent
    min_p: float | None = None  # the same
    logprobs: int | None = None  # every request asks for its tokens' logprobs and this many alternatives
    extra_body: dict | None = None  # more fields every request sends (a server's own extensions), last

    def sampling(self) -> dict:
        """The sampling fields every request sends."""
        extra = {"top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        return {"temperature": self.temperature, **{k: v for k, v in extra.items() if v is not None}}

    def gap(self, rng: random.Random) -> float:
        """Seconds until the next arrival: gamma with mean 1 / request_rate (0 at an infinite rate)."""
        if self.request_rate == float("inf"):
            return 0.0
        return rng.gammavariate(self.burstiness, 1.0 / (self.request_rate * self.burstiness))

    def body(self, model: str, prompt: Prompt) -> dict:
        body = {"model": model, "max_tokens": prompt.output_len or self.output_len, **self.sampling(),
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            if self.logprobs is not None:  # the chat API's spelling of the same request
                body |= {"logprobs": True, "top_logprobs": self.logprobs}
            return {**body, "messages": [{"role": "user", "content": prompt.text}], **(self.extra_body or {})}
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        return {**body, "prompt": prompt.text, **(self.extra_body or {})}


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> Result:
    r = Result(start=time.perf_counter())
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return r
            await _read_stream(resp.content, r)
        r.e2e = time.perf_counter() - r.start
        r.ok = r.output_tokens > 0 or not body["max_tokens"]
        if not r.ok:
            r.error = ("the stream ended without a usage chunk with completion_tokens (the server must honour "
                       "stream_options.include_usage: output tokens are counted from it)")
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
        r.unreached = isinstance(exc, aiohttp.ClientConnectorError)
    return r


async def _read_stream(content: aiohttp.StreamReader, r: Result) -> None:
    """Reads SSE `data:` lines into `r` until `[DONE]` or the end of the body.

    One await per network read, not per line: a read often holds several events (a server
    writes what it has in one send). Each event is timed when it has been parsed, as line by line.
    Lines end in LF or CRLF."""
    last = r.start
    tail = b""
    async for data in content.iter_any():
        lines = (tail + data).split(b"\n")
        tail = lines.pop()  # an incomplete line, or b""
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments (": ping"), other fields
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            chunk = json.loads(payload)
            now = time.perf_counter()
            if any(_content(c) for c in chunk.get("choices") or []):
                if r.ttft is None:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last)
                last = now
            if chunk.get("usage"):
                r.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                r.output_tokens = chunk["usage"].get("completion_tokens", 0)
                r.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")


def _content(choice: dict) -> str:
    """A completions choice's text, or a chat delta's content (or reasoning, where a server splits it off)."""
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def run_load(base_url: str, model: str, prompts: list[Prompt], load: Load, api_key: str | None = None,
                   progress=None) -> tuple[float, list[Result]]:
    """-> (seconds from the first send to the last finish, one Result per prompt in order).

    aiohttp (C HTTP parser) rather than httpx: the load generator usually shares the machine with
    the server under test, and httpx spent ~275 us of CPU per streamed event."""
    headers = _headers(api_key)
    rng = random.Random(load.seed)
    gate = asyncio.Semaphore(load.concurrency or len(prompts) or 1)
    url = _endpoint(base_url, load)
    connector = aiohttp.TCPConnector(limit=load.concurrency or len(prompts) or 1)
    # SSE lines can exceed aiohttp's 64 KiB default line limit (long logprob chunks)
    async with aiohttp.ClientSession(headers=headers, connector=connector, read_bufsize=2**20,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def send(prompt: Prompt) -> Result:
            async with gate:
                result = await one_request(session, url, load.body(model, prompt))
            if progress:
                progress()
            return result

        t0 = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(prompt)))
            # at an infinite rate each request still goes out as soon as it is built: without the
            # yield the server sat idle until all were built (~80 ms for 256 on 2 cores)
            await asyncio.sleep(load.gap(rng))
        results = await asyncio.gather(*tasks)
        return time.perf_counter() - t0, list(results)


def served_model(base_url: str, api_key: str | None = None, wait_s: float = 0.0) -> str:
    """The first model /v1/models lists; while nothing listens at the URL (a server still starting),
    asked again every second for up to `wait_s`."""
    headers = _headers(api_key)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
            break
        except httpx.ConnectError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def first_request(base_url: str, model: str, prompt: Prompt, load: Load, api_key: str | None,
                  wait_s: float) -> Result:
    """One request before anything is timed, as vLLM's benchmark sends: it shows the endpoint serves
    the model, the key and the load's options, so a refused one stops the benchmark before the load
    goes out, and it waits for a server still starting. A request waits in redjax's queue while the
    workers load and compile (seconds to minutes), which the first timed requests would otherwise
    count; while nothing listens at the URL it is sent again every second. Both for up to `wait_s`."""
    url, headers = _endpoint(base_url, load), _headers(api_key)

    async def send() -> Result:
        deadline = time.monotonic() + wait_s
        timeout = aiohttp.ClientTimeout(total=max(wait_s, 1.0))
        async with aiohttp.ClientSession(headers=headers, read_bufsize=2**20, timeout=timeout) as session:
            while True:
                result = await one_request(session, url, load.body(model, prompt))
                if not result.unreached or time.monotonic() >= deadline:
                    return result
                await asyncio.sleep(1.0)

    with _runner() as runner:
        return runner.run(send())


def warm_up(base_url: str, model: str, prompts: list[Prompt], load: Load, api_key: str | None) -> list[Result]:
    """Untimed requests at the load's concurrency, all at once: the server compiles and allocates
    for the load's shapes before the timed run."""
    with _runner() as runner:
        return runner.run(run_load(base_url, model, prompts, load, api_key))[1]


def _endpoint(base_url: str, load: Load) -> str:
    return base_url.rstrip("/") + ("/v1/chat/completions" if load.endpoint == "chat" else "/v1/completions")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _runner() -> asyncio.Runner:
    """uvloop where installed (with uvicorn, off Windows): less of the shared CPU per streamed event."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def bench_serve(base_url: str, model: str | None, prompts: list[Prompt], load: Load, api_key: str | None = None,
                slo: dict[str, float] | None = None, percentiles: tuple[float, ...] | None = None,
                detailed: bool = False) -> dict:
    """One run of `load` -> its report; `detailed`: with each request's figures too (`per_request`)."""
    from tqdm import tqdm

    from worker.bench.stats import PERCENTILES, summarize
    from worker.heap import freeze_startup_heap

    model = model or served_model(base_url, api_key)
    bar = tqdm(total=len(prompts), desc=describe_load(load.request_rate, load.concurrency), unit="req",
               file=sys.stderr)
    freeze_startup_heap()  # the load generator shares the cores with the server: no walks of its imports
    with _runner() as runner:
        seconds, results = runner.run(run_load(base_url, model, prompts, load, api_key, lambda: bar.update(1)))
    bar.close()
    rate = None if load.request_rate == float("inf") else load.request_rate
    return {"model": model, "endpoint": load.endpoint, "request_rate": rate, "burstiness": load.burstiness,
            "concurrency": load.concurrency, "ignore_eos": load.ignore_eos, "sampling": load.sampling(),
            "logprobs": load.logprobs,
            **summarize(results, seconds, slo or {}, percentiles or PERCENTILES),
            **({"requests": per_request(results)} if detailed else {})}


def per_request(results: list[Result]) -> list[dict]:
    """Each request's figures, in prompt order (`--save-detailed`): when it was sent, in seconds
    after the first send, and its latencies in ms (None where not measured: a failed request, a
    single output token's TPOT). Never the prompt or the text."""
    first = min((r.start for r in results), default=0.0)

    def ms(seconds: float | None, ok: bool) -> float | None:
        return seconds * 1e3 if ok and seconds is not None else None

    return [{"sent_s": r.start - first, "ok": r.ok, "error": r.error or None, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft, r.ok),
             "tpot_ms": ms(r.tpot, r.ok), "e2e_ms": ms(r.e2e, r.ok), "itl_ms": [g * 1e3 for g in r.itl] if r.ok else []}
            for r in results]


def describe_load(request_rate: float | None, concurrency: int | None) -> str:
    """"rate 2/s", "rate inf/s, concurrency 8": how the requests arrived."""
    rate = "inf" if request_rate is None or request_rate == float("inf") else f"{request_rate:g}"
    return f"rate {rate}/s" + (f", concurrency {concurrency}" if concurrency else "")
