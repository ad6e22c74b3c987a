"""A deployment with its security on, as beyond loopback: mutual TLS between the gateway, the target
and a drafter, TLS and an API key on the gateway's gRPC and HTTP APIs. Real services on loopback (the
tiny random model in the target), with certificates made for the test run."""
import logging
import ssl

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_svc.server import create_service as create_drafter
from gateway.server import create_service as create_gateway
from specd.client import SpecdClient, build_request, speculative_config
from specd.model_store import DEFAULT_MODEL
from specd.security import bearer
from specd.serving import SERVING, Exposure
from specd.types import SamplingParams, SpeculativeConfig
from specd.v1 import generation_pb2, generation_pb2_grpc
from target_svc.server import TargetOptions, TargetService

pytestmark = pytest.mark.asyncio(loop_scope="module")

API_KEY = "test-key-5f2c"
REQUEST = build_request("one two three one two three one two", sampling=SamplingParams(max_tokens=16),
                        speculative=speculative_config("ngram"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(certificates, tiny_model_dir):
    drafter = create_drafter("ngram", "127.0.0.1:0", None, exposure=Exposure(tls=certificates.drafter))
    await drafter.start()
    target = TargetService(TargetOptions(model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None,
                                         drafters={"ngram": drafter.grpc_address}, tls=certificates.target,
                                         default_speculative=SpeculativeConfig(method="ngram"),
                                         kv_cache_tokens=1024, num_threads=1))
    await target.start()
    gateway = await create_gateway(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0", metrics_address=None,
                                   default_speculative=SpeculativeConfig(method="ngram"), http_address="127.0.0.1:0",
                                   tls=certificates.gateway, api_key=API_KEY)
    await gateway.start()
    yield gateway, target, drafter
    for service in (gateway, target, drafter):
        await service.stop(grace=0)


async def test_a_client_with_the_ca_and_the_key_gets_text_drafted_over_mutual_tls(deployment, certificates):
    gateway, _, drafter = deployment
    async with SpecdClient(gateway.grpc_address, tls_ca=certificates.ca_file, api_key=API_KEY) as client:
        _, token_ids, last = await client.complete(REQUEST, timeout=60)
    assert len(token_ids) == last.usage.completion_tokens == 16
    # The target reached the drafter over mutual TLS: it described its options, then was asked for drafts.
    assert drafter.registry.get_sample_value("specd_rpc_requests_total",
                                              {"rpc_method": "Describe", "code": "OK"}) >= 1


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
async def test_a_call_without_the_api_key_is_unauthenticated(deployment, certificates, api_key):
    gateway, _, _ = deployment
    async with SpecdClient(gateway.grpc_address, tls_ca=certificates.ca_file, api_key=api_key) as client:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.complete(REQUEST, timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.value.details().startswith("authorization:")


async def test_health_checks_need_no_api_key(deployment, certificates):
    gateway, _, _ = deployment
    credentials = grpc.ssl_channel_credentials(certificates.ca_file.read_bytes())
    async with grpc.aio.secure_channel(gateway.grpc_address, credentials) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == SERVING


async def test_a_plaintext_client_does_not_reach_the_gateway_even_with_the_key(deployment):
    gateway, _, _ = deployment
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(prompt="hi"), timeout=5, metadata=bearer(API_KEY)).read()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_http_api_is_served_over_tls_and_wants_the_bearer_key(deployment, certificates):
    gateway, target, _ = deployment
    assert gateway.http.url.startswith("https://")
    verify = ssl.create_default_context(cafile=str(certificates.ca_file))
    async with httpx.AsyncClient(base_url=gateway.http.url, verify=verify, timeout=60) as http:
        refused = await http.get("/v1/models")
        assert refused.status_code == 401
        assert refused.json()["error"]["param"] == "authorization"
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await http.get("/health")).status_code == 200
        models = await http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert models.status_code == 200
        completion = await http.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                     json={"model": models.json()["data"][0]["id"], "prompt": "one two",
                                           "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200
    assert completion.json()["usage"]["completion_tokens"] == 4


async def test_neither_the_prompt_nor_the_api_key_reaches_the_logs(deployment, certificates, caplog):
    gateway, _, _ = deployment
    prompt = "my secret recipe: four eggs, one cup of flour"
    caplog.set_level(logging.DEBUG)
    async with SpecdClient(gateway.grpc_address, tls_ca=certificates.ca_file, api_key=API_KEY) as client:
        await client.complete(build_request(prompt, sampling=SamplingParams(max_tokens=4)), timeout=60)
    async with SpecdClient(gateway.grpc_address, tls_ca=certificates.ca_file, api_key="a-wrong-key") as client:
        with pytest.raises(grpc.aio.AioRpcError):
            await client.complete(build_request(prompt), timeout=10)
    assert caplog.records  # the services did log, at DEBUG
    assert not [r.getMessage() for r in caplog.records
                if "secret recipe" in r.getMessage() or API_KEY in r.getMessage() or "a-wrong-key" in r.getMessage()]
