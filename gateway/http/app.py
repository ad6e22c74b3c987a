"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models and /health."""
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.http.errors import HttpError
from gateway.http.protocol import ChatCompletionRequest, CompletionRequest
from gateway.http.responses import ChatShape, CompletionShape, ResponseShape
from gateway.metrics import GatewayMetrics
from gateway.pipeline import GenerationPipeline
from specd.errors import InvalidArgument
from specd.v1 import generation_pb2


def build_app(pipeline: GenerationPipeline, metrics: GatewayMetrics) -> FastAPI:
    app = FastAPI(title="specd", summary="OpenAI-compatible API of a specd gateway")
    model = pipeline.model_info.model
    token_texts = pipeline.tokenizer.token_texts

    @app.exception_handler(HttpError)
    async def answer_error(request: Request, error: HttpError) -> JSONResponse:
        metrics.http_requests.labels(request.url.path, str(error.status)).inc()
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def answer_malformed(request: Request, error: RequestValidationError) -> JSONResponse:
        """A body that is not JSON or does not fit the schema: 400 naming the first bad field."""
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        return await answer_error(request, HttpError(400, f"{param or 'body'}: {first['msg']}", param))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not pipeline.target_health.serving:
            raise HttpError(503, f"target service unavailable: {pipeline.target_health.last_problem}")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specd"}]}

    async def respond(route: str, body: ChatCompletionRequest | CompletionRequest, shape: ResponseShape):
        if body.model != model:
            raise HttpError(404, f"model: the model {body.model!r} does not exist; this server serves {model!r}",
                            "model")
        try:
            request = body.to_request()
        except InvalidArgument as error:
            raise HttpError.of(error) from None
        chunks = pipeline.generate(request)
        try:  # the first chunk, before any answer: refusals get their own status, not a broken stream
            first = await anext(chunks)
        except Exception as error:
            await chunks.aclose()
            raise HttpError.of(error) from None
        metrics.http_requests.labels(route, "200").inc()
        if body.stream:
            return StreamingResponse(_events(first, chunks, shape, body.include_usage),
                                     media_type="text/event-stream")
        return JSONResponse(await _whole(first, chunks, shape))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await respond("/v1/chat/completions", body, ChatShape(model, token_texts, body.return_token_ids))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await respond("/v1/completions", body, CompletionShape(model, token_texts, body.return_token_ids))

    return app


async def _whole(first: generation_pb2.GenerateResponse, chunks: AsyncIterator[generation_pb2.GenerateResponse],
                 shape: ResponseShape) -> dict:
    responses = [first]
    async with contextlib.aclosing(chunks):
        try:
            async for response in chunks:
                responses.append(response)
        except Exception as error:
            raise HttpError.of(error) from None
    return shape.whole(responses)


async def _events(first: generation_pb2.GenerateResponse, chunks: AsyncIterator[generation_pb2.GenerateResponse],
                  shape: ResponseShape, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them; an error after the stream began is one last event."""
    async with contextlib.aclosing(chunks):  # a client gone cancels the request at the target now
        yield _event(shape.chunk(first, first=True))
        last = first
        try:
            async for last in chunks:
                yield _event(shape.chunk(last, first=False))
        except Exception as error:
            yield _event(HttpError.of(error).body())
            return
    if include_usage:
        yield _event(shape.usage_chunk(last.usage))
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
