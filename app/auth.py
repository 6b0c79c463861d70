"""Bearer-token auth. Keys come from the environment only (``SINKSERVE_API_KEYS``, comma-separated)
or from a file named by ``SINKSERVE_API_KEYS_FILE`` (one key a line, ``#`` comments) -- never from
the Serve config, which is often committed or shared.

Every key belongs to a tenant: ``<key>:<tenant>`` names it (both sources), a bare key belongs to
``default``. Tenants' quotas are not secret and live in the config (``tenants:``, app/quotas.py)::

    SINKSERVE_API_KEYS="sk-abc:acme,sk-def:acme,sk-ghi"   # two acme keys, one default key
"""

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
DEFAULT_TENANT = "default"
TENANT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class AuthConfigError(RuntimeError):
    """Auth is enabled but no key source is configured: the server refuses to start."""


@dataclass(frozen=True)
class AuthSettings:
    enabled: bool
    tenants: Mapping[str, str]  # key -> tenant

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.tenants)

    def tenant_of(self, key: str | None) -> str:
        """The tenant a checked key belongs to (``default`` when auth is off)."""
        return self.tenants.get(key, DEFAULT_TENANT) if key is not None else DEFAULT_TENANT

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


def parse_entry(entry: str, where: str) -> tuple[str, str]:
    """``"<key>"`` or ``"<key>:<tenant>"`` -> ``(key, tenant)``.

    >>> parse_entry("sk-1:acme", "env"), parse_entry("sk-2", "env")
    (('sk-1', 'acme'), ('sk-2', 'default'))
    """
    key, sep, tenant = entry.strip().rpartition(":")
    if not sep:
        key, tenant = tenant, DEFAULT_TENANT
    key, tenant = key.strip(), tenant.strip()
    if not key or not tenant or len(tenant) > 64 or not set(tenant) <= TENANT_CHARS:
        raise AuthConfigError(f"{where}: an entry must be '<key>' or '<key>:<tenant>' (tenant: letters, digits, _ . -)")
    return key, tenant


def read_key_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Key -> tenant from a key file (one ``<key>[:<tenant>]`` a line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise AuthConfigError(f"{KEYS_FILE_ENV}={path} does not name a readable file")
    keys: dict[str, str] = {}
    for i, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            key, tenant = parse_entry(line, f"{KEYS_FILE_ENV} line {i}")
            keys[key] = tenant
    return keys


def load_api_keys(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Key -> tenant from the environment and the key file."""
    env = os.environ if env is None else env
    keys: dict[str, str] = {}
    if env.get(KEYS_ENV):
        for entry in env[KEYS_ENV].split(","):
            if entry.strip():
                key, tenant = parse_entry(entry, KEYS_ENV)
                keys[key] = tenant
    if env.get(KEYS_FILE_ENV):
        keys.update(read_key_file(env[KEYS_FILE_ENV]))
    return keys


def resolve_auth(mode: str, env: Mapping[str, str] | None = None) -> AuthSettings:
    """Decide how the server authenticates, or refuse to start.

    ``mode == "disabled"`` (written explicitly in the config) opens the server and says so in the
    log; otherwise at least one key must come from the environment or the key file.
    """
    if mode == "disabled":
        logger.warning("auth: disabled in the config -- the API is OPEN to anyone who can reach it")
        return AuthSettings(enabled=False, tenants={})
    keys = load_api_keys(env)
    if not keys:
        raise AuthConfigError(
            f"no API keys: set {KEYS_ENV} (comma-separated) or {KEYS_FILE_ENV} (a file, one key a "
            "line), or write 'auth: disabled' in the config to run an open server"
        )
    return AuthSettings(enabled=True, tenants=keys)


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
