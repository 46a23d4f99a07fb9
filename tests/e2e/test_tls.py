"""TLS and mutual TLS over real sockets, with a CA, server and client certificates made here with `cryptography`."""

import datetime
import ipaddress
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from serving import free_port, wait_serving

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.cli.main import main
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import NamespaceSpec, ServiceConfig
from engine_client.client import DrafterClient
from engine_client.security import ClientSecurity

VOCAB = 1000
TOKEN = secrets.token_hex(16)
DRAFTER = str(Path(sys.executable).parent / "drafter")


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(folder: Path, common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    (folder / f"{common}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def issue(folder: Path, ca: tuple, common: str, server: bool) -> tuple[str, str]:
    """A certificate signed by ``ca``; returns (certificate file, key file)."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = folder / f"{common}.crt", folder / f"{common}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca, rogue = make_ca(folder, "drafter-ca"), make_ca(folder, "rogue-ca")
    return {"folder": folder, "ca": str(folder / "drafter-ca.pem"), "rogue_ca": str(folder / "rogue-ca.pem"),
            "server": issue(folder, ca, "server", True), "client": issue(folder, ca, "client", False),
            "rogue_client": issue(folder, rogue, "rogue-client", False),
            "rogue_server": issue(folder, rogue, "rogue-server", True)}


def serve(pki, client_ca="", **extra):
    cert, key = pki["server"]
    cfg = ServiceConfig(address="127.0.0.1:0", http_address="", default_vocab_size=VOCAB, tls_cert=cert,
                        tls_key=key, tls_client_ca=client_ca, drafter=DrafterConfig(capacity=1 << 12), **extra)
    server, port = create_server(cfg, "127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


def stats_code(address, security):
    """Status of a GetStats call made with ``security`` ("OK" when it answers)."""
    try:
        with security.channel(address) as channel:
            pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(), timeout=5)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def test_tls_without_client_certificates(pki):
    server, address = serve(pki)
    try:
        assert stats_code(address, ClientSecurity(root_ca=pki["ca"])) == "OK"
        client_cert, client_key = pki["client"]  # a certificate nobody asked for does no harm
        assert stats_code(address, ClientSecurity(root_ca=pki["ca"], client_cert=client_cert,
                                                  client_key=client_key)) == "OK"
        assert stats_code(address, ClientSecurity(root_ca=pki["rogue_ca"])) == "UNAVAILABLE"  # untrusted server
        assert stats_code(address, ClientSecurity()) == "UNAVAILABLE"  # plaintext cannot talk to TLS
        assert stats_code(f"localhost:{address.rpartition(':')[2]}", ClientSecurity(root_ca=pki["ca"])) == "OK"
        assert stats_code(address, ClientSecurity(root_ca=pki["ca"], server_name="elsewhere.example")) == \
            "UNAVAILABLE"  # the certificate does not name that host
    finally:
        server.stop(0)


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(pki):
    server, address = serve(pki, client_ca=pki["ca"])
    try:
        cert, key = pki["client"]
        rogue_cert, rogue_key = pki["rogue_client"]
        assert stats_code(address, ClientSecurity(root_ca=pki["ca"], client_cert=cert, client_key=key)) == "OK"
        assert stats_code(address, ClientSecurity(root_ca=pki["ca"])) == "UNAVAILABLE"
        assert stats_code(address, ClientSecurity(root_ca=pki["ca"], client_cert=rogue_cert,
                                                  client_key=rogue_key)) == "UNAVAILABLE"
        assert stats_code(address, ClientSecurity()) == "UNAVAILABLE"
    finally:
        server.stop(0)


def test_tls_and_tokens_together_through_the_client(pki):
    server, address = serve(pki, client_ca=pki["ca"], namespaces=(NamespaceSpec("alpha", VOCAB),),
                            namespace_tokens=(("alpha", TOKEN),))
    cert, key = pki["client"]
    secure = ClientSecurity(root_ca=pki["ca"], client_cert=cert, client_key=key)
    try:
        with DrafterClient(address, namespace="alpha", security=ClientSecurity(
                token=TOKEN, root_ca=pki["ca"], client_cert=cert, client_key=key)) as client:
            sid = client.start([1, 2, 3])
            client.draft(sid, [])
            client.end(sid, [4])
            assert client.stats()["stored_requests"] == 1
        with secure.channel(address) as channel:  # the certificate alone grants no namespace
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(namespace="alpha"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_bad_tls_files_stop_the_start_with_a_clear_error(pki, tmp_path):
    cert, key = pki["server"]
    _, other_key = pki["rogue_server"]
    (tmp_path / "junk.pem").write_text("not a certificate")
    cases = [(dict(tls_cert=cert, tls_key=other_key), "not a usable pair"),
             (dict(tls_cert=str(tmp_path / "missing.pem"), tls_key=key), "cannot read TLS certificate"),
             (dict(tls_cert=cert, tls_key=key, tls_client_ca=str(tmp_path / "junk.pem")), "not a PEM file")]
    for fields, message in cases:
        with pytest.raises(OSError, match=message):
            create_server(ServiceConfig(address="127.0.0.1:0", http_address="", **fields), "127.0.0.1:0")
    with pytest.raises(ValueError, match="go together"):
        ClientSecurity(client_cert=cert)
    with pytest.raises(SystemExit, match="cannot read the root CA"):
        main(["stats", "--tls-root-ca", str(tmp_path / "missing.pem")])


def test_drafter_serve_and_the_cli_with_mutual_tls_and_a_token_file(pki, tmp_path, capsys):
    cert, key = pki["server"]
    client_cert, client_key = pki["client"]
    (tmp_path / "alpha.token").write_text(TOKEN + "\n")
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "DRAFTER_NAMESPACE_TOKENS": f"alpha=@{tmp_path / 'alpha.token'}",
           "DRAFTER_TLS_CLIENT_CA": pki["ca"]}
    proc = subprocess.Popen([DRAFTER, "serve", "--address", address, "--data-dir", str(tmp_path / "data"),
                             "--http-address", "", "--vocab-size", str(VOCAB), "--capacity", "100000",
                             "--namespaces", f"alpha={VOCAB}", "--tls-cert", cert, "--tls-key", key],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        tls = ["--address", address, "--tls-root-ca", pki["ca"], "--tls-client-cert", client_cert,
               "--tls-client-key", client_key]
        security = ClientSecurity(root_ca=pki["ca"], client_cert=client_cert, client_key=client_key)
        wait_serving(address, proc=proc, channel=security.channel)
        assert main(["stats", *tls, "--namespace", "alpha", "--token", f"@{tmp_path / 'alpha.token'}"]) == 0
        assert json.loads(capsys.readouterr().out)["namespace"] == "alpha"
        with pytest.raises(SystemExit, match="UNAUTHENTICATED"):
            main(["stats", *tls, "--namespace", "alpha"])
        with pytest.raises(SystemExit, match="UNAVAILABLE"):  # no client certificate: no connection at all
            main(["stats", "--address", address, "--tls-root-ca", pki["ca"], "--namespace", "alpha", "--token",
                  TOKEN])
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert TOKEN not in out  # the token is never logged
