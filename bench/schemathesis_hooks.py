"""Schemathesis check for bench/schemathesis_run.py: every 400 names the offending field.

Loaded with ``SCHEMATHESIS_HOOKS=bench.schemathesis_hooks``.
"""

from __future__ import annotations

import json
import os

import schemathesis


@schemathesis.check
def error_names_the_field(ctx, response, case) -> None:  # noqa: ANN001 - schemathesis' signature
    """A 400 carries OpenAI's error shape with ``param`` set (``body`` for a body that is not JSON)."""
    if response.status_code != 400:
        return
    try:
        err = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"400 without an OpenAI error body: {response.content[:200]!r}") from None
    if not isinstance(err.get("param"), str) or not err["param"]:
        raise AssertionError(f"400 that names no field: {err}")


@schemathesis.check
def no_fastapi_422(ctx, response, case) -> None:  # noqa: ANN001
    """Invalid input is a 400 in OpenAI's shape, never FastAPI's bare 422."""
    if response.status_code == 422:
        raise AssertionError(f"422 instead of a 400 naming the field: {response.content[:200]!r}")


@schemathesis.hook
def after_call(context, case, response) -> None:  # noqa: ANN001 - schemathesis' signature
    """One line per response (method, path, status, seconds) to ``$SINKSERVE_FUZZ_RESPONSES`` when set:
    bench/schemathesis_run.py counts 5xx and slow answers from it across its schemathesis runs."""
    path = os.environ.get("SINKSERVE_FUZZ_RESPONSES")
    if path:
        el = response.elapsed
        el = el.total_seconds() if hasattr(el, "total_seconds") else float(el)
        with open(path, "a") as f:
            f.write(f"{case.method} {case.path} {response.status_code} {el:.3f}\n")
