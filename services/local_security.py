"""What `baton up --tls --require-api-key` prepares in the log directory before any process starts: a
development CA and the certificate every process uses (``tls/``), and one API key of the default
tenant — its SHA-256 in ``api-keys`` (the scheduler's ``--api-keys-file``), the key itself in
``api-key`` (mode 0600) for the operator, printed once in the banner. Either flag also gives Redis a
password (``redis.conf``, mode 0600; the processes get it in their Redis URL)."""

from __future__ import annotations

import functools
import hashlib
import secrets
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rpc.tls import CA, Tls, TlsConfig, make_dev_ca
from services.supervisor import is_serving, redis_ping

DEFAULT_TENANT = "default"  # the scheduler's default tenant: the local cluster's one team


def _private(path: Path, text: str) -> Path:
    """``text`` in a file only its owner may read."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)
    return path


@dataclass(frozen=True, slots=True)
class LocalSecurity:
    config: TlsConfig  # the children's --tls-dir (empty: plaintext)
    tls: Tls | None
    keys_file: str | None  # the scheduler's --api-keys-file
    api_key: str | None
    redis_password: str | None = None
    redis_conf: Path | None = None  # the redis-server config file that sets it

    @classmethod
    def prepare(cls, log_dir: Path, host: str, tls: bool, require_api_key: bool) -> LocalSecurity:
        config, files = TlsConfig(), None
        if tls:
            tls_dir = make_dev_ca(log_dir / "tls", (host, "localhost", "127.0.0.1"))
            config = TlsConfig(str(tls_dir))
            files = config.load()
        keys_file = api_key = None
        if require_api_key:
            api_key = "sk-baton-" + secrets.token_urlsafe(32)
            key_path = _private(log_dir / "api-key", api_key + "\n")
            keys = log_dir / "api-keys"
            digest = hashlib.sha256(api_key.encode()).hexdigest()
            keys.write_text(f"# tenant  sha256(key): the key is in {key_path}\n{DEFAULT_TENANT} {digest}\n")
            keys_file = str(keys)
        password = conf = None
        if tls or require_api_key:
            password = secrets.token_urlsafe(24)
            conf = _private(log_dir / "redis.conf", f"requirepass {password}\n")
        return cls(config, files, keys_file, api_key, password, conf)

    def redis_url(self, host: str, port: int) -> str:
        auth = f":{self.redis_password}@" if self.redis_password else ""
        return f"redis://{auth}{host}:{port}/0"

    @property
    def redis_probe(self) -> Callable[[str], bool]:
        return functools.partial(redis_ping, password=self.redis_password)

    @property
    def probe(self) -> Callable[[str], bool] | None:
        """The children's health check: over mutual TLS with the cluster's certificate, if it has one."""
        return functools.partial(is_serving, tls=self.tls) if self.tls else None

    @property
    def ca_file(self) -> Path | None:
        return self.tls.directory / CA if self.tls else None

    def client_context(self) -> ssl.SSLContext | None:
        """An SSL context of an HTTPS client of the gateway: it trusts the development CA."""
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else None

    def curl_flags(self) -> str:
        """What a curl of the banner needs beyond the URL: the CA and the key."""
        flags = f" --cacert {self.ca_file}" if self.ca_file else ""
        return flags + (f" -H 'Authorization: Bearer {self.api_key}'" if self.api_key else "")
