"""DashboardConfig, and access to the dashboard and /metrics when an API key is set."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from dashboard import DashboardConfig, create_dashboard, metrics_route
from dashboard.auth import SESSION_COOKIE, session_token

KEY = "sk-test-9f8e7d"


def test_config_flags_win_over_environment_and_key_stays_out_of_repr():
    env = {"REDJAX_REDIS_URL": "redis://env:6379/1", "REDJAX_API_KEY": KEY, "REDJAX_DASHBOARD_PORT": "9100",
           "REDJAX_DASHBOARD_REFRESH_S": "0.5"}
    config = DashboardConfig.from_flags({"redis_url": "redis://flag:6379/0", "port": None}, environ=env)
    assert (config.redis_url, config.port, config.refresh_s, config.api_key) == ("redis://flag:6379/0", 9100, 0.5, KEY)
    assert KEY not in repr(config)
    assert DashboardConfig.from_flags({}, environ={"REDJAX_API_KEY": ""}).api_key is None
    assert DashboardConfig(redis_url="redis://user:pw@host:6379/0").redis_display == "redis://host:6379/0"


@pytest.mark.parametrize("bad", [{"refresh_s": 2.0}, {"port": 70000}, {"redis_url": "http://x"}, {"api_key": ""}])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        DashboardConfig(**bad)


@pytest.fixture
def locked(redis_client, redis_url):
    """A TestClient for the API-like app: dashboard mounted at /dashboard, /metrics at the top."""
    config = DashboardConfig(redis_url=redis_url, api_key=KEY)
    app = Starlette(routes=[Mount("/dashboard", create_dashboard(config)), metrics_route(config)])
    with TestClient(app, base_url="http://testserver") as client:
        yield client


def test_without_the_key_data_is_refused_and_the_page_sends_to_login(locked):
    for path in ("/metrics", "/dashboard/metrics", "/dashboard/api/snapshot", "/dashboard/api/stream"):
        response = locked.get(path)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"].startswith("Bearer")
    page = locked.get("/dashboard/", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"] == "/dashboard/login"
    form = locked.get("/dashboard/login")
    assert form.status_code == 200 and 'action="/dashboard/login"' in form.text and 'type="password"' in form.text
    assert locked.get("/dashboard/static/dashboard.css").status_code == 200  # the login page needs its style


def test_login_sets_a_derived_httponly_cookie(locked):
    wrong = locked.post("/dashboard/login", data={"api_key": "nope"}, follow_redirects=False)
    assert wrong.status_code == 401 and "not accepted" in wrong.text and SESSION_COOKIE not in wrong.cookies

    ok = locked.post("/dashboard/login", data={"api_key": KEY}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/dashboard/"
    set_cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie and "Path=/" in set_cookie
    assert KEY not in set_cookie and session_token(KEY) in set_cookie
    assert KEY not in ok.headers.get("location", "")

    assert locked.get("/dashboard/").status_code == 200
    assert locked.get("/dashboard/api/snapshot").json()["ok"] is True
    assert locked.get("/metrics").status_code == 200

    out = locked.post("/dashboard/logout", follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/dashboard/login"
    assert locked.get("/metrics").status_code == 401  # logging out dropped the cookie


def test_bearer_key_works_for_scrapers(locked):
    assert locked.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert locked.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert locked.get("/metrics", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    locked.cookies.set(SESSION_COOKIE, KEY)
    assert locked.get("/metrics").status_code == 401  # the raw key is not a session


def test_open_when_no_key_is_configured(redis_client, redis_url):
    with TestClient(create_dashboard(DashboardConfig(redis_url=redis_url))) as client:
        assert client.get("/").status_code == 200
        assert client.get("/metrics").status_code == 200
        login = client.get("/login", follow_redirects=False)
        assert login.status_code == 303 and login.headers["location"] == "/"
