"""Who may talk to a service: mutual TLS between services, reflection only where asked, API keys."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from specd.rpc import service_channel
from specd.security import TlsConfig, is_loopback, key_matches
from specd.serving import SERVING, Exposure, Service


@pytest.fixture
async def start_service():
    started = []

    async def start(exposure: Exposure = Exposure(), address: str = "127.0.0.1:0") -> Service:
        service = Service("test", [], address, None, CollectorRegistry(), exposure)
        await service.start()
        started.append(service)
        return service
    yield start
    for service in started:
        await service.stop(grace=0)


async def health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def test_a_service_with_a_ca_answers_a_peer_whose_certificate_the_ca_signed(start_service, certificates):
    target = await start_service(Exposure(tls=certificates.target))
    async with service_channel(target.grpc_address, certificates.gateway) as channel:
        assert await health(channel) == SERVING


@pytest.mark.parametrize("client", ["plaintext", "no certificate", "a stranger's certificate"])
async def test_a_service_with_a_ca_refuses_clients_without_the_deployments_identity(start_service, certificates,
                                                                                   client):
    target = await start_service(Exposure(tls=certificates.target))
    ca = certificates.ca_file.read_bytes()
    channel = {"plaintext": lambda: grpc.aio.insecure_channel(target.grpc_address),
               "no certificate": lambda: grpc.aio.secure_channel(target.grpc_address,
                                                                 grpc.ssl_channel_credentials(ca)),
               "a stranger's certificate": lambda: service_channel(target.grpc_address, certificates.stranger)}[client]
    async with channel() as refused:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await health(refused)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_client_does_not_talk_to_a_server_its_ca_did_not_sign(start_service, certificates):
    impostor = await start_service(Exposure(tls=certificates.stranger))
    async with service_channel(impostor.grpc_address, certificates.gateway) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await health(channel)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_public_gateway_takes_tls_clients_without_a_certificate(start_service, certificates):
    gateway = await start_service(Exposure(tls=certificates.gateway, require_client_cert=False))
    credentials = grpc.ssl_channel_credentials(certificates.ca_file.read_bytes())
    async with grpc.aio.secure_channel(gateway.grpc_address, credentials) as channel:
        assert await health(channel) == SERVING


async def reflected_services(service: Service) -> list[str] | grpc.StatusCode:
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        try:
            async for reply in call:
                return [s.name for s in reply.list_services_response.service]
        except grpc.aio.AioRpcError as error:
            return error.code()


@pytest.mark.parametrize("reflection, answered", [(None, True), (False, False)])
async def test_reflection_is_on_for_loopback_unless_turned_off(start_service, reflection, answered):
    service = await start_service(Exposure(reflection=reflection))
    listed = await reflected_services(service)
    assert ("grpc.health.v1.Health" in listed) if answered else listed == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_is_off_beyond_loopback_unless_asked_for():
    assert not Exposure().reflection_on("0.0.0.0:50051")
    assert Exposure(reflection=True).reflection_on("0.0.0.0:50051")


@pytest.mark.parametrize("address, loopback", [("127.0.0.1:50051", True), ("[::1]:0", True), ("localhost:80", True),
                                               ("0.0.0.0:50051", False), ("[::]:50051", False),
                                               ("target:50052", False), ("10.0.0.7:1", False)])
def test_loopback_addresses_are_told_from_the_rest(address, loopback):
    assert is_loopback(address) == loopback


@pytest.mark.parametrize("authorization, matches", [("Bearer s3cret", True), ("bearer s3cret", True),
                                                    ("Bearer s3cre", False), ("s3cret", False), (None, False),
                                                    ("Basic s3cret", False), ("Bearer ", False)])
def test_an_api_key_is_taken_only_as_a_bearer_token(authorization, matches):
    assert key_matches(authorization, "s3cret") == matches


def test_half_a_tls_configuration_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        TlsConfig.of(str(tmp_path / "cert.pem"), None)
    with pytest.raises(ValueError, match="--tls-ca: needs --tls-cert"):
        TlsConfig.of(None, None, str(tmp_path / "ca.pem"))
    with pytest.raises(ValueError, match="--tls-cert: no such file"):
        TlsConfig.of(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    assert TlsConfig.of(None, None) is None
