"""The OpenAPI document's request bodies.

The endpoints read their bodies themselves (``await request.body()`` then pydantic, so a bad body is
a 400 naming the field in OpenAI's error shape, not FastAPI's 422), which leaves FastAPI nothing to
document. :func:`body` gives a route's ``openapi_extra`` from the pydantic models, and
:func:`install` merges their shared definitions into ``components.schemas`` -- so clients and
schema-driven fuzzers (bench/schemathesis_run.py) see every field and bound.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
_DEFS: dict[str, Any] = {}


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF)
    _DEFS.update(schema.pop("$defs", {}))
    _DEFS[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is one of ``models``."""
    refs = [_schema(m) for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    errors = {str(code): {"description": what, "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}
              for code, what in ((400, "invalid request; error.param names the field"), (401, "missing or wrong API key"),
                                 (404, "unknown model"), (429, "rate limited"))}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}, "responses": errors}


def install(api: FastAPI, error_model: type[BaseModel]) -> None:
    """Make ``api.openapi()`` include the request models' definitions."""
    _schema(error_model)

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            doc = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(_DEFS)
            api.openapi_schema = doc
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]
