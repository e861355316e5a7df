"""GET /keyboard: the page and its assets over HTTP, and the page itself typed into key by key in headless
Chromium (the system's `chromium`, driven by playwright; `make test` installs both) against a real server.

The screenshot of the page after a run is kept in tests/artifacts/ (gitignored); its path is printed.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from server.settings import Settings

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
SUGGEST_WITHIN_MS = 2000
# An answer for the current text: the bar shows the suggestions for the cursor as it is now.
CURRENT = "() => { const s = adaptlmKeyboard.snapshot(); return s.shown !== null && s.shown.context === s.context; }"


# -- over HTTP --------------------------------------------------------------------------------------------


def test_page_and_assets(client: httpx.Client, assert_error: Any) -> None:
    page = client.get("/keyboard")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assets = re.findall(r'(?:src|href)="(keyboard/[^"]+)"', page.text)
    assert sorted(assets) == ["keyboard/keyboard.css", "keyboard/keyboard.js"]
    for asset, media_type in (("keyboard/keyboard.js", "text/javascript"), ("keyboard/keyboard.css", "text/css")):
        r = client.get(f"/{asset}")
        assert r.status_code == 200 and r.headers["content-type"] == f"{media_type}; charset=utf-8" and r.text
    assert "SUGGEST_MAX_CONTEXT = 2048" in client.get("/keyboard/keyboard.js").text  # adaptlm_client.protocol's
    assert_error(client.get("/keyboard/index.html"), 404, "not_found_error", "asset")
    assert_error(client.get("/keyboard/app.js"), 404, "not_found_error", "asset")
    assert not any(path.startswith("/keyboard") for path in client.get("/openapi.json").json()["paths"])
    # the page runs only its own script, talks only to its origin, is not framed elsewhere and sends no Referer
    csp = {d.split()[0]: d.split()[1:] for d in page.headers["content-security-policy"].split("; ")}
    assert csp["default-src"] == ["'none'"] and csp["script-src"] == ["'self'"] and csp["connect-src"] == ["'self'"]
    assert csp["frame-ancestors"] == ["'none'"] and page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["referrer-policy"] == "no-referrer"


def test_suggest_max_context_matches_the_protocol() -> None:
    from server.protocol import SUGGEST_MAX_CONTEXT
    from server.routes.keyboard import STATIC_DIR

    assert f"const SUGGEST_MAX_CONTEXT = {SUGGEST_MAX_CONTEXT};" in (STATIC_DIR / "keyboard.js").read_text()


# -- in the browser ---------------------------------------------------------------------------------------


def _chromium() -> str:
    found = "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else shutil.which("chromium")
    if found is None:
        pytest.fail("chromium is not installed, and the keyboard page is tested in it: run `make test` (it "
                    "installs the system package), or `apt-get install chromium`", pytrace=False)
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # The system browser: `playwright install` downloads one of its own, which this project never does.
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 820, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, errors


def snapshot(page: Page) -> dict[str, Any]:
    return dict(page.evaluate("adaptlmKeyboard.snapshot()"))


def type_keys(page: Page, keys: str) -> list[float]:
    """Types `keys` one by one, waiting after each for the suggestions for the text as it is now -> their
    latencies in ms (each within SUGGEST_WITHIN_MS, or the wait fails)."""
    latencies = []
    for key in keys:
        start = time.perf_counter()
        page.keyboard.press("Enter" if key == "\n" else key)
        page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
        latencies.append(1000 * (time.perf_counter() - start))
    return latencies


def open_keyboard(page: Page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-state=ready]", timeout=10_000)
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)  # the first word's suggestions
    page.click("#text")


@pytest.fixture(scope="module")
def copy_live(copy_checkpoint: Path, serve_app: Any) -> Iterator[Any]:
    """A checkpoint whose sessions have a copy model, as `make serve`'s: the twin must turn it off to be unadapted."""
    with serve_app(Settings(checkpoint=copy_checkpoint, suggest_budget_ms=0)) as server:
        yield server


def test_typing_accepting_and_committing(copy_live: Any, page: Page) -> None:
    open_keyboard(page, f"{copy_live.url}/keyboard")
    assert snapshot(page)["shown"]["words"], "no suggestions for the first word"

    latencies = type_keys(page, "It is a truth univ")
    shown = snapshot(page)["shown"]
    assert shown["prefix"] == "univ" and shown["context"] == "It is a truth univ"
    assert 1 <= len(shown["words"]) <= 3 and all(w.startswith("univ") and len(w) > 4 for w in shown["words"])
    assert page.locator("#bar button.word:not([disabled])").count() == len(shown["words"])

    # Tab accepts the first: it replaces the typed part of the word and adds a space.
    page.keyboard.press("Tab")
    assert page.input_value("#text") == f"It is a truth {shown['words'][0]} "
    saved = len(shown["words"][0]) - len("univ")
    assert snapshot(page)["saved"] == saved and page.text_content("#saved") == str(saved)
    assert page.text_content("#ksr") != "0.0%"

    # A click on the second of the next suggestions.
    latencies += type_keys(page, "ac")
    words = snapshot(page)["shown"]["words"]
    assert len(words) >= 2
    page.click("#bar button.word[data-rank='1']")
    value = page.input_value("#text")
    assert value.endswith(f" {words[1]} ") and page.evaluate("document.activeElement.id") == "text"
    saved += len(words[1]) - len("ac")
    assert snapshot(page)["saved"] == saved

    # Sentence end and a space commit the sentence: one point, adapted and unadapted.
    assert page.get_attribute("#chart", "data-points") == "0"
    latencies += type_keys(page, "man. ")
    page.wait_for_selector("#chart[data-points='1']", timeout=5000)
    state = snapshot(page)
    assert state["committed"] == value + "man. " and state["context"] == ""
    # Then Enter commits the line.
    latencies += type_keys(page, "She was not\n")
    page.wait_for_selector("#chart[data-points='2']", timeout=5000)
    state = snapshot(page)
    assert state["committed"] == value + "man. She was not\n"
    series = state["series"]
    assert series["chars"] == [len(value) + 5, len("She was not\n")]
    for adapted, static, twin in zip(series["adapted"], series["static"], series["twin"], strict=True):
        assert 0 < adapted < 16 and 0 < static < 16
        # The unadapted twin (lr 0, no caches, no copy model) is the static model: its bits are observe's static bits.
        assert math.isclose(twin, static, rel_tol=1e-4)
    assert page.text_content("#commits") == "2" and page.text_content("#bpc-adapted").endswith("bpc")
    total = len(page.input_value("#text"))
    assert page.text_content("#ksr") == f"{100 * saved / total:.1f}%"

    # The unadapted model's suggestions beside the adapted ones.
    assert page.is_hidden("#bar-static")
    page.check("#compare")
    page.focus("#text")
    page.keyboard.press("Control+End")
    latencies += type_keys(page, "Th")
    assert page.is_visible("#bar-static") and snapshot(page)["shown"]["wordsStatic"]
    assert page.locator("#bar-static button.word:not([disabled])").count() >= 1

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "keyboard.png"
    page.screenshot(path=str(shot), full_page=True)
    median = sorted(latencies)[len(latencies) // 2]
    print(f"\nkeyboard screenshot: {shot}; suggestions {median:.0f} ms (median), {max(latencies):.0f} ms (max) "
          f"after a keystroke, over {len(latencies)} keys")


def test_fast_typing_shows_the_latest_answer(live: Any, page: Page) -> None:
    open_keyboard(page, f"{live.url}/keyboard")
    page.keyboard.type("It was the best of times, it was the wor")  # no waiting: older answers are dropped
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
    shown = snapshot(page)["shown"]
    assert shown["context"] == "It was the best of times, it was the wor" and shown["prefix"] == "wor"
    assert all(w.startswith("wor") for w in shown["words"])


def test_api_key(tiny_checkpoint: Path, serve_app: Any, page: Page) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, api_keys="key-one")  # type: ignore[arg-type]
    with serve_app(settings) as live:
        assert httpx.get(f"{live.url}/keyboard").status_code == 200  # the page itself needs no key
        page.goto(f"{live.url}/keyboard")
        page.wait_for_selector("body[data-state=error]", timeout=10_000)
        assert "API key" in page.text_content("#status")
        page.fill("#key", "key-one")
        page.click("#key-form button[type=submit]")
        page.wait_for_selector("body[data-state=ready]", timeout=10_000)
        page.click("#text")
        type_keys(page, "It is a tr")
        assert snapshot(page)["shown"]["prefix"] == "tr"
        # ?key= in the address does the same.
        page.goto(f"{live.url}/keyboard?key=key-one")
        page.wait_for_selector("body[data-state=ready]", timeout=10_000)
        assert page.input_value("#key") == "key-one"
        assert "key-one" not in page.url  # taken out of the address bar (and the history)


@contextlib.contextmanager
def other_origin(tmp_path: Path) -> Iterator[str]:
    """A page served from another origin (a static server on another loopback port), as a keyboard web app of one's
    own would be -> its origin."""
    (tmp_path / "index.html").write_text("<!doctype html><title>an app</title>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}"
        finally:
            httpd.shutdown()


CALL_FROM_PAGE = """async (url) => {
  try {
    const r = await fetch(url + "/v1/sessions", {method: "POST", headers: {"Authorization": "Bearer key-one",
                                                  "Content-Type": "application/json"}, body: "{}"});
    return {status: r.status, id: r.headers.get("X-Request-ID"), session: (await r.json()).id};
  } catch (e) {
    return {error: String(e)};
  }
}"""


def test_a_page_of_a_configured_origin_calls_the_api(tiny_checkpoint: Path, serve_app: Any, page: Page,
                                                     tmp_path: Path) -> None:
    # Chromium enforces CORS: with the app's origin in ADAPTLM_CORS_ORIGINS its fetch (a preflighted POST with a
    # key) gets the answer and may read X-Request-ID; with the default settings the browser blocks it
    with other_origin(tmp_path) as origin:
        page.goto(f"{origin}/index.html")
        settings = Settings(checkpoint=tiny_checkpoint, api_keys="key-one", cors_origins=origin)  # type: ignore[arg-type]
        with serve_app(settings) as live:
            got = page.evaluate(CALL_FROM_PAGE, live.url)
            assert got.get("status") == 201 and got["session"] and re.fullmatch(r"[0-9a-f]{32}", got["id"]), got
        with serve_app(Settings(checkpoint=tiny_checkpoint, api_keys="key-one")) as live:  # type: ignore[arg-type]
            blocked = page.evaluate(CALL_FROM_PAGE, live.url)
            assert "error" in blocked and "fetch" in blocked["error"].lower(), blocked


# -- what a typist meets: edits, a server that forgets, restarts or is slow ---------------------------------


def read_by(url: str, session_id: str) -> int:
    """Every UTF-8 byte the session has read."""
    stats = httpx.get(f"{url}/v1/sessions/{session_id}").json()["stats"]
    return int(stats["bytes_observed"] + stats["pending_bytes"])


def test_sessions_the_server_lost_are_made_again(live: Any, page: Page) -> None:
    # Expired (an hour idle), evicted, or a restart without a snapshot: the page's sessions are gone. It makes new
    # ones, which read the committed text again, rather than answering every keystroke with a 404 until a reload.
    open_keyboard(page, f"{live.url}/keyboard")
    type_keys(page, "It is a truth. ")
    page.wait_for_selector("#chart[data-points='1']", timeout=5000)
    old = snapshot(page)["sessions"]
    for session_id in old.values():
        assert httpx.delete(f"{live.url}/v1/sessions/{session_id}").status_code == 204
    page.keyboard.type("It was")
    page.wait_for_function(CURRENT, timeout=10_000)
    state = snapshot(page)
    assert state["sessions"]["adapted"] not in old.values() and state["sessions"]["twin"] not in old.values()
    assert state["shown"]["prefix"] == "was" and page.get_attribute("body", "data-state") == "ready"
    page.wait_for_selector("#chart[data-points='1']", timeout=5000)
    for session_id in state["sessions"].values():
        assert read_by(live.url, session_id) == len("It is a truth. ")


def test_a_session_made_for_a_connect_that_failed_is_deleted(live: Any, page: Page) -> None:
    # The twin refused (here a 500): the page cannot use the adapted session made beside it, and deletes it rather
    # than leaving it in the store until its TTL (each retry of Connect would leave one more).
    made: list[str] = []
    page.on("response", lambda r: made.append(r.json()["id"])
            if r.request.method == "POST" and r.url.endswith("/v1/sessions") and r.status == 201 else None)
    page.route("**/v1/sessions", lambda route: route.fulfill(
        status=500, content_type="application/json",
        body='{"error": {"message": "boom", "type": "internal_error", "param": null, "code": null}}')
        if '"lr":0' in (route.request.post_data or "") else route.continue_())
    page.goto(f"{live.url}/keyboard")
    page.wait_for_selector("body[data-state=error]", timeout=10_000)
    # the adapted session's answer may reach this side after the error state does (playwright hands the test its
    # events while it waits): wait for it, events pumped
    deadline = time.monotonic() + 5
    while not made:
        assert time.monotonic() < deadline, "the adapted session was never made"
        page.wait_for_timeout(50)
    assert len(made) == 1 and snapshot(page)["sessions"]["adapted"] is None
    deadline = time.monotonic() + 5
    while httpx.get(f"{live.url}/v1/sessions/{made[0]}").status_code != 404:
        assert time.monotonic() < deadline, "the session made for the failed connect was left in the store"
        time.sleep(0.05)


def test_a_failed_suggestion_leaves_no_stale_bar(live: Any, page: Page) -> None:
    # The bar of an older keystroke cannot be accepted; shown after an error, it swallowed Tab for good (a keyboard
    # trap: focus could not leave the text box).
    open_keyboard(page, f"{live.url}/keyboard")
    type_keys(page, "It is")
    page.route("**/suggest", lambda route: route.fulfill(
        status=500, content_type="application/json",
        body='{"error": {"message": "boom", "type": "internal_error", "param": null, "code": null}}'))
    page.keyboard.type(" a")
    page.wait_for_selector("body[data-state=error]", timeout=5000)
    assert page.locator("#bar button.word:not([disabled])").count() == 0 and snapshot(page)["shown"] is None
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") != "text"


SLOW_OBSERVE = """(() => {
  const real = window.fetch.bind(window);
  window.fetch = async (url, init) => {
    if (String(url).endsWith("/observe")) await new Promise((resolve) => setTimeout(resolve, 400));
    return real(url, init);
  };
})();"""


def test_reset_forgets_the_sentences_still_being_sent(live: Any, page: Page) -> None:
    # A slow connection: Reset while commits are queued. The sessions must not read, after their reset, text that
    # the page has cleared.
    page.add_init_script(SLOW_OBSERVE)
    open_keyboard(page, f"{live.url}/keyboard")
    page.keyboard.type("One two three. Four five six. Seven eight. ")
    page.click("#reset")
    page.wait_for_function("() => adaptlmKeyboard.snapshot().shown?.context === ''", timeout=5000)
    page.wait_for_timeout(1500)  # what a queued commit would take to arrive
    assert page.input_value("#text") == "" and page.get_attribute("#chart", "data-points") == "0"
    for session_id in snapshot(page)["sessions"].values():
        assert read_by(live.url, session_id) == 0


def done_by_the_server(route: Any) -> None:
    """The request the page sent, made to the server from here (not `route.fetch()`: a route handler that calls it
    while the other session's handler runs sometimes fails with "Route is already handled!")."""
    request = route.request
    r = httpx.request(request.method, request.url, content=request.post_data_buffer,
                      headers={"content-type": "application/json"})
    assert r.status_code < 300, r.text


BUSY = '{"error": {"message": "busy", "type": "server_busy_error", "param": null, "code": null}}'


@pytest.mark.parametrize("failure", ["busy", "refused", "answer lost"])
def test_a_reset_without_an_answer_still_resets_the_sessions(live: Any, page: Page, failure: str) -> None:
    # Reset clears the page's count of what the sessions read: a reset refused as busy (nothing done), one that never
    # reached the server, or one whose answer was lost after the server did it, must leave the sessions reset all the
    # same (they kept the cleared text, unseen, and read the next sentences on top of it).
    open_keyboard(page, f"{live.url}/keyboard")
    type_keys(page, "Good morning. ")
    page.wait_for_selector("#chart[data-points='1']", timeout=5000)

    def fail(route: Any) -> None:
        if failure == "busy":
            route.fulfill(status=503, content_type="application/json", body=BUSY)
        elif failure == "refused":
            route.abort("connectionrefused")
        else:
            done_by_the_server(route)  # the server resets the session...
            route.abort("connectionreset")  # ...and its answer never arrives

    page.route("**/reset", fail, times=2)  # both sessions' resets, once
    page.click("#reset")
    page.wait_for_function("() => adaptlmKeyboard.snapshot().shown?.context === ''", timeout=5000)
    sessions = snapshot(page)["sessions"]
    deadline = time.monotonic() + 10
    while any(read_by(live.url, s) for s in sessions.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [read_by(live.url, s) for s in sessions.values()] == [0, 0]
    type_keys(page, "Hi. ")
    page.wait_for_selector("#chart[data-points='1']", timeout=10_000)
    assert snapshot(page)["sessions"] == sessions
    assert [read_by(live.url, s) for s in sessions.values()] == [len("Hi. ")] * 2
    assert page.get_attribute("body", "data-state") == "ready"


def test_a_commit_without_an_answer_is_read_once(live: Any, page: Page) -> None:
    # The server restarting (connection refused), then an answer lost after the server read the text (a proxy's
    # 502, a dropped connection): the page asks the session what it read, sends the first again and not the second.
    open_keyboard(page, f"{live.url}/keyboard")
    type_keys(page, "Good morning. ")
    page.wait_for_selector("#chart[data-points='1']", timeout=5000)
    down = {"refused": 0}

    def refuse(route: Any) -> None:
        down["refused"] += 1
        route.abort("connectionrefused")

    page.route("**/v1/**", refuse)
    page.keyboard.type("How are you? ")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('not answering')",
                           timeout=5000)
    page.unroute("**/v1/**")
    assert down["refused"] >= 2
    page.wait_for_selector("#chart[data-points='2']", timeout=10_000)

    def lose_the_answer(route: Any) -> None:
        done_by_the_server(route)  # the server reads the text...
        route.abort("connectionreset")  # ...and its answer never arrives

    page.route("**/observe", lose_the_answer, times=2)  # both sessions' observes
    page.keyboard.type("I am fine. ")
    page.wait_for_selector("#chart[data-points='3']", timeout=10_000)
    type_keys(page, "Th")
    state = snapshot(page)
    assert state["committed"] == "Good morning. How are you? I am fine. "
    for session_id in state["sessions"].values():
        assert read_by(live.url, session_id) == len(state["committed"])
    # the chart has the lost answer's bits, from the session's statistics: the twin still equals static_bits
    series = state["series"]
    assert series["chars"] == [14, 13, 11] and all(0 < b < 16 for b in series["adapted"])
    assert all(math.isclose(t, s, rel_tol=1e-4) for t, s in zip(series["twin"], series["static"], strict=True))


def test_a_commit_still_busy_after_the_retries_is_read_once(live: Any, page: Page) -> None:
    # 503 at every try (the retries spent): nothing was read, so the page, once the server answers, sends it again.
    open_keyboard(page, f"{live.url}/keyboard")
    page.route("**/observe", lambda route: route.fulfill(status=503, content_type="application/json", body=BUSY),
               times=6)  # both sessions, three tries each
    page.keyboard.type("Good morning. ")  # its suggestions wait for the commit
    page.wait_for_function("() => document.getElementById('status').textContent.includes('busy')", timeout=10_000)
    page.wait_for_selector("#chart[data-points='1']", timeout=15_000)
    for session_id in snapshot(page)["sessions"].values():
        assert read_by(live.url, session_id) == len("Good morning. ")


TWIN = {"lr": 0, "cache_weight": 0, "copy_model": False, "neural_cache": False}  # the page's unadapted twin


def test_a_commit_one_session_refuses_waits_for_the_other(live: Any, page: Page) -> None:
    # The adapted session's observe fails (a 500) while the twin's never reaches the server: the next commit must wait
    # for the twin's to be sent again, or the twin reads the sentences out of order.
    open_keyboard(page, f"{live.url}/keyboard")
    sessions = snapshot(page)["sessions"]

    def fail(route: Any) -> None:
        if sessions["adapted"] in route.request.url:
            route.fulfill(status=500, content_type="application/json",
                          body='{"error": {"message": "boom", "type": "internal_error", "param": null, "code": null}}')
        else:
            route.abort("connectionrefused")

    page.route("**/observe", fail, times=2)  # the first commit's two observes
    page.keyboard.type("One. Two. ")
    page.wait_for_function("() => adaptlmKeyboard.snapshot().committed === 'One. Two. '", timeout=5000)
    deadline = time.monotonic() + 10
    while read_by(live.url, sessions["twin"]) < len("One. Two. ") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert snapshot(page)["sessions"] == sessions
    assert read_by(live.url, sessions["twin"]) == len("One. Two. "), page.text_content("#status")
    assert read_by(live.url, sessions["adapted"]) == len("Two. ")  # the 500: not read
    # in order: the twin's state is that of a session that read "One. Two. "
    reference = httpx.post(f"{live.url}/v1/sessions", json={"adaptation": TWIN}).json()["id"]
    httpx.post(f"{live.url}/v1/sessions/{reference}/observe", json={"text": "One. Two. "}).raise_for_status()
    bits = [httpx.post(f"{live.url}/v1/score", json={"text": "Three.", "session_id": sid}).json()["bits"]
            for sid in (sessions["twin"], reference)]
    assert bits[0] == pytest.approx(bits[1], rel=1e-5)


def test_editing_a_committed_sentence_completes_the_word_at_the_cursor(live: Any, page: Page) -> None:
    open_keyboard(page, f"{live.url}/keyboard")
    type_keys(page, "Hello wrld. ")
    page.wait_for_selector("#chart[data-points='1']", timeout=5000)
    # The typo fixed: the cursor after "w", then "o". The word at the cursor is "wo", not "o".
    page.evaluate("() => document.getElementById('text').setSelectionRange(7, 7)")
    type_keys(page, "o")
    shown = snapshot(page)["shown"]
    assert shown["context"] == "Hello wo" and shown["prefix"] == "wo"
    # The sentence is read again whole when the next one ends, one point a sentence.
    page.keyboard.press("End")
    type_keys(page, "How are you? ")
    page.wait_for_selector("#chart[data-points='3']", timeout=5000)
    state = snapshot(page)
    assert state["committed"] == "Hello world. How are you? " and state["series"]["chars"] == [12, 13, 13]


def test_a_pasted_paragraph_is_a_point_a_sentence(live: Any, page: Page) -> None:
    open_keyboard(page, f"{live.url}/keyboard")
    page.keyboard.insert_text("It was the best of times. It was the worst of times! It was the age of")
    page.wait_for_selector("#chart[data-points='2']", timeout=5000)
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
    state = snapshot(page)
    assert state["series"]["chars"] == [len("It was the best of times. "), len("It was the worst of times! ")]
    assert state["context"] == "It was the age of"


def test_accepting_inside_a_word_replaces_the_whole_word(live: Any, page: Page) -> None:
    open_keyboard(page, f"{live.url}/keyboard")
    type_keys(page, "It is a truth unxversally")
    # back to the typo: the cursor after "un"
    page.evaluate("() => document.getElementById('text').setSelectionRange(16, 16)")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowLeft")
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
    shown = snapshot(page)["shown"]
    assert shown["prefix"] == "un" and shown["words"]
    page.keyboard.press("Tab")
    assert page.input_value("#text") == f"It is a truth {shown['words'][0]} "


def test_right_to_left_text_is_shown_right_to_left(live: Any, page: Page) -> None:
    open_keyboard(page, f"{live.url}/keyboard")
    page.keyboard.type("שלום")  # no key for it on the US layout: typed as text
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
    assert page.evaluate("getComputedStyle(document.getElementById('text')).direction") == "rtl"
    assert page.get_attribute("#bar button.word", "dir") == "auto"  # a suggestion's own direction


SLOW_SUGGEST = """(() => {
  const real = window.fetch.bind(window);
  window.suggestDelayMs = 0;
  window.fetch = async (url, init) => {
    if (String(url).endsWith("/suggest") && window.suggestDelayMs) {
      await new Promise((resolve) => setTimeout(resolve, window.suggestDelayMs));
    }
    return real(url, init);
  };
})();"""


def test_tab_right_after_a_letter_accepts_the_word_the_bar_still_fits(live: Any, page: Page) -> None:
    # A fast typist presses Tab before the answer to the last letter is back: the bar shown (one letter behind)
    # still offers the word, so Tab takes it, rather than doing nothing.
    page.add_init_script(SLOW_SUGGEST)
    open_keyboard(page, f"{live.url}/keyboard")
    type_keys(page, "It is a truth univ")
    word = snapshot(page)["shown"]["words"][0]  # longer than "univ" (test_typing_accepting_and_committing)
    page.evaluate("window.suggestDelayMs = 1500")
    page.keyboard.type(word[4])
    page.keyboard.press("Tab")
    assert page.input_value("#text") == f"It is a truth {word} "
    assert snapshot(page)["saved"] == len(word) - 5
    # a letter none of the bar's words goes on with: Tab takes none of them
    page.evaluate("window.suggestDelayMs = 0")
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
    words = snapshot(page)["shown"]["words"]
    letter = next(c for c in "qzxjkvwy" if not any(w.startswith(c) for w in words))
    page.evaluate("window.suggestDelayMs = 1500")
    page.keyboard.type(letter)
    page.keyboard.press("Tab")
    assert page.input_value("#text") == f"It is a truth {word} {letter}"


def test_a_word_after_a_mark_is_inserted_after_a_space(copy_live: Any, page: Page) -> None:
    # After "Hi," the bar offers the next word, inserted after a space (`space_before`), as a phone keyboard does: the
    # sessions' copy model has read "Hi, there." (and "Hi, you." "Hi, all.") often enough to expect the space.
    page.add_init_script(SLOW_SUGGEST)
    open_keyboard(page, f"{copy_live.url}/keyboard")
    page.keyboard.insert_text("Hi, there. Hi, you. Hi, all. " * 10)
    page.wait_for_selector("#chart[data-points='30']", timeout=30_000)
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
    type_keys(page, "Hi,")
    shown = snapshot(page)["shown"]
    word = shown["words"][0]
    assert shown["prefix"] == "" and shown["spaced"][0] and word in ("there", "you", "all"), shown
    assert page.get_attribute("#bar button.word[data-rank='0']", "data-space") == "1"
    before, saved = page.input_value("#text"), snapshot(page)["saved"]
    page.keyboard.press("Tab")
    assert page.input_value("#text") == f"{before} {word} "
    assert snapshot(page)["saved"] == saved + 1 + len(word)  # the space before it, the word, the space after, less Tab

    # A bar a keystroke behind: the space typed since is the one the word needed (not a second one).
    type_keys(page, "Hi,")
    before, words = page.input_value("#text"), snapshot(page)["shown"]["words"]
    page.evaluate("window.suggestDelayMs = 1500")
    page.keyboard.type(" ")
    page.keyboard.press("Tab")
    assert page.input_value("#text") == f"{before} {words[0]} "
    # A letter typed right after the mark: a word offered after a space does not go on with it, and Tab takes none.
    page.evaluate("window.suggestDelayMs = 0")
    page.wait_for_function(CURRENT, timeout=SUGGEST_WITHIN_MS)
    type_keys(page, "Hi,")
    shown = snapshot(page)["shown"]
    assert not any(w.startswith("t") for w, spaced in zip(shown["words"], shown["spaced"], strict=True) if not spaced)
    before = page.input_value("#text")
    page.evaluate("window.suggestDelayMs = 1500")
    page.keyboard.type("t")
    page.keyboard.press("Tab")
    assert page.input_value("#text") == f"{before}t"
