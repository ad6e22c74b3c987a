"""Who may talk to a specd service: TLS on every server and channel (mutual between the services), and
the API key of the public gateway. Both are off unless configured; a service that listens beyond
loopback without them says so in its log."""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# The flags' defaults, so one environment configures every service of a deployment alike.
TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = "SPECD_TLS_CERT", "SPECD_TLS_KEY", "SPECD_TLS_CA"
API_KEY_ENV = "SPECD_API_KEY"
# The health service answers without a key: load balancers and Kubernetes probes carry none.
UNAUTHENTICATED_SERVICES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class TlsConfig:
    """A service's identity (its certificate chain and key, PEM) and the CA its peers' certificates are
    checked against. With a CA, the service's server demands a client certificate signed by it (mutual
    TLS), and its channels to other services present its own certificate."""
    cert_file: Path
    key_file: Path
    ca_file: Path | None = None

    @classmethod
    def of(cls, cert_file: str | None, key_file: str | None, ca_file: str | None = None) -> TlsConfig | None:
        """None when no certificate is given; ValueError (naming the flag) for half a configuration or a
        file that cannot be read."""
        if not (cert_file or key_file):
            if ca_file:
                raise ValueError("--tls-ca: needs --tls-cert and --tls-key, the service's own identity")
            return None
        if not (cert_file and key_file):
            raise ValueError("--tls-cert and --tls-key: give both, or neither")
        config = cls(Path(cert_file), Path(key_file), Path(ca_file) if ca_file else None)
        for flag, path in (("--tls-cert", config.cert_file), ("--tls-key", config.key_file),
                           ("--tls-ca", config.ca_file)):
            if path is not None and not path.is_file():
                raise ValueError(f"{flag}: no such file: {path}")
        return config

    @classmethod
    def from_env(cls) -> TlsConfig | None:
        return cls.of(*(os.environ.get(name) or None for name in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)))

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        return (self.cert_file.read_bytes(), self.key_file.read_bytes(),
                self.ca_file.read_bytes() if self.ca_file else None)

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        """Internal services require a client certificate whenever there is a CA to check it against;
        the public gateway (require_client_cert=False) accepts any client, which then needs the API key."""
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_cert and ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For a channel to another specd service: trusts the CA (the system's roots without one) and
        presents this service's certificate."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def is_loopback(address: str) -> bool:
    """Whether a listen address ("127.0.0.1:50051", "[::1]:0", "localhost:80") reaches this machine only."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or "" / "0.0.0.0"-style wildcards: reachable from elsewhere
        return False


def bearer(api_key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries an API key, as OpenAI's clients send it over HTTP."""
    return (("authorization", f"Bearer {api_key}"),)


def key_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `authorization` value is `Bearer <api_key>`, compared in constant time."""
    scheme, _, presented = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks that does not carry `authorization: Bearer <key>` metadata,
    with UNAUTHENTICATED, before the request is read."""

    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("--api-key: must not be empty")
        self._api_key = api_key

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_SERVICES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if key_matches(metadata.get("authorization"), self._api_key):
            return handler
        return _refusing(handler)


_REFUSAL = "authorization: a missing or wrong API key; send the metadata 'authorization: Bearer <key>'"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # never reached: makes this an async generator, as streaming handlers are

    kind = {(False, False): "unary_unary", (False, True): "unary_stream",
            (True, False): "stream_unary", (True, True): "stream_stream"}[
        (handler.request_streaming, handler.response_streaming)]
    return handler._replace(**{kind: refuse_stream if handler.response_streaming else refuse})
