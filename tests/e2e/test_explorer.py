"""GET /explorer in a real browser: Debian's headless Chromium, driven by Selenium through
Debian's chromedriver (never a browser or driver that a tool downloads), against a real
`gradserve serve` on 127.0.0.1.

The browser tests skip, saying why, only where chromium or chromedriver cannot be found
(.ci/run installs both; with GRADSERVE_TEST_REQUIRE_BROWSER=1, which .ci/run sets once they
are there, they fail instead). GRADSERVE_UPDATE_SCREENSHOT=1 also writes the seed example's
screenshot to docs/explorer.png (the README's).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from gradserve.service.routes.explorer import ASSETS, CSP, EXAMPLES, PAGE_PATHS, STATIC
from tests.support.in_process import serving
from tests.support.seeds import SEED_EXPR, SEED_NO_GRAD, SEED_OP
from tests.support.server import Server, start_server, stop_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PAGE_FILES = ["index.html", *ASSETS]
# A request whose first node's shapes do not match: /plan and /forward answer 422 naming it.
BAD_MATMUL = {
    "graph": {
        "nodes": [{"id": "h", "expr": "x @ w"}, {"id": "y", "expr": "sum(h)"}],
        "outputs": ["y"],
    },
    "inputs": {"x": [[1.0, 2.0]], "w": [[1.0, 2.0]]},
}
SMALL_BUDGET = 20  # bytes: the seed example's planned peak on /backward is 28
EXPLORER_KEY = "explorer-test-key"


# ------------------------------------------------------------------ without a browser
def test_examples_are_the_seed_examples() -> None:
    assert EXAMPLES["seed"][1] == SEED_OP
    assert EXAMPLES["seed-expr"][1] == SEED_EXPR
    assert EXAMPLES["seed-no-grad"][1] == SEED_NO_GRAD


@pytest.mark.anyio
async def test_the_page_is_served_with_a_self_only_policy_and_no_outside_urls() -> None:
    async with serving() as (client, _):
        page = await client.get("/explorer")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert policy == CSP
        directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
        assert directives["default-src"] == "'none'"
        for name in ("script-src", "style-src", "connect-src", "img-src"):
            assert directives[name] == "'self'", name
        for name, media_type in ASSETS.items():
            r = await client.get(f"/explorer/{name}")
            assert r.status_code == 200 and r.headers["content-type"] == media_type
        examples = (await client.get("/explorer/examples.json")).json()
        assert json.loads(examples["seed"]["text"]) == SEED_OP
        assert '"data": 2.0' in examples["seed"]["text"]  # a float stays a float
        assert (await client.get("/explorer/app.py")).status_code == 404
        assert (await client.get("/explorer/..%2Fexplorer.py")).status_code == 404
        spec = (await client.get("/openapi.json")).json()
        assert not any(path.startswith("/explorer") for path in spec["paths"])
    # Nothing the page loads names another host: the one URL in its files is the SVG
    # namespace (a name, never fetched); no @import, no url() in the style sheet.
    for name in PAGE_FILES:
        text = (STATIC / name).read_text()
        outside = [
            w
            for w in text.replace('"', " ").replace("'", " ").split()
            if "://" in w and "www.w3.org/2000/svg" not in w
        ]
        assert not outside, (name, outside)
    css = (STATIC / "explorer.css").read_text()
    assert "@import" not in css and "url(" not in css


@pytest.mark.anyio
async def test_with_api_keys_the_page_loads_and_nothing_else_without_a_key() -> None:
    """The page, its files and its examples hold no data: with keys on they are served to
    a browser that has no key yet (the page then asks for it); every other path, the
    page's own requests included, still needs one."""
    async with serving(api_keys=EXPLORER_KEY) as (client, _):
        assert sorted(PAGE_PATHS) == [
            "/explorer",
            "/explorer/examples.json",
            "/explorer/explorer.css",
            "/explorer/explorer.js",
            "/explorer/favicon.svg",
        ]
        for path in PAGE_PATHS:
            r = await client.get(path)
            assert r.status_code == 200, (path, r.text)
        for path in (
            "/explorer/app.py",
            "/explorer/",
            "/explorer/index.html",
            "/ops",
            "/docs",
            "/openapi.json",
            "/metrics",
        ):
            r = await client.get(path)
            assert r.status_code == 401, (path, r.status_code)
        for path in ("/plan", "/backward", "/explorer"):
            r = await client.post(path, json=SEED_OP)
            assert r.status_code == 401, (path, r.status_code)
        r = await client.post("/backward", json=SEED_OP, headers={"X-API-Key": EXPLORER_KEY})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------ the browser
def _which(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def _browser() -> tuple[str, str]:
    """Debian's chromium and chromedriver; a clear skip where they are not installed."""
    chromium = os.environ.get("GRADSERVE_TEST_CHROMIUM") or _which("chromium", "chromium-browser")
    driver = os.environ.get("GRADSERVE_TEST_CHROMEDRIVER") or _which("chromedriver")
    missing = [
        what
        for what, path in (("chromium", chromium), ("chromedriver", driver))
        if path is None or not os.access(path, os.X_OK)
    ]
    if missing:
        why = (
            f"{' and '.join(missing)} not found (on Debian: apt-get install chromium "
            "chromium-driver; .ci/run installs them)"
        )
        if os.environ.get("GRADSERVE_TEST_REQUIRE_BROWSER") == "1":
            pytest.fail(f"GRADSERVE_TEST_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    assert chromium is not None and driver is not None
    return chromium, driver


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    return _browser()


@pytest.fixture(scope="module")
def server(
    browser_paths: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("explorer"))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def small_budget_server(
    browser_paths: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("explorer-budget"), GRADSERVE_MEMORY_BUDGET_BYTES=str(SMALL_BUDGET)
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def keyed_server(
    browser_paths: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("explorer-keys"), GRADSERVE_API_KEYS=f"another-key, {EXPLORER_KEY}"
    )
    yield s
    stop_server(s)


@pytest.fixture
def driver(browser_paths: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')"
    )
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = browser_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1500,1500",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-features=Translate",
    ):
        options.add_argument(arg)
    # The console (browser) and every request the page makes (performance: CDP's Network
    # domain).
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    # The driver is given: Selenium Manager, which could download one, is never asked.
    monkeypatch.setenv("SE_OFFLINE", "true")
    d = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    d.set_page_load_timeout(60)
    try:
        yield d
    finally:
        d.quit()


def _wait(d: Any, predicate: Any, what: str, timeout: float = 30) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(d, timeout, poll_frequency=0.05).until(lambda _: predicate())
    except Exception as err:
        state = d.execute_script("return document.body && document.body.dataset.state")
        status = d.execute_script(
            "const s = document.querySelector('[data-testid=status]'); return s && s.textContent"
        )
        raise AssertionError(f"waited for {what}: page state {state!r}, status {status!r}") from err


def _by(d: Any, testid: str, extra: str = "") -> list[Any]:
    return list(d.find_elements("css selector", f'[data-testid="{testid}"]{extra}'))


def _state(d: Any) -> str:
    return str(d.execute_script("return document.body.dataset.state"))


def _requests(d: Any) -> list[str]:
    """The URL of every request the page made (CDP Network events), drained."""
    return [url for url, _ in _requests_with_headers(d)]


def _requests_with_headers(d: Any) -> list[tuple[str, dict[str, str]]]:
    """Every request the page made, with its headers (as the browser sent them), drained."""
    sent = []
    for entry in d.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        method, params = message.get("method"), message.get("params", {})
        if method == "Network.requestWillBeSent":
            sent.append((params["request"]["url"], params["request"].get("headers", {})))
        elif method in ("Network.webSocketCreated", "Network.webTransportCreated"):
            sent.append((params["url"], {}))
    return sent


def _console_errors(d: Any, allowed: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Console entries of level SEVERE or WARNING, drained; `allowed`: substrings of
    messages expected (e.g. the 422 a problem comes with)."""
    return [
        e
        for e in d.get_log("browser")
        if e["level"] in ("SEVERE", "WARNING") and not any(a in e["message"] for a in allowed)
    ]


def _assert_only_the_service(urls: list[str], base: str) -> None:
    outside = [
        u
        for u in urls
        if not (u.startswith(base + "/") or u.startswith("data:") or u == "about:blank")
    ]
    assert not outside, f"requests outside the service: {outside}"


@pytest.mark.integration
def test_seed_example_plans_runs_and_stays_on_the_service(
    driver: Any, server: Server, tmp_path: Path
) -> None:
    d = driver
    d.get(f"{server.base}/explorer?example=seed")
    _wait(d, lambda: _state(d) == "planned", "the seed example's plan")
    # The request editor holds the seed example, exactly (2.0 stays a float).
    text = _by(d, "request")[0].get_attribute("value")
    assert json.loads(text) == SEED_OP and '"data": 2.0' in text
    # Its three forward nodes, its two inputs and its backward steps, with shapes on edges.
    forward = _by(d, "node", '[data-phase="forward"]')
    assert sorted(n.get_attribute("data-node-id") for n in forward) == ["d", "s", "z"]
    assert all(n.get_attribute("data-kind") == "node" for n in forward)
    assert sorted(
        n.get_attribute("data-node-id") for n in _by(d, "node", '[data-phase="input"]')
    ) == ["x", "y"]
    assert len(_by(d, "node", '[data-phase="backward"]')) >= 3
    edges = _by(d, "edge")
    assert len(edges) >= 6 and {e.get_attribute("data-shape") for e in edges} == {"[]"}
    # The memory timeline: one bar a step, the peak marked, the budget far above it.
    timeline = _by(d, "timeline")[0]
    assert timeline.get_attribute("data-over-budget") == "false"
    assert len(_by(d, "live-bar")) == 9
    assert int(_by(d, "peak")[0].get_attribute("data-bytes")) == 28  # = the planned peak
    assert _by(d, "budget-line")[0].get_attribute("data-crossed") == "false"
    assert len(_by(d, "costly-row")) == 9
    # Run: /backward (its inputs require grad), the gradients as text.
    _by(d, "run")[0].click()
    _wait(d, lambda: _state(d) == "ran", "the run")
    results = _by(d, "results")[0].text
    assert "POST /backward → 200" in results
    assert "x: float32 []  = 4.0" in results and "y: float32 []  = -6.0" in results, results
    assert "z: float32 []  = -5.0" in results
    assert "timings (ms)" in results and "backward: " in results
    assert not _by(d, "problem")[0].is_displayed()
    # No console errors, no CSP violation, and every request went to the service.
    assert _console_errors(d) == []
    assert d.execute_script("return document.body.dataset.cspViolations") is None
    urls = _requests(d)
    _assert_only_the_service(urls, server.base)
    paths = {u[len(server.base) :] for u in urls}
    assert {
        "/explorer?example=seed",
        "/explorer/explorer.js",
        "/explorer/explorer.css",
        "/explorer/examples.json",
        "/plan",
        "/plan?format=dot",
        "/backward",
    } <= paths, paths
    # The screenshot, as an artifact (and, when asked, the README's).
    shot = tmp_path / "explorer-seed.png"
    assert d.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("GRADSERVE_UPDATE_SCREENSHOT") == "1":
        shutil.copy(shot, ROOT / "docs" / "explorer.png")


@pytest.mark.integration
def test_over_budget_plan_shows_the_budget_line_crossed(
    driver: Any, small_budget_server: Server, tmp_path: Path
) -> None:
    d = driver
    d.get(f"{small_budget_server.base}/explorer?example=seed")
    _wait(d, lambda: _state(d) == "planned", "the plan")
    timeline = _by(d, "timeline")[0]
    assert timeline.get_attribute("data-over-budget") == "true"
    assert int(timeline.get_attribute("data-budget-bytes")) == SMALL_BUDGET
    assert int(timeline.get_attribute("data-planned-peak-bytes")) == 28
    line = _by(d, "budget-line")[0]
    assert line.get_attribute("data-crossed") == "true"
    assert line.get_attribute("data-on-scale") == "true"
    assert "crossed" in line.get_attribute("class")
    assert _by(d, "peak")[0].get_attribute("data-over-budget") == "true"
    assert _by(d, "plan-summary")[0].get_attribute("data-admitted") == "false"
    assert "not admitted" in _by(d, "plan-summary")[0].text
    assert _console_errors(d) == []  # a plan over budget is an answer, not an error
    # Run anyway: the service refuses it with its problem, shown as such.
    _by(d, "run")[0].click()
    _wait(d, lambda: _state(d) == "run-error", "the refusal")
    problem = _by(d, "problem")[0]
    assert problem.is_displayed() and "memory-budget" in problem.text
    assert "422" in _by(d, "results")[0].text
    assert _console_errors(d, allowed=("/backward - Failed to load resource",)) == []
    _assert_only_the_service(_requests(d), small_budget_server.base)
    d.save_screenshot(str(tmp_path / "explorer-over-budget.png"))


@pytest.mark.integration
def test_recomputed_steps_are_marked_and_both_timelines_drawn(
    driver: Any, server: Server, tmp_path: Path
) -> None:
    """A /backward over its memory budget that the planner fits by recomputation: its
    recomputed steps are marked in the graph and the timeline, and the timeline without
    recomputation is drawn below, crossing the budget that the program keeps to."""
    import httpx

    from tests.support.chains import chain

    body = chain(200, 12)
    plain = httpx.post(f"{server.base}/plan", json={**body, "recompute": "never"}, timeout=30)
    budget = plain.json()["planned_peak_bytes"] * 2 // 3
    d = driver
    request = {**body, "memory_budget_bytes": budget}
    d.get(f"{server.base}/explorer?request={quote(json.dumps(request))}")
    _wait(d, lambda: _state(d) == "planned", "the plan")
    assert "recomputed" in _by(d, "plan-summary")[0].text
    assert _by(d, "plan-summary")[0].get_attribute("data-admitted") == "true"
    assert _by(d, "node", '[data-kind="recompute"]'), "no recomputed step in the graph"
    timeline = _by(d, "timeline")[0]
    assert timeline.get_attribute("data-over-budget") == "false"
    assert timeline.find_elements("css selector", "rect.bar.recompute")
    without = _by(d, "timeline-without")[0]
    assert without.is_displayed()
    assert without.get_attribute("data-over-budget") == "true"
    assert (
        int(without.get_attribute("data-planned-peak-bytes")) == plain.json()["planned_peak_bytes"]
    )
    _by(d, "run")[0].click()
    _wait(d, lambda: _state(d) == "ran", "the run")
    assert "POST /backward → 200" in _by(d, "results")[0].text
    assert _console_errors(d) == []
    _assert_only_the_service(_requests(d), server.base)
    d.save_screenshot(str(tmp_path / "explorer-recompute.png"))


@pytest.mark.integration
def test_a_problem_is_shown_on_the_node_that_caused_it(
    driver: Any, server: Server, tmp_path: Path
) -> None:
    d = driver
    d.get(f"{server.base}/explorer?request={quote(json.dumps(BAD_MATMUL))}")
    _wait(d, lambda: _state(d) == "plan-error", "the plan's problem")
    blamed = _by(d, "node", '[data-error="true"]')
    assert [n.get_attribute("data-node-id") for n in blamed] == ["h"]
    assert "⚠ node 'h' (matmul): shapes" in blamed[0].text
    problem = _by(d, "problem")[0]
    assert problem.is_displayed() and "shape-mismatch" in problem.text
    assert problem.get_attribute("data-node") == "h"
    assert "graph › nodes › 0" in problem.text  # errors[].loc
    assert not _by(d, "node", '[data-node-id="y"][data-error="true"]')
    assert (
        _console_errors(
            d,
            allowed=(
                "/plan - Failed to load resource",
                "/plan?format=dot - Failed to load resource",
            ),
        )
        == []
    )
    _assert_only_the_service(_requests(d), server.base)
    d.save_screenshot(str(tmp_path / "explorer-problem.png"))


@pytest.mark.integration
def test_with_api_keys_the_page_asks_for_the_key_and_sends_it(
    driver: Any, keyed_server: Server, tmp_path: Path
) -> None:
    """Keys on: the page loads with no key, asks for one at the first 401, shows a wrong
    key's 401 problem and asks again, then plans and runs the seed example with the right
    key, which it sends with its API requests only and stores nowhere."""
    d = driver
    d.get(f"{keyed_server.base}/explorer?example=seed")
    _wait(d, lambda: _state(d) == "key-needed", "the page to ask for the key")
    form = _by(d, "key-form")[0]
    assert form.is_displayed()
    assert "asks for an API key" in _by(d, "key-note")[0].text
    problem = _by(d, "problem")[0]
    assert problem.is_displayed() and "401" in problem.text and "unauthorized" in problem.text
    # A wrong key: its 401 problem, and the form again.
    _by(d, "api-key")[0].send_keys("not-the-key")
    _by(d, "key-submit")[0].click()
    _wait(
        d,
        lambda: _state(d) == "key-needed" and "refused" in _by(d, "key-note")[0].text,
        "the wrong key's refusal",
    )
    assert form.is_displayed()
    assert "401" in problem.text and "unauthorized" in problem.text
    assert "a valid API key is required" in _by(d, "problem-detail")[0].text
    d.save_screenshot(str(tmp_path / "explorer-key-refused.png"))
    # The right key: the plan, then the run.
    _by(d, "api-key")[0].send_keys(EXPLORER_KEY)
    _by(d, "key-submit")[0].click()
    _wait(d, lambda: _state(d) == "planned", "the plan with the key")
    assert not form.is_displayed() and not problem.is_displayed()
    assert _by(d, "api-key")[0].get_attribute("value") == ""
    _by(d, "run")[0].click()
    _wait(d, lambda: _state(d) == "ran", "the run with the key")
    results = _by(d, "results")[0].text
    assert "POST /backward → 200" in results
    assert "x: float32 []  = 4.0" in results and "y: float32 []  = -6.0" in results, results
    # Which requests carried which key: the page's files none, its API requests the key
    # (the first ones none, then the wrong one), and nothing else anywhere.
    sent = _requests_with_headers(d)
    _assert_only_the_service([u for u, _ in sent], keyed_server.base)
    keys: dict[str, list[str | None]] = {}
    for url, headers in sent:
        given = {k.lower(): v for k, v in headers.items()}.get("x-api-key")
        keys.setdefault(url[len(keyed_server.base) :], []).append(given)
    for path in (
        "/explorer?example=seed",
        "/explorer/explorer.js",
        "/explorer/explorer.css",
        "/explorer/examples.json",
    ):
        assert keys[path] == [None], (path, keys[path])
    assert keys["/plan"] == [None, "not-the-key", EXPLORER_KEY], keys["/plan"]
    assert keys["/backward"] == [EXPLORER_KEY], keys["/backward"]
    assert d.execute_script("return sessionStorage.length + localStorage.length") == 0
    assert EXPLORER_KEY not in d.execute_script("return document.cookie")
    assert _console_errors(d, allowed=("status of 401",)) == []
    assert d.execute_script("return document.body.dataset.cspViolations") is None
    d.save_screenshot(str(tmp_path / "explorer-keys.png"))
