"""The web page at / for real: Debian's chromium, headless, driven through
chromedriver by selenium, against a `ggml-coordinator serve` process with an
API key and two real worker daemons on 127.0.0.1. The page loads with no
console error and no request leaving this server, a chat streams its tokens
onto the page as they come, and a worker killed with SIGKILL shows failed on
the page within 2 s and recovered once it is restarted on its port.

Without chromium, chromedriver or selenium the browser tests are skipped,
unless $CI is set: then they fail (CI must not skip them silently; .ci/run
installs the browser). With $GGML_SCREENSHOT_DIR set, the chat mid-stream and
the cluster with a failed worker are saved there as PNG (docs/images/).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time

import aiohttp
import pytest

from conftest import SLACK, DaemonProcess
from http_helpers import Serve
from test_http_openai import call

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,900")
KEY = "web-page-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCREENSHOTS = os.environ.get("GGML_SCREENSHOT_DIR")


def browser_or_skip() -> None:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = (f"needs {', '.join(missing)} (apt-get install chromium chromium-driver; "
                  f"pip install -e '.[test]')")
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: under CI this test must run, not be skipped")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workers = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
    # the layer split, whose view (each worker a range of layers, a share of the head) the tests check
    server = Serve(str(tmp_path_factory.mktemp("serve")), "--endpoints", ",".join(w.endpoint for w in workers),
                   "--parallel", "2", "--ctx-per-slot", "256", "--split-mode", "layer",
                   env={"GGML_COORDINATOR_API_KEY": KEY})
    yield server, workers
    server.stop()
    for w in workers:
        w.stop()
        w.kill()
    assert server.proc.returncode == 0, server.text()[-2000:]


def wait_for(driver, condition, timeout: float, what: str):
    """`condition` true within `timeout` seconds (times SLACK); `what` names it if not."""
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout * SLACK, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def row_state(driver, endpoint: str) -> str | None:
    rows = driver.find_elements("css selector", f'#workers tr[data-endpoint="{endpoint}"]')
    return rows[0].get_attribute("data-state") if rows else None


def open_page(driver, server) -> None:
    """The page, loaded afresh, given the API key if it asks (each test on its own)."""
    driver.get(server.url + "/")
    wait_for(driver, lambda d: d.execute_script("return document.readyState") == "complete", 10, "the page loads")
    if driver.find_element("id", "key-form").is_displayed():
        driver.find_element("id", "key-input").send_keys(KEY)
        driver.find_element("css selector", "#key-form button").click()


def js_number(x) -> str:
    """`x` as JavaScript's String(x) writes it (6.0 is "6")."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def text_of(driver, css: str) -> str | None:
    """The text of the first element `css` selects, read at once in the page
    (the view re-renders its cells' contents twice a second)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e && e.textContent", css)


def requested_urls(driver, page_url: str) -> list[str]:
    """Every URL asked for since the last call (DevTools' network events) by
    `page_url`'s documents, and every network URL asked for by anything (the
    browser's own chrome:// pages are not network)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if message["params"].get("documentURL", "").startswith(page_url) or \
                    url.split(":", 1)[0] in ("http", "https", "ws", "wss", "ftp"):
                urls.append(url)
    return urls


def assert_clean(driver, page_url: str) -> list[str]:
    """No console error, and no request anywhere but `page_url` since the last
    requested_urls(); the URLs requested."""
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    urls = requested_urls(driver, page_url)
    outside = [u for u in urls if not (u.startswith(page_url + "/") or u.startswith("data:"))]
    assert not outside, outside
    return urls


def test_cluster_json_and_the_key_guarding_it(cluster):
    server, workers = cluster
    for path in ("/cluster", "/cluster/events"):
        status, headers, body = asyncio.run(call("GET", server.url + path))
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, body)
    # the page and its assets are open, and hold no secret
    for path in ("/", "/web/app.js", "/web/style.css"):
        status, headers, body = asyncio.run(call("GET", server.url + path))
        assert status == 200 and KEY not in body, path
        assert "connect-src 'self'" in headers["Content-Security-Policy"]
    status, _, body = asyncio.run(call("GET", server.url + "/cluster", headers=AUTH))
    assert status == 200 and body["status"] == "ok" and body["model"] == server.model, body
    assert [w["endpoint"] for w in body["workers"]] == [w.endpoint for w in workers]
    first, second = body["workers"]
    assert first["layers"][0] == 0 and first["layers"][1] == second["layers"][0]
    assert second["layers"][1] == body["n_layer"]
    assert abs(first["head_share"] + second["head_share"] - 1) < 1e-3
    for w in body["workers"]:
        assert w["state"] == "ok" and w["failure"] is None
        assert w["ping"]["rtt_seconds"] > 0 and w["ping"]["age_seconds"] < 5 * SLACK, w
        assert w["memory"]["total_bytes"] >= w["memory"]["free_bytes"] > 0, w

    async def first_events():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(server.url + "/cluster/events", headers=AUTH) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                kinds, snapshots = [], []
                async for line in r.content:
                    if line.startswith(b"event: "):
                        kinds.append(line[7:].strip().decode())
                    elif line.startswith(b"data: ") and kinds[-1] == "snapshot":
                        snapshots.append(json.loads(line[6:]))
                        if len(snapshots) == 2:
                            return snapshots

    snapshots = asyncio.run(first_events())
    # at least one a second, so ages move on
    assert snapshots[1]["time"] - snapshots[0]["time"] <= 1.5 * SLACK, [s["time"] for s in snapshots]


def test_page_loads_asks_for_the_key_and_stays_on_this_server(browser, cluster):
    server, workers = cluster
    requested_urls(browser, server.url)  # what the browser did before: not the page's
    browser.get(server.url + "/")
    key_form = browser.find_element("id", "key-form")
    wait_for(browser, lambda d: key_form.is_displayed(), 10, "the page asks for the API key")
    browser.find_element("id", "key-input").send_keys(KEY)
    browser.find_element("css selector", "#key-form button").click()
    for w in workers:
        wait_for(browser, lambda d, e=w.endpoint: row_state(d, e) == "ok", 15, f"{w.endpoint} shown ok")
    # a figure with its unit: a round trip on loopback may be well under a millisecond
    wait_for(browser, lambda d: re.search(r"\d (µs|ms|s)\b", text_of(d, "#workers tbody tr .col-ping")), 10,
             "a ping round trip shown")
    assert text_of(browser, "#status") == "ok"
    assert text_of(browser, "#split") == "layer split"  # asked for: no figures
    urls = assert_clean(browser, server.url)
    assert any(u.endswith("/web/app.js") for u in urls) and any(u.endswith("/cluster/events") for u in urls), urls


def test_chat_streams_tokens_onto_the_page(browser, cluster):
    server, _ = cluster
    open_page(browser, server)
    # every change of the answer's text, as the browser renders it: (ms, length)
    browser.execute_script("""
        window.__growth = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('#messages .msg.assistant .text');
            const last = answers[answers.length - 1];
            if (last) window.__growth.push([performance.now(), last.textContent.length]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    """)
    browser.find_element("id", "max-tokens").send_keys("40")
    temperature = browser.find_element("id", "temperature")
    temperature.clear()
    temperature.send_keys("0")
    browser.find_element("id", "prompt").send_keys("The capital of France is")
    browser.find_element("id", "send").click()
    answer = wait_for(browser, lambda d: d.find_elements("css selector", "#messages .msg.assistant"), 10,
                      "an answer bubble")[-1]
    if SCREENSHOTS:
        wait_for(browser, lambda d: len(answer.find_element("css selector", ".text").text) > 40, 120,
                 "some text to show")
        browser.save_screenshot(os.path.join(SCREENSHOTS, "web-chat-streaming.png"))
    wait_for(browser, lambda d: answer.get_attribute("data-state") in ("done", "error"), 120, "the answer ends")
    assert answer.get_attribute("data-state") == "done", answer.text
    text = answer.find_element("css selector", ".text").text
    lengths = [n for _, n in browser.execute_script("return window.__growth")]
    partial = sorted({n for n in lengths if 0 < n < len(text)})
    # the text grew piece by piece while the answer streamed, not all at once at the end
    assert len(partial) >= 5, lengths
    assert lengths == sorted(lengths) and text.strip(), (lengths, text)
    assert browser.find_element("id", "send").is_enabled()


def test_killed_worker_shows_failed_within_2s_then_recovered(browser, cluster):
    server, workers = cluster
    victim = workers[1]
    open_page(browser, server)
    for w in workers:
        wait_for(browser, lambda d, e=w.endpoint: row_state(d, e) == "ok", 15, f"{w.endpoint} shown ok")
    killed_at = time.monotonic()
    victim.kill()  # SIGKILL
    try:
        wait_for(browser, lambda d: row_state(d, victim.endpoint) == "failed", 2.0,
                 f"{victim.endpoint} shown failed within 2 s of its SIGKILL")
        shown_after = time.monotonic() - killed_at
        cause = text_of(browser, f'#workers tr[data-detail-for="{victim.endpoint}"] .cause')
        assert victim.endpoint in cause, cause
        event = wait_for(browser, lambda d: d.find_elements(
            "css selector", f'#events li[data-kind="failed"][data-endpoint="{victim.endpoint}"]'), 2, "a failed event")
        assert victim.endpoint in event[0].text
        assert row_state(browser, workers[0].endpoint) == "ok"
        # what was measured before the failure is shown with its age, not as live
        memory = text_of(browser, f'#workers tr[data-endpoint="{victim.endpoint}"] .col-memory')
        assert "ago" in memory, memory
        status, _, body = asyncio.run(call("GET", server.url + "/cluster", headers=AUTH))
        failed = body["workers"][1]
        assert status == 200 and body["status"] == "resuming" and failed["state"] == "failed", body  # serve resumes by default
        # the page's cause and the JSON's name the worker as docs/failure-semantics.md lists it for a killed
        # worker ("worker H:P closed the connection …", by FIN or by RST); the cause moves on with each
        # reconnect attempt ("worker H:P unreachable: connection refused")
        named = re.compile(rf"^worker {re.escape(victim.endpoint)} ")
        assert named.match(cause), cause
        assert named.match(failed["failure"]["cause"]), failed
        assert failed["failure"]["kind"] in ("closed", "unreachable"), failed
        assert failed["compute_busy"] is None and failed["step_rtt"] is None, failed
        # the server retries it (1 s, then 2 s, ...): the first attempt finds nobody, and says so
        wait_for(browser, lambda d: d.find_elements(
            "css selector", f'#events li[data-kind="reconnect_failed"][data-endpoint="{victim.endpoint}"]'), 10,
            "a failed reconnect attempt")
        # resuming retries every 0.05-0.25 s: one attempt or several may have failed by now
        detail = text_of(browser, f'#workers tr[data-detail-for="{victim.endpoint}"]')
        assert re.search(r"\b[1-9]\d* reconnect attempts? failed\b", detail), detail
        if SCREENSHOTS:
            browser.save_screenshot(os.path.join(SCREENSHOTS, "web-cluster-worker-failed.png"))
    finally:  # the next tests need the worker back, whatever failed here
        workers[1] = DaemonProcess("-t", "1", port=victim.port)
    wait_for(browser, lambda d: row_state(d, victim.endpoint) == "ok", 60, f"{victim.endpoint} shown recovered")
    wait_for(browser, lambda d: d.find_elements(
        "css selector", f'#events li[data-kind="recovered"][data-endpoint="{victim.endpoint}"]'), 5,
        "a recovered event")
    status, _, body = asyncio.run(call("GET", server.url + "/cluster", headers=AUTH))
    kinds = [e["kind"] for e in body["events"] if e["endpoint"] == victim.endpoint]
    assert kinds[0] == "failed" and "reconnect_failed" in kinds and kinds[-1] == "recovered", body["events"]
    assert body["reconnects"] >= 1 and body["status"] == "ok"
    print(f"failure shown {shown_after:.2f} s after SIGKILL")


def test_stopped_worker_never_hangs_the_view(browser, cluster):
    """A worker that stops answering (SIGSTOP) hangs no probe: the view keeps
    answering, shows it failed once the liveness pings give up on it, and
    recovered after SIGCONT."""
    import signal

    server, workers = cluster
    victim = workers[0]
    open_page(browser, server)
    wait_for(browser, lambda d: all(row_state(d, w.endpoint) == "ok" for w in workers), 60, "every worker ok")
    victim.signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15 * SLACK
        failed = None
        while time.monotonic() < deadline and failed is None:
            # each answer within the client's 10 s bound, stopped worker or not
            status, _, body = asyncio.run(call("GET", server.url + "/cluster", headers=AUTH, timeout=10))
            assert status == 200, body
            failed = next((w for w in body["workers"] if w["endpoint"] == victim.endpoint and w["failure"]), None)
            time.sleep(0.2)
        assert failed is not None and failed["failure"]["kind"] == "timeout", body
        wait_for(browser, lambda d: row_state(d, victim.endpoint) == "failed", 2, "the stopped worker shown failed")
    finally:
        victim.signal(signal.SIGCONT)
    wait_for(browser, lambda d: row_state(d, victim.endpoint) == "ok", 60, f"{victim.endpoint} shown recovered")


def test_page_without_a_key(browser, tmp_path):
    """The default: no --api-key, no key form, the cluster shown at once (local workers)."""
    server = Serve(str(tmp_path), "--parallel", "1", "--ctx-per-slot", "64")
    try:
        requested_urls(browser, server.url)
        browser.get(server.url + "/")
        wait_for(browser, lambda d: len(d.find_elements("css selector", '#workers tr[data-state="ok"]')) == 2, 15,
                 "both local workers shown ok")
        assert not browser.find_element("id", "key-form").is_displayed()
        assert text_of(browser, "#model") == server.model
        # the split auto chose, and the figures it chose by (as /cluster has them)
        _, _, body = asyncio.run(call("GET", server.url + "/cluster"))
        choice = body["split_choice"]
        assert choice["asked"] == "auto" and choice["chosen"] == body["split_mode"], choice
        sums = f", {choice['sums']} sums" if "sums" in choice else ""
        cost, saved = (js_number(choice[k]) for k in ("exchanges_ms_per_token", "compute_saved_ms_per_token"))
        assert text_of(browser, "#split") == (
            f"{body['split_mode']} split (auto: {cost} ms of exchanges a token against {saved} ms saved{sums})"), \
            text_of(browser, "#split")
        assert_clean(browser, server.url)
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.text()[-2000:]


def test_the_tensor_split_shows_each_workers_shard_and_its_sums(browser, tmp_path):
    """A tensor split's plan on the page: each worker's row names its shard (rank, heads with the one KV
    head copied, FFN rows, vocabulary rows) and its output rows with exact sums, the default here."""
    workers = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
    server = Serve(str(tmp_path), "--endpoints", ",".join(w.endpoint for w in workers), "--parallel", "1",
                   "--ctx-per-slot", "128", "--split-mode", "tensor", env={"GGML_COORDINATOR_API_KEY": KEY})
    try:
        status, _, body = asyncio.run(call("GET", server.url + "/cluster", headers=AUTH))
        assert status == 200 and body["split_mode"] == "tensor", body
        out_rows = [w["shard"]["out_rows"] for w in body["workers"]]
        assert out_rows[0][0] == 0 and out_rows[0][1] == out_rows[1][0], out_rows
        # an earlier test's page, its server gone, retries its event stream and logs each refusal: leave it,
        # and forget what it logged, so what assert_clean sees is this page's alone
        browser.get("about:blank")
        browser.get_log("browser")
        requested_urls(browser, server.url)
        open_page(browser, server)
        for rank, w in enumerate(workers):
            css = f'#workers tr[data-endpoint="{w.endpoint}"] td:nth-child(3)'
            wait_for(browser, lambda d: "exact sums" in (text_of(d, css) or ""), 10, f"worker {rank}'s shard shown")
            text = text_of(browser, css)
            lo, hi = out_rows[rank]
            assert text.startswith(f"all, shard {rank + 1}/2: heads ") and "(KV copied)" in text, text
            assert text.endswith(f", output rows {lo}–{hi - 1} (exact sums)"), text
        assert text_of(browser, "#split") == "tensor split (asked, exact sums)"
        assert_clean(browser, server.url)
    finally:
        server.stop()
        for w in workers:
            w.stop()
            w.kill()
    assert server.proc.returncode == 0, server.text()[-2000:]
