"""Who may call: API keys sent as `authorization: Bearer <key>`, and the TLS credentials of a port."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from omnistage.common.config import ServiceConfig

AUTHORIZATION = "authorization"
STAGE_KEY_ENV = "OMNISTAGE_STAGE_KEY"
# $OMNISTAGE_STAGE_KEY=off: no stage key (tests that call stages directly; never for a deployment).
STAGE_KEY_OFF = "off"


class SecretError(ValueError):
    """A key or certificate the deploy file names cannot be read; the message names the key path."""


# How a caller sends a key: gRPC metadata, or the HTTP header of the OpenAI front (same name).
_SEND_AS = "'authorization: Bearer <key>' (gRPC metadata; over HTTP the header 'Authorization: Bearer <key>')"
# What a refusal says of the stage key: its variable, and how its owner gets the running one.
STAGE_KEY_HINT = f"${STAGE_KEY_ENV}; `omnistage stage-key` prints the running deployment's to its owner"


@dataclass(frozen=True)
class ApiKeys:
    """The keys one port accepts, and where they came from (for messages, never the keys).

    `expects` names the credential for a caller refused (`the admin key (services.x.admin_api_key_env)`),
    so a refusal says which one the port takes without echoing any."""

    keys: tuple[bytes, ...]
    source: str
    expects: str = ""

    @property
    def wanted(self) -> str:
        return self.expects or f"the API key ({self.source})"

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """'' when `metadata` carries `authorization: Bearer <one of the keys>`; else why not."""
        value = next((v for k, v in (metadata or ()) if k.lower() == AUTHORIZATION), None)
        if value is None:
            return f"missing credentials: this port takes {self.wanted}, sent as {_SEND_AS}"
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return f"malformed credentials: send {self.wanted} as {_SEND_AS}"
        sent = token.strip().encode("utf-8", "surrogateescape")
        matched = False
        for key in self.keys:  # no early exit: every key is compared
            matched |= hmac.compare_digest(sent, key)
        return "" if matched else f"invalid key: this port takes {self.wanted}"


def stage_key(environ: Mapping[str, str] = os.environ) -> str:
    """The deployment's stage key ('' when none is set, or `off`: stages then take any caller)."""
    key = environ.get(STAGE_KEY_ENV, "").strip()
    return "" if key == STAGE_KEY_OFF else key


def new_stage_key(environ: Mapping[str, str] = os.environ) -> str:
    """The stage key `serve` gives its processes: the one in its environment (`off` too), else a fresh one."""
    return environ.get(STAGE_KEY_ENV, "").strip() or secrets.token_urlsafe(32)


def with_stage_key(
    keys: ApiKeys | None, svc: ServiceConfig, environ: Mapping[str, str] = os.environ
) -> ApiKeys | None:
    """`keys` plus the stage key, for a port of a stage (not the gateway) when the deployment has one."""
    key = stage_key(environ)
    if not key or svc.kind == "gateway":
        return keys
    stage = f"the stage key ({STAGE_KEY_HINT})"
    if keys is None:
        return ApiKeys((key.encode(),), STAGE_KEY_ENV, stage)
    return ApiKeys(
        (*keys.keys, key.encode()), f"{keys.source} + {STAGE_KEY_ENV}", f"{keys.wanted} or {stage}"
    )


def user_dir() -> Path:
    """This user's directory of what a running `serve` leaves for the CLI (stage keys, the run record)."""
    return Path(tempfile.gettempdir()) / f"omnistage-{os.getuid()}"


def stage_key_path(cfg_path: str | Path) -> Path:
    """Where `serve` of `cfg_path` leaves its stage key for this user's CLI."""
    digest = hashlib.sha256(str(Path(cfg_path).resolve()).encode()).hexdigest()[:16]
    return user_dir() / f"stage-key-{digest}"


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user's only (made 0700 if missing); SecretError if it is not."""
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid() or path.stat().st_mode & 0o077:
        raise SecretError(f"{path}: not a private directory of this user; nothing secret is written there")
    return path


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path` readable by this user only (0600, replaced atomically), in a directory
    that must be this user's and private (0700; created so)."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def publish_stage_key(cfg_path: str | Path, key: str) -> Path:
    """Write `key` for the CLI (readable by this user only); the path, to `withdraw_stage_key` later."""
    return write_private(stage_key_path(cfg_path), key)


def published_stage_key(cfg_path: str | Path) -> str:
    """The key a running `serve` of `cfg_path` left for this user ('' when there is none)."""
    path = stage_key_path(cfg_path)
    with contextlib.suppress(OSError):
        if path.stat().st_uid == os.getuid():
            return path.read_text().strip()
    return ""


def withdraw_stage_key(path: Path, key: str) -> None:
    """Remove the key file `publish_stage_key` wrote, unless another run has replaced it since."""
    with contextlib.suppress(OSError):
        if path.read_text() == key:
            path.unlink()


def adopt_stage_key(cfg_path: str | Path, environ: dict[str, str] = os.environ) -> None:  # type: ignore[assignment]
    """For the CLI: without $OMNISTAGE_STAGE_KEY, take the key a running `serve` of `cfg_path` left."""
    if environ.get(STAGE_KEY_ENV, "").strip():
        return
    key = published_stage_key(cfg_path)
    if key:
        environ[STAGE_KEY_ENV] = key


class _PresentKey:
    """Adds `authorization: Bearer <key>` to a call (the stage key, or a client's API key; grpc.aio takes one
    interceptor per call kind)."""

    def __init__(self, key: str) -> None:
        self.pair = (AUTHORIZATION, f"Bearer {key}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if AUTHORIZATION not in metadata:
            metadata.add(*self.pair)
        return details._replace(metadata=metadata)


def _interceptor(base: type, method: str) -> type:
    """A `base` interceptor whose `method` presents the key (each call kind has its own base class)."""

    async def intercept(self: _PresentKey, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    return type(f"PresentKey{base.__name__}", (_PresentKey, base), {method: intercept})


_INTERCEPTORS = [
    _interceptor(base, f"intercept_{kind}")
    for base, kind in (
        (grpc.aio.UnaryUnaryClientInterceptor, "unary_unary"),
        (grpc.aio.UnaryStreamClientInterceptor, "unary_stream"),
        (grpc.aio.StreamUnaryClientInterceptor, "stream_unary"),
        (grpc.aio.StreamStreamClientInterceptor, "stream_stream"),
    )
]


def key_interceptors(key: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors of a grpc.aio channel that present `key` on every call (none for '')."""
    return [kind(key) for kind in _INTERCEPTORS] if key else []


def stage_interceptors(environ: Mapping[str, str] = os.environ) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors of a channel to a stage's ports: present the stage key, when there is one."""
    return key_interceptors(stage_key(environ))


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
    keys = _env_keys(svc.admin_api_key_env, key_path, environ)
    return ApiKeys(tuple(k.encode() for k in keys), key_path, f"the admin key ({key_path})")


def admin_metadata(
    svc: ServiceConfig, environ: Mapping[str, str] = os.environ
) -> tuple[tuple[str, str], ...]:
    """What a client of the service's Control API sends (launcher, CLI, gateway): its admin key, else
    the stage key for a stage, if any."""
    keys = with_stage_key(admin_keys(svc, environ), svc, environ)
    return bearer(keys.keys[0].decode()) if keys else ()


def client_metadata(
    svc: ServiceConfig, environ: Mapping[str, str] = os.environ
) -> tuple[tuple[str, str], ...]:
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
    own = (svc.tls.cert_file, f"services.{svc.name}.tls.cert_file")
    return tls_credentials(ca_file, cert_file, key_file, default_ca=own)


def tls_credentials(
    ca_file: str = "", cert_file: str = "", key_file: str = "", *, default_ca: tuple[str, str] | None = None
) -> grpc.ChannelCredentials:
    """The one builder of TLS channel credentials (the CLI, the client library, the HTTP front): the CA
    to trust (`default_ca` (file, its deploy-file key) when no `ca_file`; else the system roots) and the
    client's pair for mutual TLS. A file that cannot be read is a SecretError naming its flag or key."""
    if ca_file:
        root = _read(ca_file, "--ca-file")
    else:
        root = _read(*default_ca) if default_ca is not None else None
    key = _read(key_file, "--key-file") if key_file else None
    chain = _read(cert_file, "--cert-file") if cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)


def check_secrets(svc: ServiceConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every secret the service needs, read once: the problems (for `serve` before anything starts)."""
    problems = []
    for load in (
        lambda: api_keys(svc, environ),
        lambda: admin_keys(svc, environ),
        lambda: server_credentials(svc),
    ):
        try:
            load()
        except SecretError as exc:
            problems.append(str(exc))
    return problems
