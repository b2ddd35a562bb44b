"""Transport security for every Baton port: the TLS files a process is given, the gRPC credentials and
SSL contexts made from them, and a development CA for ``baton up --tls``.

A process gets one directory (``--tls-dir``) laid out as a Kubernetes TLS Secret mounts it:
``tls.crt`` (its certificate chain), ``tls.key`` (its private key) and ``ca.crt`` (the CA that signs
the cluster's certificates). With it, every internal gRPC port (scheduler, workers) is mutual TLS: a
client must show a certificate of that CA, and every internal client shows its own and checks the
server's against that CA. The gateway's public ports (gRPC and HTTPS) use the same certificate but ask
no certificate of their clients, who authenticate with API keys instead (`services.gateway.auth`).
Without ``--tls-dir`` everything is plaintext, as on a developer's machine.

A server's certificate must name the address its clients dial (an IP or DNS subject alternative
name); where it cannot (pod IPs that change), ``--tls-server-name`` makes clients check for that name
instead.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rpc.liveness import CLIENT_OPTIONS

CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"
Options = Sequence[tuple[str, int | str]]


@dataclass(frozen=True, slots=True)
class Tls:
    """One process's TLS identity and trust: the files of its ``--tls-dir``, read once."""

    cert: bytes
    key: bytes
    ca: bytes
    directory: Path
    server_name: str | None = None  # clients check for this name instead of the dialled host

    @classmethod
    def load(cls, directory: str | Path, server_name: str | None = None) -> Tls:
        """Reads ``tls.crt``, ``tls.key`` and ``ca.crt`` from ``directory``; a missing or empty one is a
        clear error naming it."""
        path = Path(directory)
        data = {}
        for name in (CERT, KEY, CA):
            try:
                data[name] = (path / name).read_bytes()
            except OSError as e:
                raise ValueError(f"--tls-dir {path}: cannot read {name}: {e.strerror}") from None
            if b"-----BEGIN" not in data[name]:
                raise ValueError(f"--tls-dir {path}: {name} is not PEM")
        return cls(data[CERT], data[KEY], data[CA], path, server_name or None)

    @property
    def _name_option(self) -> Options:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        """Credentials of a gRPC port: mutual TLS (internal ports) or server-only TLS (the gateway's)."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=require_client_cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of an internal client: it checks the server against the CA and shows its own."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def server_context(self) -> ssl.SSLContext:
        """An SSL context of an HTTPS port (the gateway's): TLS 1.2 or later, no client certificate."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.directory / CERT, self.directory / KEY)
        return context


def add_port(server: grpc.aio.Server, address: str, tls: Tls | None, mutual: bool = True) -> int:
    """Binds ``server`` to ``address`` in plaintext (no ``tls``) or TLS, mutual unless ``mutual`` is
    False; returns the port (0 when it could not bind)."""
    if tls is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, tls.server_credentials(mutual)))


def target(address: str) -> tuple[str, Options]:
    """The gRPC target of ``address`` — one ``host:port``, or several IP ``host:port``s separated by
    commas (replicas of one service, e.g. the scheduler's: the channel uses the first that answers and
    moves on when it fails) — and the options that dialling them needs."""
    if "," not in address:
        return address, ()
    hosts = [a.strip().rpartition(":")[0].strip("[]") for a in address.split(",")]
    try:
        family = {ipaddress.ip_address(h).version for h in hosts}
    except ValueError:
        raise ValueError(f"several addresses must be IP host:port pairs, got {address!r}") from None
    if len(family) != 1:
        raise ValueError(f"several addresses must be all IPv4 or all IPv6, got {address!r}")
    scheme = "ipv4" if family == {4} else "ipv6"
    # A certificate is checked for the first host (or --tls-server-name): the replicas share one.
    return f"{scheme}:{address.replace(' ', '')}", (("grpc.ssl_target_name_override", hosts[0]),)


def _dial(address: str, tls: Tls | None, options: Options) -> tuple[str, list[tuple[str, int | str]]]:
    dialled, names = target(address)
    given = {name for name, _ in options}  # a hung or cut-off peer is noticed (rpc.liveness)
    options = [*(o for o in CLIENT_OPTIONS if o[0] not in given), *options]
    if tls is None:
        return dialled, options
    return dialled, [*options, *(tls._name_option or names)]


def channel(address: str, tls: Tls | None, options: Options = ()) -> grpc.aio.Channel:
    """An asyncio channel to an internal server (or its replicas, `target`): plaintext, or mutual TLS
    with this process's identity."""
    dialled, opts = _dial(address, tls, options)
    if tls is None:
        return grpc.aio.insecure_channel(dialled, options=opts)
    return grpc.aio.secure_channel(dialled, tls.channel_credentials(), options=opts)


def sync_channel(address: str, tls: Tls | None, options: Options = ()) -> grpc.Channel:
    """The same as a blocking channel (health probes of `baton up`'s supervisor, the admin CLI)."""
    dialled, opts = _dial(address, tls, options)
    if tls is None:
        return grpc.insecure_channel(dialled, options=opts)
    return grpc.secure_channel(dialled, tls.channel_credentials(), options=opts)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The ``--tls-dir`` and ``--tls-server-name`` flags of every serving process (`rpc.flags` nests it)."""

    tls_dir: str | None = field(
        default=None,
        metadata={
            "help": "directory with tls.crt, tls.key and ca.crt (a Kubernetes TLS Secret): mutual TLS on "
            "internal ports and channels, TLS on the gateway's (default: plaintext)"
        },
    )
    tls_server_name: str | None = field(
        default=None,
        metadata={"help": "the name clients check servers' certificates for (default: the address dialled)"},
    )

    def load(self) -> Tls | None:
        """The files read, or None (plaintext) without a ``tls_dir``."""
        return Tls.load(self.tls_dir, self.tls_server_name) if self.tls_dir else None


def make_dev_ca(directory: str | Path, hosts: Sequence[str] = ("localhost", "127.0.0.1")) -> Path:
    """Writes a development CA and one certificate it signs for ``hosts`` (DNS names or IPs) into
    ``directory`` (``ca.crt``, ``tls.crt``, ``tls.key``; the CA's key is not kept), for ``baton up
    --tls`` and the tests. Every process of a local cluster uses that one certificate, as server and as
    client. Never for production: use your own CA (cert-manager in the chart)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "baton development CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "baton")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (out / CA).write_bytes(ca.public_bytes(pem))
    (out / CERT).write_bytes(cert.public_bytes(pem))
    key_file = out / KEY
    key_file.touch(mode=0o600)
    key_file.chmod(0o600)
    key_file.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return out
