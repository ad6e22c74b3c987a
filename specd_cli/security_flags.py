"""The command line's security flags: each service's TLS identity, reflection, the gateway's API key,
and what a client needs to reach a gateway that has them. Every flag defaults to its environment
variable, so one environment configures a whole deployment."""
from __future__ import annotations

import argparse
import os

from specd.security import API_KEY_ENV, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TlsConfig


def add_service_flags(parser: argparse.ArgumentParser, public: bool) -> None:
    """`public`: the gateway, whose clients are users (an API key, no client certificates)."""
    group = parser.add_argument_group("security (off by default; services listen on loopback)")
    group.add_argument("--tls-cert", default=os.environ.get(TLS_CERT_ENV) or None, metavar="PEM",
                       help=f"this service's certificate chain: serve over TLS (env {TLS_CERT_ENV})")
    group.add_argument("--tls-key", default=os.environ.get(TLS_KEY_ENV) or None, metavar="PEM",
                       help=f"the certificate's private key (env {TLS_KEY_ENV})")
    group.add_argument("--tls-ca", default=os.environ.get(TLS_CA_ENV) or None, metavar="PEM",
                       help="the CA of the deployment's certificates: mutual TLS between the services; internal "
                            f"services refuse clients without a certificate it signed (env {TLS_CA_ENV})")
    group.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=None,
                       help="answer gRPC reflection (default: only when listening on loopback)")
    if public:
        group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
                           help="refuse gRPC calls and /v1 HTTP requests without 'authorization: Bearer KEY' "
                                f"(env {API_KEY_ENV}; health checks need none)")


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--tls-ca", default=os.environ.get(TLS_CA_ENV) or None, metavar="PEM",
                       help=f"reach the gateway over TLS, trusting this CA (env {TLS_CA_ENV})")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
                       help=f"the gateway's API key (env {API_KEY_ENV})")


def tls_of(args: argparse.Namespace) -> TlsConfig | None:
    """The service's TLS identity; ValueError naming the flag when it is incomplete or unreadable."""
    return TlsConfig.of(args.tls_cert, args.tls_key, args.tls_ca)
