"""The cluster CA and host certificates (crabd.cluster.tls), without Ray."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import DNSName, IPAddress
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from crabd.cluster import tls


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def load(p: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(p.read_bytes())


def test_ca_and_host_cert_chain(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    ca_path = tls.init_ca(d)
    files = tls.issue_host_cert(d, "host-b", ips=["10.1.2.3", "::1"], dns_names=["b.example"])
    ca, cert = load(ca_path), load(files.cert)

    # Self-signed CA, and the host cert verifies against it (signature, issuer, validity).
    ca.verify_directly_issued_by(ca)
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["host-b", "localhost", "b.example"]
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(a) for a in ("127.0.0.1", "10.1.2.3", "::1")
    }
    # Full path validation (RFC 5280 profile) as a TLS peer would do it, as server and as client.
    store = Store([ca])
    PolicyBuilder().store(store).build_server_verifier(IPAddress(ipaddress.ip_address("10.1.2.3"))).verify(cert, [])
    PolicyBuilder().store(store).build_server_verifier(DNSName("host-b")).verify(cert, [])
    PolicyBuilder().store(store).build_client_verifier().verify(cert, [])
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    # The key on disk belongs to the certificate.
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key() == cert.public_key()

    # Keys 0600, certs 0644, directory 0700; no temp files left behind.
    assert mode(d / tls.CA_KEY) == mode(files.key) == 0o600
    assert mode(ca_path) == mode(files.cert) == 0o644
    assert mode(d) == 0o700
    assert sorted(p.name for p in d.iterdir()) == ["ca.crt", "ca.key", "host-b.crt", "host-b.key"]


def test_cert_from_another_ca_does_not_verify(tmp_path: Path) -> None:
    tls.init_ca(tmp_path / "one")
    tls.init_ca(tmp_path / "two")
    rogue = tls.issue_host_cert(tmp_path / "two", "a")
    with pytest.raises(InvalidSignature):
        load(rogue.cert).verify_directly_issued_by(load(tmp_path / "one" / tls.CA_CERT))
    verifier = PolicyBuilder().store(Store([load(tmp_path / "one" / tls.CA_CERT)])).build_server_verifier(DNSName("a"))
    with pytest.raises(VerificationError):
        verifier.verify(load(rogue.cert), [])


def test_ca_is_not_replaced_unless_forced(tmp_path: Path) -> None:
    first = tls.init_ca(tmp_path).read_bytes()
    with pytest.raises(tls.TlsError, match="already exists"):
        tls.init_ca(tmp_path)
    assert (tmp_path / tls.CA_CERT).read_bytes() == first
    assert tls.init_ca(tmp_path, force=True).read_bytes() != first


def test_reissue_replaces_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tls.init_ca(tmp_path)
    old = tls.issue_host_cert(tmp_path, "a")
    old_key = old.key.read_bytes()
    inode = old.key.stat().st_ino
    # A failure while writing leaves the old key whole and no temp file.
    real_fsync = os.fsync

    def boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        tls.issue_host_cert(tmp_path, "a")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert old.key.read_bytes() == old_key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.crt", "a.key", "ca.crt", "ca.key"]
    # A successful re-issue is a new file (rename), not a rewrite in place.
    new = tls.issue_host_cert(tmp_path, "a")
    assert new.key.stat().st_ino != inode
    assert new.key.read_bytes() != old_key
    assert mode(new.key) == 0o600


def test_errors_and_ray_env(tmp_path: Path) -> None:
    with pytest.raises(tls.TlsError, match="no cluster CA"):
        tls.issue_host_cert(tmp_path, "a")
    tls.init_ca(tmp_path)
    with pytest.raises(tls.TlsError, match="invalid host id"):
        tls.issue_host_cert(tmp_path, "../etc")
    with pytest.raises(tls.TlsError, match="bad IP"):
        tls.issue_host_cert(tmp_path, "a", ips=["not-an-ip"])
    with pytest.raises(tls.TlsError, match="missing"):
        tls.ray_tls_env(tmp_path, "a")
    files = tls.issue_host_cert(tmp_path, "a")
    assert tls.ray_tls_env(tmp_path, "a") == {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(files.cert.resolve()),
        "RAY_TLS_SERVER_KEY": str(files.key.resolve()),
        "RAY_TLS_CA_CERT": str(files.ca_cert.resolve()),
    }


def test_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from crabd.cluster.cli import cluster

    runner = CliRunner()
    d = str(tmp_path / "c")
    r = runner.invoke(cluster, ["ca", "init", "--dir", d])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cluster, ["cert", "h1", "--dir", d, "--ip", "10.0.0.9"])
    assert r.exit_code == 0, r.output
    assert "RAY_USE_TLS=1" in r.output
    assert mode(tmp_path / "c" / "h1.key") == 0o600
    r = runner.invoke(cluster, ["ca", "init", "--dir", d])
    assert r.exit_code == 1
