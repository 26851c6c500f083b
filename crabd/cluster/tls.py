"""Mutual TLS for crab's Ray cluster: one cluster CA, one key and certificate per host.

Ray encrypts and authenticates all of its gRPC traffic (GCS, raylets, workers,
the object manager) when ``RAY_USE_TLS=1`` is in the environment of every Ray
process.  Each process presents ``RAY_TLS_SERVER_CERT``/``RAY_TLS_SERVER_KEY``
both as a server and as a client, and trusts only peers whose certificate
chains to ``RAY_TLS_CA_CERT``.  So a host certificate here is good for both
roles (serverAuth and clientAuth), and its SANs must name every address that
other hosts dial (gRPC checks the dialled host against them).

Keys are ECDSA P-256: gRPC's TLS stack (BoringSSL) accepts it everywhere,
it is small, and it is fast to make (tests make a CA per run).  Files are
written atomically (temp file, fsync, rename), keys with mode 0600, so a
crash never leaves half a key and no key is ever readable by others.

This module needs only ``cryptography`` (the ``cluster`` extra), not Ray.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CA_DAYS = 3650
HOST_DAYS = 825
# Host ids become file names and Ray resource names ("crab-host:<id>").
_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class TlsError(ValueError):
    """A CA or host certificate cannot be made or used (missing CA, bad host id, bad address)."""


@dataclass(frozen=True)
class HostFiles:
    """Where one host's TLS material lives."""

    cert: Path
    key: Path
    ca_cert: Path


def check_host_id(host: str) -> str:
    """``host`` if it is a valid host id (letters, digits, ``.``, ``_``, ``-``; at most 63), else TlsError."""
    if not _HOST_ID.match(host):
        raise TlsError(f"invalid host id {host!r}: letters, digits, '.', '_', '-' (at most 63, not first)")
    return host


def host_files(directory: str | Path, host: str) -> HostFiles:
    d = Path(directory)
    check_host_id(host)
    return HostFiles(cert=d / f"{host}.crt", key=d / f"{host}.key", ca_cert=d / CA_CERT)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` all or nothing: readers see the old file or the whole new one.

    The temp file is created 0600 (mkstemp) and chmod-ed before the rename, so
    a key is never visible under its name with wider permissions.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    # A minute back: hosts' clocks differ a little, and a cert "not yet valid" fails the handshake.
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)


def init_ca(directory: str | Path, *, name: str = "crab cluster CA", force: bool = False) -> Path:
    """Create the cluster CA (``ca.crt``, ``ca.key``) in ``directory``; returns the certificate's path.

    Refuses (TlsError) to replace an existing CA unless ``force``: every host
    certificate signed by the old one would stop being trusted.
    """
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (d / CA_CERT).exists() and not force:
        raise TlsError(f"a CA already exists in {d} (pass force to replace it and re-issue every host certificate)")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    # Key first: a CA cert on disk always has its key beside it.
    _write_atomic(d / CA_KEY, _key_pem(key), 0o600)
    _write_atomic(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return d / CA_CERT


def load_ca(directory: str | Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    d = Path(directory)
    try:
        cert = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as e:
        raise TlsError(f"no cluster CA in {d} (run `crabctl cluster ca init --dir {d}` first)") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TlsError(f"{d / CA_KEY} is not an EC key")
    return cert, key


def issue_host_cert(
    directory: str | Path, host: str, *, dns_names: Iterable[str] = (), ips: Iterable[str] = ()
) -> HostFiles:
    """Make ``host``'s key and certificate, signed by the CA in ``directory``.

    SANs: ``host`` itself and ``localhost`` and ``dns_names`` as DNS names;
    127.0.0.1 and ``ips`` as IP addresses (Ray dials peers by IP, so every
    address other hosts reach this one on must be here).
    """
    files = host_files(directory, host)
    ca_cert, ca_key = load_ca(directory)
    try:
        addrs = sorted({ipaddress.ip_address("127.0.0.1"), *(ipaddress.ip_address(i) for i in ips)}, key=str)
    except ValueError as e:
        raise TlsError(f"bad IP address for {host}: {e}") from e
    names = list(dict.fromkeys([host, "localhost", *dns_names]))
    key = ec.generate_private_key(ec.SECP256R1())
    start = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=HOST_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [*(x509.DNSName(n) for n in names), *(x509.IPAddress(a) for a in addrs)],
            ),
            critical=False,
        )
        # Ray uses one certificate as server and as client.
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_atomic(files.key, _key_pem(key), 0o600)
    _write_atomic(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


def ray_tls_env(directory: str | Path, host: str) -> dict[str, str]:
    """The environment that turns Ray's mutual TLS on for ``host``'s Ray processes.

    It must be in ``os.environ`` *before* ``ray start``/``ray.init`` (and in any
    driver's environment): Ray reads it once per process, and every process of
    the cluster, drivers included, must use TLS or none may.
    """
    files = host_files(directory, host)
    for p in (files.cert, files.key, files.ca_cert):
        if not p.is_file():
            raise TlsError(f"missing {p} (issue it with `crabctl cluster cert {host} --dir {Path(directory)}`)")
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(files.cert.resolve()),
        "RAY_TLS_SERVER_KEY": str(files.key.resolve()),
        "RAY_TLS_CA_CERT": str(files.ca_cert.resolve()),
    }
