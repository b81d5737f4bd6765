"""`omnistage keys --env-file PATH`: the secrets of a containerised deployment in one env file.

docker-compose reads it with `--env-file PATH`, Kubernetes with `kubectl create secret generic
omnistage-keys --from-env-file=PATH` (the manifests' secretKeyRefs use these names). The file is
written 0600 and never replaced unless asked (`--force`: rotating keys is a decision, not a
side effect); the keys come from `secrets` (256 bits each).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from omnistage.common.runtime.auth import STAGE_KEY_ENV

# name → what it is (the file's comments, docs/deploy.md's table)
KEYS = {
    "OMNISTAGE_API_KEYS": "the gateway's client keys, comma-separated (api_keys_env)",
    "OMNISTAGE_ADMIN_KEY": "every service's Control port (admin_api_key_env)",
    STAGE_KEY_ENV: "the stages' main and admin ports answer only callers presenting it",
    "GRAFANA_ADMIN_PASSWORD": "Grafana's admin password (compose only)",
}


def env_file_text(api_keys: int = 1) -> str:
    """Fresh keys as an env file; `api_keys` client keys in OMNISTAGE_API_KEYS."""
    values = {
        "OMNISTAGE_API_KEYS": ",".join(secrets.token_urlsafe(32) for _ in range(api_keys)),
        "OMNISTAGE_ADMIN_KEY": secrets.token_urlsafe(32),
        STAGE_KEY_ENV: secrets.token_urlsafe(32),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(24),
    }
    lines = [
        "# omnistage deployment keys (`omnistage keys`): keep this file private (0600).",
        "#   docker-compose --env-file THIS_FILE -f deploy/docker-compose.yml up -d",
        "#   kubectl -n omnistage create secret generic omnistage-keys --from-env-file=THIS_FILE",
    ]
    for name, value in values.items():
        lines += [f"# {KEYS[name]}", f"{name}={value}"]
    return "\n".join(lines) + "\n"


def write_env_file(path: str | Path, *, api_keys: int = 1, force: bool = False) -> Path:
    """Write fresh keys to `path` (0600). FileExistsError when it exists and `force` is not set."""
    path = Path(path)
    if api_keys < 1:
        raise ValueError(f"--api-keys: at least 1, got {api_keys}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp") if force else path
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(env_file_text(api_keys))
    if force:
        os.replace(tmp, path)
    return path
