"""The dashboard (weenv.server.ui) of a real ``weenv serve``, driven in Debian's
headless Chromium by Playwright: one browser for the module, one logged-in
context.  Screenshots of each page go to a temporary directory (its path is
printed: ``pytest -s`` shows it)."""

from __future__ import annotations

import html
import http.server
import shutil
import threading

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

import weenv
from daemon_fixture import start_daemon
from weenv import Sandbox

SMALL = {"cpus": 0.05, "memory_bytes": 64 << 20, "pids": 128}
PAGES = ("/ui/", "/ui/node", "/ui/templates", "/ui/tax")


@pytest.fixture(scope="module")
def daemon(shared_store, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("dashboard") / "home", shared_store.url)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    path = tmp_path_factory.mktemp("dashboard-shots")
    print(f"\ndashboard screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed (scripts/setup.sh installs it)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])  # root: no setuid sandbox
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def page(browser, daemon):
    """A page logged in through the form."""
    context = browser.new_context(base_url=daemon.url, viewport={"width": 1400, "height": 800})
    pg = context.new_page()
    pg.goto("/ui/")
    assert pg.url.endswith("/ui/login")  # no key: the login form
    pg.fill("input[name=key]", daemon.key)
    pg.click("button[type=submit]")
    expect(pg.locator("h1")).to_have_text("Environments 0")
    cookie = next(c for c in context.cookies() if c["name"] == "weenv_key")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    yield pg
    context.close()


@pytest.fixture
def sdk(daemon, monkeypatch):
    monkeypatch.setenv("WEENV_API_URL", daemon.url)
    monkeypatch.setenv("WEENV_API_KEY", daemon.key)
    return daemon


def create(daemon) -> Sandbox:
    sb = Sandbox.create("task", timeout=300, resources=SMALL)
    daemon.track(sb.id)
    return sb


def state(daemon, env_id: str) -> int | str:
    with daemon.http() as http:
        r = http.get(f"/environments/{env_id}")
    return r.json()["state"] if r.status_code == 200 else r.status_code


def test_environments_appear_and_pause_from_the_page(page, sdk, shots):
    with create(sdk) as sb:
        row = page.locator(f'tr[data-env="{sb.id}"]')
        expect(row).to_be_visible(timeout=2000)  # the page refreshes itself: no reload
        expect(row).to_have_attribute("data-state", "running")
        page.screenshot(path=shots / "environments.png", full_page=True)
        row.locator("button.pause").click()
        expect(page.locator(".notice")).to_have_text(f"paused {sb.id}")
        assert state(sdk, sb.id) == "paused"  # through the API
        expect(page.locator(f'tr[data-env="{sb.id}"]')).to_have_attribute("data-state", "paused")
        page.screenshot(path=shots / "environments-paused.png", full_page=True)
        page.locator(f'tr[data-env="{sb.id}"] button.resume').click()
        expect(page.locator(".notice")).to_have_text(f"resumed {sb.id}")
        assert state(sdk, sb.id) == "running"


def test_an_action_on_an_environment_that_is_gone_says_so(page, sdk, daemon):
    sb = create(sdk)
    page.goto("/ui/")
    token = page.locator(f'tr[data-env="{sb.id}"] input[name=token]').first.get_attribute("value")
    sb.kill()
    r = page.request.post(
        f"/ui/environments/{sb.id}/pause", form={"token": token}, headers={"origin": daemon.url}
    )  # the page's own origin, its cookie
    assert r.status == 404
    assert f"pause {sb.id}: no environment" in html.unescape(r.text())
    r = page.request.post(f"/ui/environments/{sb.id}/explode", form={"token": token}, headers={"origin": daemon.url})
    assert r.status == 404 and "no action 'explode': one of kill, pause, resume, snapshot" in html.unescape(r.text())


def test_an_action_posted_from_another_origin_is_refused(page, sdk, daemon):
    """A page of the same site on another port gets the cookie (SameSite is by
    site, not port), and the form's token too here: the origin check refuses it."""
    with create(sdk) as sb:
        page.goto("/ui/")
        token = page.locator(f'tr[data-env="{sb.id}"] input[name=token]').first.get_attribute("value")
        form = (
            f'<form id="f" method="post" action="{daemon.url}/ui/environments/{sb.id}/kill">'
            f'<input name="token" value="{token}"></form>'
        ).encode()

        class Evil(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.end_headers()
                self.wfile.write(form)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            with page.expect_navigation() as nav:
                page.evaluate("document.getElementById('f').submit()")
            assert nav.value.status == 403
            expect(page.locator(".error")).to_contain_text("refused: the request comes from http://127.0.0.1:")
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
        assert state(sdk, sb.id) == "running"


def test_without_the_key_nothing_of_an_environment_is_served(browser, sdk, daemon):
    with create(sdk) as sb:
        for cookies in ({}, {"weenv_key": "0" * 40}):
            with httpx.Client(base_url=daemon.url, timeout=30, cookies=cookies) as http:
                for path in (*PAGES, "/ui/login", "/ui/static/ui.js", "/ui/static/ui.css"):
                    r = http.get(path)
                    assert sb.id not in r.text, path
                    if path in PAGES:
                        assert r.status_code == 303 and r.headers["location"] == "/ui/login", path
                r = http.post(f"/ui/environments/{sb.id}/kill", headers={"origin": daemon.url})
                assert r.status_code == 401 and sb.id not in r.text
        r = httpx.get(daemon.url + "/ui/", headers={"x-api-key": daemon.key}, timeout=30)  # a script's key too
        assert r.status_code == 200 and sb.id in r.text
        assert state(sdk, sb.id) == "running"
        context = browser.new_context(base_url=daemon.url)
        try:
            pg = context.new_page()
            pg.goto("/ui/login")
            pg.fill("input[name=key]", "0" * 40)
            with pg.expect_navigation() as nav:
                pg.click("button[type=submit]")
            assert nav.value.status == 401
            expect(pg.locator(".error")).to_contain_text("wrong key")
            assert not [c for c in context.cookies() if c["name"] == "weenv_key"]
            assert sb.id not in pg.content()
        finally:
            context.close()


def test_the_tax_chart_moves_while_a_meter_is_open(page, sdk, shots):
    page.goto("/ui/tax")
    with weenv.meter("dashboard-live", report_every=0.2), create(sdk) as sb:
        sb.commands.run("true")
        bar = page.locator('g.bar[data-batch="dashboard-live"] rect')
        expect(bar.first).to_be_visible(timeout=5000)  # posted while the meter is open
        assert bar.count() >= 1 and page.locator('tr[data-batch="dashboard-live"]').count() == 1
        page.screenshot(path=shots / "tax.png", full_page=True)


def test_node_and_templates_pages(page, sdk, shots):
    page.goto("/ui/node")
    expect(page.locator("#hit-rate")).to_be_visible()
    expect(page.locator(".cards")).to_contain_text("OCI runtime")
    page.screenshot(path=shots / "node.png", full_page=True)
    page.goto("/ui/templates")
    expect(page.locator('tr[data-template="task"]')).to_contain_text("MiB")
    assert page.locator('tr[data-template="task"] .group').count() == 2  # base and task
    page.screenshot(path=shots / "templates.png", full_page=True)
