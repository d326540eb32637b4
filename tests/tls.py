"""A private TLS-only Redis server, with a throwaway CA, for the TLS tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from keyserial.testing import find_server_binary, free_port


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


class TlsUnsupported(Exception):
    """The server binary was built without TLS."""


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    if shutil.which("openssl") is None:
        raise TlsUnsupported("the openssl command is not installed")
    ca_key, ca = directory / "ca.key", directory / "ca.crt"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=keyserial test CA",
        "-keyout",
        ca_key,
        "-out",
        ca,
    )
    files = {}
    for name, extension in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        key, request, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        extensions = directory / f"{name}.ext"
        extensions.write_text(extension + "\n")
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN=keyserial {name}",
            "-keyout",
            key,
            "-out",
            request,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            request,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            extensions,
            "-out",
            cert,
        )
        files[name] = (cert, key)
    return Certificates(ca, *files["server"], *files["client"])


class TlsServer:
    """``redis-server`` listening on a TLS port only (``--port 0``), requiring client
    certificates (the default ``tls-auth-clients yes``)."""

    def __init__(self, directory: Path, certificates: Certificates) -> None:
        self.directory = directory
        self.certificates = certificates
        self.port = free_port()
        self.log_path = directory / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        c = self.certificates
        return (
            f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={c.ca}"
            f"&ssl_certfile={c.client_cert}&ssl_keyfile={c.client_key}"
            "&ssl_cert_reqs=required"
        )

    def start(self) -> None:
        c = self.certificates
        self.process = subprocess.Popen(
            [
                find_server_binary(),
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                str(c.server_cert),
                "--tls-key-file",
                str(c.server_key),
                "--tls-ca-cert-file",
                str(c.ca),
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                str(self.log_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        try:
            while True:
                if self.process.poll() is not None:
                    output = self.process.stderr.read().decode() if self.process.stderr else ""
                    log = self.log_path.read_text() if self.log_path.exists() else ""
                    if "tls" in (output + log).lower():
                        raise TlsUnsupported(f"{find_server_binary()} has no TLS: {output}{log}")
                    raise RuntimeError(f"the TLS server exited: {output}{log}")
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.TimeoutError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
