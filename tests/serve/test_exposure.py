"""Exposure (issue 43 item 5) through a real ingress without Ray (tests/chaos/state_harness.py):
no secret in /readyz or the log, tenant series only for operators, operator-only request options."""

from __future__ import annotations

import logging

import pytest

from app.settings import StoreArgs, TenantArgs
from tests.chaos.state_harness import ACME_KEY, OPERATOR_KEY, FakePool, ingress_spec, keys_env, running_ingress


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_readyz_and_the_log_never_show_the_store_password(monkeypatch, caplog):
    keys_env(monkeypatch)
    spec = ingress_spec(StoreArgs(kind="redis", url="redis://:hunter2@127.0.0.1:1/0"))
    caplog.set_level(logging.WARNING)
    async with running_ingress(spec, FakePool()) as (client, _):
        r = await client.get("/readyz")
    assert r.status_code == 503
    store = r.json()["store"]
    assert store["ok"] is False and store["error"].startswith("redis store unreachable")
    assert "hunter2" not in r.text and "127.0.0.1:1" not in r.text  # neither the password nor the address
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "redis://***@127.0.0.1:1/0" in logged and "hunter2" not in logged


async def test_tenant_series_need_an_operator_key(tmp_path, monkeypatch):
    keys_env(monkeypatch)
    spec = ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path)), {"acme": TenantArgs(tokens_per_day=10**6)})
    async with running_ingress(spec, FakePool()) as (client, _):
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=_auth(ACME_KEY))).status_code == 200
        public = await client.get("/metrics", headers={"Authorization": ""})
        assert public.status_code == 200 and "sinkserve_requests_total" in public.text
        assert "sinkserve_tenant" not in public.text and "acme" not in public.text
        assert (await client.get("/metrics/tenants", headers={"Authorization": ""})).status_code == 401
        refused = await client.get("/metrics/tenants", headers=_auth(ACME_KEY))
        assert refused.status_code == 403 and "operator key" in refused.json()["error"]["message"]
        ok = await client.get("/metrics/tenants", headers=_auth(OPERATOR_KEY))
        assert ok.status_code == 200 and 'sinkserve_tenant_tokens_total{kind="prompt",replica=' in ok.text
        assert 'tenant="acme"' in ok.text


@pytest.mark.parametrize("option, param", [({"sinkserve": {"pool": "chat"}}, "sinkserve.pool"),
                                           ({"model": "ref@v2"}, "model")])
async def test_operator_only_options(tmp_path, monkeypatch, option, param):
    keys_env(monkeypatch)
    spec = ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path)))
    body = {"prompt": "hi", "max_tokens": 2, **option}
    async with running_ingress(spec, FakePool()) as (client, _):
        r = await client.post("/v1/completions", json=body, headers=_auth(ACME_KEY))
        assert r.status_code == 403 and r.json()["error"]["param"] == param, r.text
        r = await client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, headers=_auth(ACME_KEY))
        assert r.status_code == 403 and r.json()["error"]["param"] == param, r.text
        r = await client.post("/v1/completions", json=body, headers=_auth(OPERATOR_KEY))
        assert r.status_code == 200, r.text
        # A version that takes traffic may be pinned by anyone.
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "ref@v1"}, headers=_auth(ACME_KEY))
        assert r.status_code == 200, r.text


def test_any_log_line_masks_url_credentials(caplog):
    from app import log_masking

    log_masking.install()
    caplog.set_level(logging.INFO)
    logging.getLogger("some.library").warning("connecting to %s failed", "redis://admin:hunter2@10.1.2.3:6379/0")
    logging.getLogger("some.library").info("plain %d", 3)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "hunter2" not in text and "redis://***@10.1.2.3:6379/0" in text and "plain 3" in text
