"""Who may call: API keys sent as `authorization: Bearer <key>`, and the TLS credentials of a port.

Secrets never live in the deploy file: it names an environment variable or a file that holds them.
Keys are compared with `hmac.compare_digest`, against every configured key, so timing tells nothing.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from omnistage.common.config import ServiceConfig

AUTHORIZATION = "authorization"


class SecretError(ValueError):
    """A key or certificate the deploy file names cannot be read; the message names the key path."""


@dataclass(frozen=True)
class ApiKeys:
    """The keys one port accepts, and where they came from (for messages, never the keys)."""

    keys: tuple[bytes, ...]
    source: str

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """'' when `metadata` carries `authorization: Bearer <one of the keys>`; else why not."""
        value = next((v for k, v in (metadata or ()) if k.lower() == AUTHORIZATION), None)
        if value is None:
            return "missing credentials: send the metadata 'authorization: Bearer <key>'"
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "malformed credentials: the 'authorization' metadata must be 'Bearer <key>'"
        sent = token.strip().encode("utf-8", "surrogateescape")
        matched = False
        for key in self.keys:  # no early exit: every key is compared
            matched |= hmac.compare_digest(sent, key)
        return "" if matched else "invalid API key"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents `key`."""
    return ((AUTHORIZATION, f"Bearer {key}"),)


def _split_keys(text: str, sep: str | None) -> list[str]:
    lines = text.split(sep) if sep else text.splitlines()
    return [k.strip() for k in lines if k.strip() and not k.strip().startswith("#")]


def _env_keys(var: str, key_path: str, environ: Mapping[str, str]) -> list[str]:
    keys = _split_keys(environ.get(var, ""), ",")
    if not keys:
        raise SecretError(f"{key_path}: environment variable {var} is not set or holds no key")
    return keys


def _file_keys(path: str, key_path: str) -> list[str]:
    try:
        keys = _split_keys(Path(path).read_text(), None)
    except OSError as exc:
        raise SecretError(f"{key_path}: cannot read {path}: {exc.strerror or exc}") from exc
    if not keys:
        raise SecretError(f"{key_path}: {path} holds no key (one key per line)")
    return keys


def api_keys(svc: ServiceConfig, environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
    """The keys of the service's public API (api_keys_env and api_keys_file together), or None."""
    p = f"services.{svc.name}"
    keys: list[str] = []
    sources = []
    if svc.api_keys_env:
        keys += _env_keys(svc.api_keys_env, f"{p}.api_keys_env", environ)
        sources.append(f"{p}.api_keys_env")
    if svc.api_keys_file:
        keys += _file_keys(svc.api_keys_file, f"{p}.api_keys_file")
        sources.append(f"{p}.api_keys_file")
    return ApiKeys(tuple(k.encode() for k in keys), " + ".join(sources)) if keys else None


def admin_keys(svc: ServiceConfig, environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
    """The key of the service's admin port (Control), or None when it needs none."""
    if not svc.admin_api_key_env:
        return None
    key_path = f"services.{svc.name}.admin_api_key_env"
    return ApiKeys(tuple(k.encode() for k in _env_keys(svc.admin_api_key_env, key_path, environ)), key_path)


def admin_metadata(svc: ServiceConfig, environ: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """What a client of the service's Control API sends (launcher, CLI, gateway): the key, if any."""
    keys = admin_keys(svc, environ)
    return bearer(keys.keys[0].decode()) if keys else ()


def client_metadata(svc: ServiceConfig, environ: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """What a client of the service's public API sends: its first API key, if it has any."""
    keys = api_keys(svc, environ)
    return bearer(keys.keys[0].decode()) if keys else ()


def _read(path: str, key_path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecretError(f"{key_path}: cannot read {path}: {exc.strerror or exc}") from exc


def server_credentials(svc: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the service's main port (mutual TLS with client_ca_file), or None for plaintext."""
    tls = svc.tls
    if tls is None:
        return None
    p = f"services.{svc.name}.tls"
    pair = (_read(tls.key_file, f"{p}.key_file"), _read(tls.cert_file, f"{p}.cert_file"))
    ca = _read(tls.client_ca_file, f"{p}.client_ca_file") if tls.client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(
    svc: ServiceConfig, ca_file: str = "", cert_file: str = "", key_file: str = ""
) -> grpc.ChannelCredentials | None:
    """Credentials of a client of the service's main port, or None when it is plaintext.

    The server's own certificate is trusted unless `ca_file` names the CA to trust (a self-signed
    certificate is its own CA); `cert_file` / `key_file` are the client's pair for mutual TLS.
    """
    if svc.tls is None:
        return None
    root = _read(ca_file, "--ca-file") if ca_file else _read(svc.tls.cert_file, f"services.{svc.name}.tls.cert_file")
    key = _read(key_file, "--key-file") if key_file else None
    chain = _read(cert_file, "--cert-file") if cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)


def check_secrets(svc: ServiceConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every secret the service needs, read once: the problems (for `serve` before anything starts)."""
    problems = []
    for load in (lambda: api_keys(svc, environ), lambda: admin_keys(svc, environ), lambda: server_credentials(svc)):
        try:
            load()
        except SecretError as exc:
            problems.append(str(exc))
    return problems
