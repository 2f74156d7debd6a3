"""Throwaway TLS material for tests: a CA, a server certificate it signs for
127.0.0.1/localhost, and an unrelated second CA. Made with the `openssl` command
line tool (present wherever Python's ssl module is built against OpenSSL);
EC P-256 keys, so it takes milliseconds."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    ca: str  # the CA that signed `cert`
    cert: str  # server certificate, SAN IP:127.0.0.1, DNS:localhost
    key: str
    other_ca: str  # a CA that signed nothing here
    self_signed_cert: str  # a server certificate that is its own issuer (for a "wrong certificate" daemon)
    self_signed_key: str


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _key(name: str, d: pathlib.Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name, cwd=d)


def _ca(name: str, d: pathlib.Path) -> None:
    _key(f"{name}.key", d)
    _openssl("req", "-x509", "-new", "-key", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj",
             f"/CN=test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_tls_files(d: pathlib.Path) -> TlsFiles:
    if shutil.which("openssl") is None:
        import pytest
        pytest.skip("the openssl command line tool is needed to make test certificates")
    d.mkdir(parents=True, exist_ok=True)
    _ca("ca", d)
    _ca("other-ca", d)
    _key("server.key", d)
    _openssl("req", "-new", "-key", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "server.ext").write_text("basicConstraints=critical,CA:FALSE\n"
                                  "keyUsage=critical,digitalSignature,keyEncipherment\n"
                                  "extendedKeyUsage=serverAuth\n"
                                  "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext", cwd=d)
    _key("rogue.key", d)
    _openssl("req", "-x509", "-new", "-key", "rogue.key", "-out", "rogue.pem", "-days", "2", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", cwd=d)
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return TlsFiles(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"), str(d / "other-ca.pem"),
                    str(d / "rogue.pem"), str(d / "rogue.key"))
