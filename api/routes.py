"""The HTTP endpoints: completions, chat completions, models, health and readiness."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from redis.exceptions import RedisError
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.assembly import Assembler, Piece
from api.errors import ApiError, redis_unavailable
from api.generation import Run, unless_disconnected
from api.protocol import ParsedRequest, parse_chat, parse_completion, parse_detokenize, parse_json, parse_tokenize
from api.queue import live_workers
from api.responses import full_response, piece_chunk, role_chunk, usage_chunk
from api.services import ApiServices
from api.tool_calls import ToolCallFilter
from worker.contract import WorkerState


# Bodies up to this size are parsed and tokenized on the event loop (at ~4.7 MB/s with the demo
# tokenizer: under a millisecond). Handing a short prompt to a worker thread cost more than
# tokenizing it: 256 requests at once took 0.52-0.59 core-s of API CPU through the thread pool,
# 0.34-0.41 inline. Longer bodies still go to a thread, so they never stall the other streams.
INLINE_PARSE_BYTES = 4096


async def completions(request: Request) -> Response:
    services: ApiServices = request.app.state.services
    parsed = await _parse(await request.body(), parse_completion, services.model,
                          services.config.max_prompts_per_request)
    return await _generate(request, services, parsed)


async def chat_completions(request: Request) -> Response:
    services: ApiServices = request.app.state.services
    parsed = await _parse(await request.body(), parse_chat, services.model)
    return await _generate(request, services, parsed)


async def _parse(raw: bytes, parse, *args) -> ParsedRequest:
    body = parse_json(raw)
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse(body, *args)
    return await run_in_threadpool(parse, body, *args)


async def _generate(request: Request, services: ApiServices, parsed: ParsedRequest) -> Response:
    run = Run(services, parsed)
    await run.start(getattr(request.state, "request_id", ""))
    tools = ToolCallFilter(parsed.tool_calls, parsed.parallel_tool_calls) if parsed.tool_calls else None
    assembler = Assembler(parsed, services.model, post=tools.feed if tools else None)
    try:
        if parsed.stream:
            # Wait for the first output before answering 200, so queue-side failures keep their status.
            first = await unless_disconnected(request.receive, _next_pieces(run, assembler))
            stream = _sse(run, assembler, first)
            # run.close() is idempotent: the generator calls it; the background task covers a stream never started.
            # on SIGTERM sse-starlette ends every stream at once unless given a grace period: a stream
            # goes on for most of uvicorn's (the rest is for the ends to go out), then is cut
            config = services.config
            return EventSourceResponse(stream, ping=config.sse_ping_s, sep="\n", background=BackgroundTask(run.close),
                                       shutdown_grace_period=0.9 * config.shutdown_grace_s)  # fmt: skip
        pieces = await unless_disconnected(request.receive, _all_pieces(run, assembler))
    except BaseException:
        await run.close()
        raise
    await run.close()
    return JSONResponse(full_response(parsed, pieces, assembler.usage(), assembler.prompt_logprobs()))


async def _next_pieces(run: Run, assembler: Assembler) -> list[Piece]:
    """Pieces of the next deltas that carry any (empty once the run has finished)."""
    while not run.finished:
        pieces = assembler.feed(*await run.next_event())
        if pieces:
            return pieces
    return []


async def _all_pieces(run: Run, assembler: Assembler) -> list[Piece]:
    pieces: list[Piece] = []
    while not run.finished:
        pieces += assembler.feed(*await run.next_event())
    return pieces


async def _sse(run: Run, assembler: Assembler, first: list[Piece]) -> AsyncIterator[bytes]:
    """OpenAI stream: chunks as `data:` events, then `data: [DONE]`. Errors after 200 become an error event.

    Every chunk is its own event, but the events of all deltas that have arrived by the time the
    stream is written go out in one write (one ASGI send, one syscall): under load a request's
    deltas queue up while the event loop serves others, and a send per event cost more CPU than
    building it. A client that goes away cancels this generator; `run.close()` then withdraws
    the request.
    """
    parsed = assembler.parsed
    events: list[str] = []

    def chunks(pieces: list[Piece]) -> list[str]:
        usage = assembler.usage() if parsed.continuous_usage else None  # the tokens received so far
        return [json.dumps(piece_chunk(parsed, piece, usage)) for piece in pieces]

    try:
        if parsed.kind == "chat":  # before any token, though the first ones have arrived by now
            usage = assembler.usage() if parsed.continuous_usage else None
            if usage:
                usage |= {"completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
            events.append(json.dumps(role_chunk(parsed, usage)))
        pieces = first
        while True:
            events += chunks(pieces)
            while not run.finished and (event := run.ready_event()) is not None:
                events += chunks(assembler.feed(*event))
            if run.finished:
                break
            yield _events(events)
            events = []
            pieces = await _next_pieces(run, assembler)
        if parsed.include_usage:
            events.append(json.dumps(usage_chunk(parsed, assembler.usage())))
        events.append("[DONE]")
    except ApiError as exc:
        events += [exc.sse_data(), "[DONE]"]
    finally:
        await run.close()
    yield _events(events)


def _events(payloads: list[str]) -> bytes:
    """Server-sent events, one `data:` line each (JSON payloads hold no newline)."""
    return "".join(f"data: {p}\n\n" for p in payloads).encode()


async def tokenize(request: Request) -> Response:
    """vLLM's POST /tokenize: a prompt, or chat messages through the template, as token ids; no
    request is queued."""
    model = request.app.state.services.model
    ids, strings = await _parse(await request.body(), parse_tokenize, model)
    body = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    return JSONResponse(body | ({"token_strs": model.token_strings(ids)} if strings else {}))


async def detokenize(request: Request) -> Response:
    """vLLM's POST /detokenize: token ids back to text (special tokens kept, so it inverts /tokenize)."""
    model = request.app.state.services.model
    ids = await _parse(await request.body(), parse_detokenize, model)
    return JSONResponse({"prompt": model.decode(ids, skip_special_tokens=False)})


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def model(request: Request) -> Response:
    """GET /v1/models/{model}: the served model's card (the openai client's `models.retrieve`)."""
    card = _model_card(request)
    name = request.path_params["model"]
    if name != card["id"]:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{card['id']}`", param="model",
                       code="model_not_found")  # fmt: skip
    return JSONResponse(card)


def _model_card(request: Request) -> dict:
    services: ApiServices = request.app.state.services
    return {
        "id": services.model.name, "object": "model", "created": request.app.state.started_at, "owned_by": "redjax",
        "root": services.model.name, "max_model_len": services.model.max_model_len,
    }  # fmt: skip


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 when Redis answers and at least one live worker serving the model takes requests; else
    503: "worker_starting" while the only ones are warming up (requests sent now wait in the queue
    for them), "no_worker" when none is alive."""
    services: ApiServices = request.app.state.services
    try:
        await services.client.ping()
        workers = await live_workers(services.client, services.model.name)
    except (RedisError, OSError):
        raise redis_unavailable() from None
    serving = [name for name, state in workers.items() if state == WorkerState.SERVING.value]
    if not serving and WorkerState.STARTING.value in workers.values():
        raise ApiError(503, f"the workers serving {services.model.name} are warming up; requests wait in the queue",
                       code="worker_starting")
    if not serving:
        raise ApiError(503, f"no live worker serves {services.model.name}", code="no_worker")
    return JSONResponse({"status": "ready", "model": services.model.name, "workers": serving})
