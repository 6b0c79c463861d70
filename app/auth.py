"""Bearer-token auth. Keys come from the environment only (``SINKSERVE_API_KEYS``, comma-separated)
or from a file named by ``SINKSERVE_API_KEYS_FILE`` (one key a line, ``#`` comments) -- never from
the Serve config, which is often committed or shared."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

logger = logging.getLogger(__name__)

KEYS_ENV = "SINKSERVE_API_KEYS"
KEYS_FILE_ENV = "SINKSERVE_API_KEYS_FILE"
DEFAULT_KEY_FILE = Path("~/.sinkserve/api_keys").expanduser()


class AuthConfigError(RuntimeError):
    """Auth is enabled but no key source is configured: the server refuses to start."""


@dataclass(frozen=True)
class AuthSettings:
    enabled: bool
    keys: frozenset[str]

    def check(self, authorization: str | None) -> str | None:
        """Return the caller's key (None when auth is off); raise ``PermissionError`` when refused."""
        if not self.enabled:
            return None
        if not authorization:
            raise PermissionError("missing Authorization header (expected 'Bearer <key>')")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise PermissionError("Authorization header must be 'Bearer <key>'")
        # Compare against every key in constant time so timing does not reveal a prefix match.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token.encode(), key.encode())
        if not ok:
            raise PermissionError("invalid API key")
        return token


def read_key_file(path: str | os.PathLike[str]) -> set[str]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise AuthConfigError(f"{KEYS_FILE_ENV}={path} does not name a readable file")
    keys = set()
    for line in p.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            keys.add(line)
    return keys


def load_api_keys(env: Mapping[str, str] | None = None) -> frozenset[str]:
    env = os.environ if env is None else env
    keys: set[str] = set()
    if env.get(KEYS_ENV):
        keys |= {k.strip() for k in env[KEYS_ENV].split(",") if k.strip()}
    if env.get(KEYS_FILE_ENV):
        keys |= read_key_file(env[KEYS_FILE_ENV])
    return frozenset(keys)


def resolve_auth(mode: str, env: Mapping[str, str] | None = None) -> AuthSettings:
    """Decide how the server authenticates, or refuse to start.

    ``mode == "disabled"`` (written explicitly in the config) opens the server and says so in the
    log; otherwise at least one key must come from the environment or the key file.
    """
    if mode == "disabled":
        logger.warning("auth: disabled in the config -- the API is OPEN to anyone who can reach it")
        return AuthSettings(enabled=False, keys=frozenset())
    keys = load_api_keys(env)
    if not keys:
        raise AuthConfigError(
            f"no API keys: set {KEYS_ENV} (comma-separated) or {KEYS_FILE_ENV} (a file, one key a "
            "line), or write 'auth: disabled' in the config to run an open server"
        )
    return AuthSettings(enabled=True, keys=keys)


def ensure_key_file(path: Path = DEFAULT_KEY_FILE) -> tuple[str, bool]:
    """Return the first key in ``path``, creating the file (mode 0600) with a fresh key if needed."""
    if path.is_file():
        keys = sorted(read_key_file(path))
        if keys:
            return keys[0], False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "sk-sinkserve-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, True
