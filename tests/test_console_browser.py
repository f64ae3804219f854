"""The operator console in a real browser: Debian's Chromium driven through its
chromium-driver by Selenium, against real router and agent processes.

One test walks the console as an operator would (login, the fleet as agents join and
leave, explain, recent requests, a key created and revoked, a policy validated and
applied) with an agent whose machine name, tags and model carry HTML and script; two
more show that the Content Security Policy refuses inline script and that no other
page can frame the console. With CONSOLE_SCREENSHOTS=docs/img the walk also saves the
screenshots docs/console.md shows.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleet import ADMIN_KEY, Fleet, Router
from tests.redis_server import RedisServer

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Each one, if the page ever parsed it as HTML, would set window.pwned.
HOSTILE_MACHINE = "<img src=x onerror=window.pwned=1>"
HOSTILE_TAG = "<script>window.pwned=2</script>"
HOSTILE_MODEL = "<b onmouseover=window.pwned=3>m2</b>"
# Agents in eu-west first: the hostile agent (no region) shows gate 4 in the fleet view.
POLICY = """\
routing_policy:
  match: {region: eu-west}
  strategy: least-loaded
fallback_chain:
  - name: anywhere
    match: {}
    strategy: least-loaded
"""
NEW_POLICY = """\
routing_policy:
  match: {}
  strategy: round-robin
"""
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1500,1000",
)


def _browser_tools() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        why = f"{', '.join(missing)} missing: scripts/setup installs chromium and chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


# One browser and one fleet for the file: each costs seconds to start.
@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    _browser_tools()
    tmp_path = tmp_path_factory.mktemp("chromium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # Selenium Manager would look for a browser to download: it is never asked.
    os.environ["SE_OFFLINE"] = "true"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Router, Router]]:
    """The console's router and another one sharing its Redis (the whole-fleet view)."""
    tmp_path = tmp_path_factory.mktemp("fleet")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    f = Fleet(tmp_path)
    redis_server = RedisServer(tmp_path, f.env).start()
    try:
        routers = [
            f.router(
                "--policy-file",
                str(policy),
                "--history-path",
                str(tmp_path / f"history-{n}.sqlite3"),
                "--state-url",
                redis_server.url,
                # An agent that left is gone from the table in seconds, not 30.
                "--heartbeat-interval",
                "1s",
                "--unhealthy-after",
                "2s",
                "--remove-after",
                "4s",
                # policy=debug: the stories show each step's selection.
                env={
                    "HIVENET_ROUTER_AUTH_MODE": "dynamic",
                    "HIVENET_LOG_LEVEL": "info,policy=debug",
                },
                start=False,
            )
            for n in range(2)
        ]
        # Side by side: each takes seconds to start.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Router.start, routers))
        yield f, routers[0], routers[1]
    finally:
        f.close()
        redis_server.stop()


def wait(driver: Any, condition: Any, timeout: float = 20) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The console re-renders its tables on each poll: an element read in the middle of
    # that is stale, and the condition is asked again (it failed 2 full runs in ~5).
    ignored = [StaleElementReferenceException]
    waiting = WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=ignored)
    return waiting.until(condition)


def in_table(driver: Any, css: str, act: Any) -> Any:
    """`act` on the element `css` names in a table the console re-renders on each poll:
    an element found just before a re-render is stale, and is found again."""
    from selenium.webdriver.common.by import By

    return wait(driver, lambda d: [act(d.find_element(By.CSS_SELECTOR, css))])[0]


def by_id(driver: Any, name: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def rows(driver: Any, table: str, attribute: str) -> list[str]:
    script = f"return [...document.querySelectorAll('#{table} tbody tr')]"
    return driver.execute_script(f"{script}.map(r => r.dataset.{attribute})")


def shoot(driver: Any, name: str) -> None:
    where = os.environ.get("CONSOLE_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(where) / f"console-{name}.png"))


def login(driver: Any, router: Router) -> None:
    driver.get(router.url + "/ui")
    driver.execute_script("sessionStorage.clear()")
    driver.get(router.url + "/ui")
    by_id(driver, "admin-key").send_keys(ADMIN_KEY)
    by_id(driver, "login-button").click()
    wait(driver, lambda d: by_id(d, "app").is_displayed())


def test_console_walkthrough(browser: Any, fleet: tuple[Fleet, Router, Router]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    f, router, other = fleet
    hostile = f.agent(
        [router, other],
        HOSTILE_MODEL,
        "--machine",
        HOSTILE_MACHINE,
        "--tags",
        f"{HOSTILE_TAG},gpu",
        wait=False,  # it joins while the browser logs in; the fleet view waits for it
    )
    driver = browser
    driver.get(router.url + "/ui")
    driver.execute_script("sessionStorage.clear()")
    driver.get(router.url + "/ui")
    by_id(driver, "admin-key").send_keys("wrong-key")
    by_id(driver, "login-button").click()
    wait(driver, lambda d: "refused" in by_id(d, "login-error").text)
    assert not by_id(driver, "app").is_displayed()
    login(driver, router)
    # The key is in this tab's sessionStorage only: no cookie, no localStorage, no URL.
    assert driver.execute_script("return sessionStorage.getItem('hivenet-admin-key')") == ADMIN_KEY
    assert driver.execute_script("return localStorage.length + document.cookie.length") == 0
    assert ADMIN_KEY not in driver.current_url

    wait(driver, lambda d: hostile.peer_id in rows(d, "fleet-table", "peer"))
    gate_4 = 'routing_policy: gate[4] match [region(got="",want="eu-west")]'
    wait(driver, lambda d: gate_4 in by_id(d, "fleet-table").text)
    table = by_id(driver, "fleet-table").text
    for text in (HOSTILE_MACHINE, HOSTILE_TAG, HOSTILE_MODEL):
        assert text in table  # shown as the text it is...
    # ...and never parsed: no element came of it, no handler ran.
    assert driver.find_elements(By.CSS_SELECTOR, "#fleet-table img, #fleet-table b") == []
    assert driver.find_elements(By.CSS_SELECTOR, "#fleet-table script") == []
    assert driver.execute_script("return window.pwned") is None

    # An agent joins and leaves: the table follows without a reload.
    driver.execute_script("window.sameDocument = true")
    joined = f.agent(router, "m1", "--capacity", "4", "--region", "eu-west", wait=False)
    wait(driver, lambda d: joined.peer_id in rows(d, "fleet-table", "peer"), 30)
    wait(driver, lambda d: "registered" in by_id(d, "fleet-events").text)
    shoot(driver, "fleet")

    # Explain: what a request for m1 would do, and the real request then does it.
    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=explain]").click()
    by_id(driver, "explain-model").send_keys("m1")
    by_id(driver, "explain-prompt").send_keys("Hello")
    by_id(driver, "explain-button").click()
    chosen = wait(driver, lambda d: d.find_elements(By.ID, "explain-chosen"))[0]
    assert joined.peer_id in chosen.text
    shoot(driver, "explain")
    # The hostile agent's model: the first step drains at gate 4, the second chooses it.
    model = by_id(driver, "explain-model")
    model.clear()
    model.send_keys(HOSTILE_MODEL)
    by_id(driver, "explain-button").click()
    wait(driver, lambda d: hostile.peer_id in by_id(d, "explain-out").text)
    out = by_id(driver, "explain-out").text
    assert 'gate[4] match [region(got="",want="eu-west")=1]' in out
    assert f"Chosen: {hostile.peer_id} (step anywhere)" in out and HOSTILE_MACHINE in out
    assert driver.find_elements(By.CSS_SELECTOR, "#explain-out img, #explain-out b") == []
    shoot(driver, "explain-fallback")

    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    key = create_key(driver, "ci-key", "acme")
    client = {"Authorization": f"Bearer {key}"}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, headers=client, timeout=20)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=tenants]").click()
    wait(driver, lambda d: "acme" in by_id(d, "tenants-table").text)
    shoot(driver, "tenants")

    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=requests]").click()
    wait(driver, lambda d: rid in rows(d, "requests-table", "id"))
    in_table(driver, f"#requests-table tr[data-id='{rid}']", lambda e: e.click())
    wait(driver, lambda d: f"req={rid}" in by_id(d, "story").text)
    assert (
        f"req={rid} step_selected step=routing_policy peer={joined.peer_id}"
        in by_id(driver, "story").text
    )
    row = in_table(driver, f"#requests-table tr[data-id='{rid}']", lambda e: e.text)
    assert joined.peer_id in row and "200" in row
    shoot(driver, "requests")

    # Revoke the key: the router refuses it from then on.
    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=keys]").click()
    wait(driver, lambda d: "ci-key" in rows(d, "keys-table", "key"))
    shoot(driver, "keys")
    in_table(driver, "#keys-table tr[data-key='ci-key'] .revoke", lambda e: e.click())
    driver.switch_to.alert.accept()
    wait(driver, lambda d: "ci-key" not in rows(d, "keys-table", "key"))
    r = httpx.post(router.url + "/v1/chat/completions", json=body, headers=client, timeout=20)
    assert r.status_code == 401

    # The agent leaves: its row goes.
    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=fleet]").click()
    joined.stop()
    wait(driver, lambda d: "unregistered" in by_id(d, "fleet-events").text, 20)
    wait(driver, lambda d: joined.peer_id not in rows(d, "fleet-table", "peer"), 20)
    assert driver.execute_script("return window.sameDocument") is True

    # Policy: validate shows the diff; only then can it be applied.
    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=policy]").click()
    wait(driver, lambda d: by_id(d, "policy-current").text.strip() == POLICY.strip())
    text = by_id(driver, "policy-text")
    text.clear()
    text.send_keys(NEW_POLICY)
    assert not by_id(driver, "policy-apply").is_enabled()
    by_id(driver, "policy-validate").click()
    wait(driver, lambda d: "+  strategy: round-robin" in by_id(d, "policy-diff").text)
    assert "-fallback_chain:" in by_id(driver, "policy-diff").text
    shoot(driver, "policy")
    by_id(driver, "policy-apply").click()
    wait(driver, lambda d: "Applied" in by_id(d, "policy-status").text)
    running = httpx.get(
        router.url + "/admin/policy", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    assert running.text == NEW_POLICY
    Select(by_id(driver, "explain-path"))  # the form is still there after the tab switches

    # With --state-url, the whole fleet: the hostile agent is held by both routers.
    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=fleet]").click()
    by_id(driver, "fleet-scope").click()

    def held_by_both(d: Any) -> bool:
        # Read in one script: the rows are rebuilt on every refresh.
        held = d.execute_script(
            "const r = document.querySelector(`tr[data-peer='${arguments[0]}']`);"
            "return r ? r.lastElementChild.textContent : ''",
            hostile.peer_id,
        )
        return router.peer_id[-8:] in held and other.peer_id[-8:] in held

    wait(driver, held_by_both, 20)
    assert HOSTILE_MODEL in by_id(driver, "fleet-table").text
    assert driver.execute_script("return window.pwned") is None
    shoot(driver, "fleet-scope")

    by_id(driver, "logout").click()
    assert driver.execute_script("return sessionStorage.length") == 0
    assert by_id(driver, "login").is_displayed()


def create_key(driver: Any, key_id: str, owner: str) -> str:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, "#tabs [data-view=keys]").click()
    wait(driver, lambda d: by_id(d, "key-form").is_displayed())
    by_id(driver, "key-id").send_keys(key_id)
    by_id(driver, "key-owner").send_keys(owner)
    by_id(driver, "key-create").click()
    wait(driver, lambda d: by_id(d, "key-raw").text.startswith("sk-"))
    wait(driver, lambda d: key_id in rows(d, "keys-table", "key"))
    return str(by_id(driver, "key-raw").text)


def test_csp_refuses_inline_script(browser: Any, fleet: tuple[Fleet, Router, Router]) -> None:
    _, router, _ = fleet
    driver = browser
    login(driver, router)  # the console's own script runs
    driver.execute_script(
        "const s = document.createElement('script');"
        "s.textContent = 'window.inlineRan = true';"
        "document.body.appendChild(s);"
        "const i = document.createElement('img');"
        "i.setAttribute('src', 'data:,x'); i.setAttribute('onerror', 'window.inlineRan = true');"
        "document.body.appendChild(i);"
    )
    logs = wait(
        driver, lambda d: [e for e in d.get_log("browser") if "Content Security" in e["message"]]
    )
    assert driver.execute_script("return window.inlineRan") is None
    assert any("script-src 'self'" in e["message"] for e in logs), logs


class _Framer(BaseHTTPRequestHandler):
    target = ""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = f'<!doctype html><iframe id="f" src="{self.target}/ui"></iframe>'.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_the_console_cannot_be_framed(browser: Any, fleet: tuple[Fleet, Router, Router]) -> None:
    from selenium.webdriver.common.by import By

    _, router, _ = fleet
    _Framer.target = router.url.replace("127.0.0.1", "localhost")  # another origin
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Framer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        driver = browser
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
        logs = wait(
            driver, lambda d: [e for e in d.get_log("browser") if "frame-ancestors" in e["message"]]
        )
        assert logs
        driver.switch_to.frame(driver.find_element(By.ID, "f"))
        assert driver.find_elements(By.ID, "login-form") == []
    finally:
        server.shutdown()
        server.server_close()
