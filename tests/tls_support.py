"""Certificates made by the tests (with the ``cryptography`` package): a CA, a server
certificate for 127.0.0.1 and localhost, a client certificate, and a second CA that
nobody trusts, each as PEM files in one directory."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    ca: Path             # the CA that signed server and client
    server: Path         # for 127.0.0.1 and localhost
    server_key: Path
    client: Path         # a client certificate signed by ``ca``
    client_key: Path
    stranger_ca: Path    # a CA nobody trusts ...
    stranger: Path       # ... and a client certificate it signed
    stranger_key: Path
    other_name: Path     # signed by ``ca``, for example.invalid only
    other_name_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = path.with_name(path.stem + "-key.pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return key_path


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2)))


def _ca(directory: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(name, _name(name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    path = directory / ("%s.pem" % name)
    _write(path, cert, key)
    return cert, key, path


def _leaf(directory: Path, name: str, ca: tuple, names: list[x509.GeneralName] | None,
          usage: list) -> tuple[Path, Path]:
    ca_cert, ca_key, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(name, ca_cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    path = directory / ("%s.pem" % name)
    return path, _write(path, cert, key)


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    stranger_ca = _ca(directory, "stranger-ca")
    local = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    server, server_key = _leaf(directory, "server", ca, local, both)
    client, client_key = _leaf(directory, "client", ca, None, [ExtendedKeyUsageOID.CLIENT_AUTH])
    stranger, stranger_key = _leaf(directory, "stranger", stranger_ca, None, [ExtendedKeyUsageOID.CLIENT_AUTH])
    other, other_key = _leaf(directory, "other-name", ca, [x509.DNSName("example.invalid")], both)
    return Certs(ca[2], server, server_key, client, client_key, stranger_ca[2], stranger, stranger_key, other,
                 other_key)
