"""Certificates made for a test run: a deployment's CA with one certificate per service, valid for
loopback, and a stranger's CA with a certificate of its own (what mutual TLS must refuse)."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from specd.security import TlsConfig

LOOPBACK_NAMES = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


@dataclass(frozen=True)
class Authority:
    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    pem_file: Path


def _builder(subject: str, issuer: str, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def make_authority(directory: Path, name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (_builder(name, name, key.public_key())
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .sign(key, hashes.SHA256()))
    pem_file = directory / f"{name}.pem"
    pem_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return Authority(name, key, certificate, pem_file)


def issue(authority: Authority, directory: Path, name: str) -> TlsConfig:
    """A certificate for `name` on loopback, signed by `authority`, usable by a server and by a client;
    as the TlsConfig of a service that trusts `authority`."""
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (_builder(name, authority.name, key.public_key())
                   .add_extension(x509.SubjectAlternativeName(LOOPBACK_NAMES), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                         x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                   .sign(authority.key, hashes.SHA256()))
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return TlsConfig(cert_file, key_file, authority.pem_file)


@dataclass(frozen=True)
class Deployment:
    """The deployment's CA file and each service's identity, plus a stranger signed by another CA."""
    ca_file: Path
    gateway: TlsConfig
    target: TlsConfig
    drafter: TlsConfig
    stranger: TlsConfig

    @classmethod
    def make(cls, directory: Path) -> Deployment:
        ca, other = make_authority(directory, "specd-ca"), make_authority(directory, "other-ca")
        return cls(ca.pem_file, *(issue(ca, directory, name) for name in ("gateway", "target", "drafter")),
                   stranger=issue(other, directory, "stranger"))
