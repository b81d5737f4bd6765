"""TLS of a service's main port (`tls:`, the gateway's public port)."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.config.checks import ConfigError


@dataclass(frozen=True)
class TlsConfig:
    """TLS of a service's main port (the gateway's public port)."""

    # PEM certificate chain of the server (required).
    cert_file: str = ""
    # PEM private key of cert_file (required).
    key_file: str = ""
    # PEM CA bundle that signs client certificates; set, clients must present one (mutual TLS).
    client_ca_file: str = ""

    def validate(self, path: str) -> None:
        for key in ("cert_file", "key_file"):
            if not getattr(self, key):
                raise ConfigError(f"{path}.{key}: required when tls is set")
