"""`pdserve up --tls-cert --tls-key`: Serve's HTTP proxy serves HTTPS only. A client that trusts
the certificate gets answers; one that does not is refused by its own TLS check; plain HTTP on
the port gets no answer. (gRPC stays plaintext: Serve's gRPC proxy takes no credentials.) The
cheapest app that serves: the tiny model, colocated."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local import free_port
from tests.readme.cli import fresh_env, pdserve

pytestmark = pytest.mark.engine


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, object]]]:
    home = tmp_path_factory.mktemp("home")
    env = fresh_env(home)
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"))
    http_port, grpc_port = free_port(), free_port()
    up = pdserve(
        env,
        "up",
        *("--model", "tiny", "--topology", "colocated"),
        *("--tls-cert", str(cert), "--tls-key", str(key)),
        *("--http-port", str(http_port), "--grpc-port", str(grpc_port)),
        timeout=900,
    )
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"https://127.0.0.1:{http_port}/v1" in up.stdout
        state = json.loads((home / ".cache" / "pdserve" / "run" / "local.json").read_text())
        yield cert, state
    finally:
        pdserve(env, "down", timeout=180)


def _complete(url: str, key: str, context: ssl.SSLContext | None) -> tuple[int, dict[str, object]]:
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=120, context=context) as response:
        return response.status, json.loads(response.read())


def test_https_with_the_certificate_answers_and_nothing_else_does(
    tls_run: tuple[Path, dict[str, object]],
) -> None:
    cert, state = tls_run
    key, port = str(state["api_key"]), state["http_port"]
    trusting = ssl.create_default_context(cafile=str(cert))
    status, payload = _complete(f"https://127.0.0.1:{port}", key, trusting)
    assert status == 200, payload
    assert payload["usage"]["completion_tokens"] == 2  # type: ignore[index]

    with pytest.raises(urllib.error.URLError) as untrusted:
        _complete(f"https://127.0.0.1:{port}", key, ssl.create_default_context())
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError), untrusted.value

    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)) as plain:
        _complete(f"http://127.0.0.1:{port}", key, None)
    assert not isinstance(plain.value, urllib.error.HTTPError), plain.value  # no HTTP answer


def test_up_names_a_missing_or_non_pem_tls_file(tmp_path: Path) -> None:
    env = fresh_env(tmp_path)
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    for args, named in (
        (("--tls-cert", str(tmp_path / "absent.pem"), "--tls-key", str(not_pem)), "--tls-cert"),
        (("--tls-cert", str(not_pem), "--tls-key", str(not_pem)), "not a PEM file"),
        (("--tls-cert", str(not_pem)), "go together"),
    ):
        refused = pdserve(env, "up", *args, timeout=120)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert named in refused.stderr, refused.stderr
        assert not (tmp_path / ".cache" / "pdserve" / "run" / "local.json").exists()
