"""A small async client of the gateway's public Generation API."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from specd import defaults
from specd.rpc import CHANNEL_OPTIONS
from specd.security import bearer
from specd.types import SamplingParams
from specd.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def speculative_config(method: str = "", num_speculative_tokens: int | None = None, corpus_scope: str = "",
                       **options) -> common_pb2.SpeculativeConfig:
    """A request's speculative settings in vLLM's flat form: what is left out takes the deployment's
    defaults, and the keyword options are the method's own (e.g. prompt_lookup_max=4 for ngram).
    `corpus_scope`: only requests of the same scope draft from each other's outputs (suffix, trie)."""
    pb = common_pb2.SpeculativeConfig(method=method, corpus_scope=corpus_scope)
    if num_speculative_tokens is not None:
        pb.num_speculative_tokens = num_speculative_tokens
    pb.options.update(options)
    return pb


def build_request(prompt: str | None = None, messages: list[dict[str, str]] | None = None,
                  sampling: SamplingParams = SamplingParams(), stop: list[str] | None = None,
                  speculative: common_pb2.SpeculativeConfig | None = None) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from either a prompt or chat messages ({"role", "content"} dicts)."""
    request = generation_pb2.GenerateRequest(sampling=sampling.to_pb(), stop=stop or [], speculative=speculative)
    if messages is not None:
        request.chat.messages.extend(generation_pb2.ChatMessage(**m) for m in messages)
    else:
        request.prompt = prompt or ""
    return request


class SpecdClient:
    """`tls_ca`: reach the gateway over TLS, trusting this CA's certificates (PEM file); `api_key`: the
    gateway's API key, sent with every call. Its channel has the services' keepalive: a gateway that stops
    answering ends the calls in flight with UNAVAILABLE within seconds, deadline or not."""

    def __init__(self, address: str = defaults.GATEWAY_ADDRESS, tls_ca: str | Path | None = None,
                 api_key: str | None = None):
        if not tls_ca:
            self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self._channel = grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = bearer(api_key) if api_key else None

    def generate(self, request: generation_pb2.GenerateRequest,
                 timeout: float | None = None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Stream of chunks; the last one carries finish_reason and usage."""
        return self._stub.Generate(request, timeout=timeout, metadata=self._metadata)

    async def complete(self, request: generation_pb2.GenerateRequest,
                       timeout: float | None = None) -> tuple[str, list[int], generation_pb2.GenerateResponse]:
        """The whole text, all token ids and the last chunk."""
        text, token_ids, last = [], [], None
        async for chunk in self.generate(request, timeout):
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            last = chunk
        return "".join(text), token_ids, last

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> SpecdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
