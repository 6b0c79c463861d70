"""Bearer-token auth. Keys come from the environment only (``SINKSERVE_API_KEYS``, comma-separated)
or from a file named by ``SINKSERVE_API_KEYS_FILE`` (one key a line, ``#`` comments) -- never from
the Serve config, which is often committed or shared.

Every key belongs to a tenant: ``<key>:<tenant>`` names it (both sources), a bare key belongs to
``default``. Tenants' quotas are not secret and live in the config (``tenants:``, app/state/quotas.py)::

    SINKSERVE_API_KEYS="sk-abc:acme,sk-def:acme,sk-ghi"   # two acme keys, one default key

Operator keys (``SINKSERVE_OPERATOR_KEYS``, or a file named by ``SINKSERVE_OPERATOR_KEYS_FILE``;
same syntax) are API keys too, and they alone may use the operator-only request options -- forcing
a pool (``sinkserve.pool``), pinning a version that takes no traffic (``model: name@v`` with weight
0) -- and read the per-tenant metrics (``GET /metrics/tenants``). With ``auth: disabled`` everyone
is an operator (the server is open anyway)::

    SINKSERVE_OPERATOR_KEYS="sk-ops-1:ops"
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
OPERATOR_KEYS_ENV = "SINKSERVE_OPERATOR_KEYS"
OPERATOR_KEYS_FILE_ENV = "SINKSERVE_OPERATOR_KEYS_FILE"
DEFAULT_KEY_FILE = Path("~/.sinkserve/api_keys").expanduser()
DEFAULT_TENANT = "default"
TENANT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class AuthConfigError(RuntimeError):
    """Auth is enabled but no key source is configured: the server refuses to start."""


@dataclass(frozen=True)
class AuthSettings:
    enabled: bool
    tenants: Mapping[str, str]  # key -> tenant (operator keys included)
    operators: frozenset[str] = frozenset()  # the operator keys

    def is_operator(self, key: str | None) -> bool:
        """Whether a checked key may use operator-only options (every caller when auth is off)."""
        if not self.enabled:
            return True
        ok = False
        for op in self.operators:  # constant time, as in check()
            ok |= key is not None and hmac.compare_digest(key.encode(), op.encode())
        return ok

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


def read_key_file(path: str | os.PathLike[str], env_name: str = KEYS_FILE_ENV) -> dict[str, str]:
    """Key -> tenant from a key file (one ``<key>[:<tenant>]`` a line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise AuthConfigError(f"{env_name}={path} does not name a readable file")
    keys: dict[str, str] = {}
    for i, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            key, tenant = parse_entry(line, f"{KEYS_FILE_ENV} line {i}")
            keys[key] = tenant
    return keys


def load_api_keys(env: Mapping[str, str] | None = None, var: str = KEYS_ENV, file_var: str = KEYS_FILE_ENV) -> dict[str, str]:
    """Key -> tenant from the environment and the key file (operator keys: ``var`` and
    ``file_var`` name the operator variables)."""
    env = os.environ if env is None else env
    keys: dict[str, str] = {}
    if env.get(var):
        for entry in env[var].split(","):
            if entry.strip():
                key, tenant = parse_entry(entry, var)
                keys[key] = tenant
    if env.get(file_var):
        keys.update(read_key_file(env[file_var], file_var))
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
    operators = load_api_keys(env, OPERATOR_KEYS_ENV, OPERATOR_KEYS_FILE_ENV)
    if not keys and not operators:
        raise AuthConfigError(
            f"no API keys: set {KEYS_ENV} (comma-separated) or {KEYS_FILE_ENV} (a file, one key a "
            "line), or write 'auth: disabled' in the config to run an open server"
        )
    return AuthSettings(enabled=True, tenants={**keys, **operators}, operators=frozenset(operators))


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
