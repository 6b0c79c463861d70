"""Connection URLs as logs and errors may show them: the one place a password is masked (the app's
store and the engine's session KV store both connect to Redis by URL)."""

from __future__ import annotations


def mask_url(url: str) -> str:
    """``url`` with any password (and user name) replaced, for logs and errors.

    >>> mask_url("redis://:s3cret@10.0.0.5:6379/0"), mask_url("redis://bob:pw@h/1"), mask_url("redis://h:6379")
    ('redis://***@10.0.0.5:6379/0', 'redis://***@h/1', 'redis://h:6379')
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}://{netloc}{slash}{path}"
