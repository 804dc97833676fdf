"""The dashboard in a real browser: Debian's chromium and chromium-driver, driven by Selenium.

A real coordinator (--metrics-port=0) with a scripted worker and some jobs; the page must
render the counts and the job list, and clicking a job must show its timeline and its
waiting reason. ``.ci/run`` installs the browser; this test skips (loudly) only when no
chromium or chromedriver can be found.

Set ``JOBMESH_SCREENSHOT_DIR=docs`` to save ``dashboard.png``, ``dashboard-job.png`` and
``dashboard-workflow.png`` there (after a short load, so the chart has something to show).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.support.waiting import wait_until

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
SCREENSHOT_DIR = os.environ.get("JOBMESH_SCREENSHOT_DIR")


def _skip_loudly(reason: str) -> None:
    message = "BROWSER TEST SKIPPED: %s" % reason
    warnings.warn(message)
    print("\n" + message, flush=True)
    pytest.skip(message)


@pytest.fixture
def browser():
    binary = next((path for path in map(shutil.which, BROWSERS) if path), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        _skip_loudly("no chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver; "
                     ".ci/run installs them)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _skip_loudly("selenium is not installed (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1200", "--hide-scrollbars"):
        options.add_argument(arg)
    # An explicit driver path: Selenium never tries to download one.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


def _load(client, worker, seconds: float) -> None:
    """Submit and complete small jobs for a while, so that the throughput chart has a curve;
    returns once every one of them has completed."""
    done = threading.Event()

    def run_worker():
        while not done.is_set():
            assign = worker.poll_assign(0.05)
            if assign is not None:
                worker.complete(assign, {"sleptMillis": 1})

    thread = threading.Thread(target=run_worker, daemon=True)
    thread.start()
    stop, n = time.monotonic() + seconds, 0
    while time.monotonic() < stop:
        for _ in range(1 + n % 4):
            client.submit_ok("SLEEP", {"durationMillis": 1})
        n += 1
        time.sleep(0.25)  # the load's pace, spread over ``seconds`` so the chart has a curve: not a wait
    wait_until(lambda: not any(client.list_jobs(state=s)["jobs"] for s in ("QUEUED", "RUNNING")),
               message="the load finished")
    done.set()
    thread.join(5)


def test_dashboard_shows_counts_jobs_and_a_jobs_timeline(browser, coordinator_factory, peers):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    coord = coordinator_factory(metrics_port=0, retry_base_millis=60000, retry_cap_millis=60000)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-1", capacity=2, heartbeat_millis=100)
    if SCREENSHOT_DIR:
        _load(client, worker, 12.0)
    # Given one job completed, one failed once and waiting for its retry, two running, one queued
    done = client.submit_ok("WORD_COUNT", {"text": "a b c"})
    worker.complete(worker.await_assign(), {"words": 3})
    client.wait_state(done, "COMPLETED")
    retrying = client.submit_ok("FAIL", {"failUntilAttempt": 2}, priority="HIGH")
    worker.fail(worker.await_assign(), "attempt 1 failed (failUntilAttempt=2)")
    client.wait_state(retrying, "RETRY_WAIT")
    running = [client.submit_ok("SLEEP", {"durationMillis": 60000}) for _ in range(2)]
    reporting = worker.await_assign()
    worker.await_assign()
    queued = client.submit_ok("SHA256", {"text": "hello"}, priority="LOW")
    # and a limit on FAIL, and PRIME_COUNT paused
    assert client.request({"type": "LIMIT_PUT", "limit": {"taskType": "FAIL", "maxRunning": 3,
                                                          "ratePerSecond": 2}})["type"] == "LIMIT"
    assert client.request({"type": "TYPE_PAUSE", "taskType": "PRIME_COUNT"})["type"] == "LIMIT"
    # one of the running jobs has reported its progress
    worker.send({"type": "TASK_PROGRESS", "workerId": "w-1", "jobId": reporting["jobId"],
                 "attemptId": reporting["attemptId"], "fraction": 0.42, "message": "compressing chunk 7"})
    wait_until(lambda: client.status(reporting["jobId"])["progress"], message="the progress report kept")

    from selenium.common.exceptions import StaleElementReferenceException

    # Waits read rows the page's two-second refresh may have just replaced: such a read is tried again
    wait = WebDriverWait(browser, 15, ignored_exceptions=(StaleElementReferenceException,))
    browser.get(coord.metrics_url + "/")
    # The counts render
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#card-running .value").text == "2")
    assert browser.find_element(By.CSS_SELECTOR, "#card-queued .value").text == "1"
    assert browser.find_element(By.CSS_SELECTOR, "#card-retry .value").text == "1"
    assert browser.find_element(By.ID, "ready").text == "ready"
    # The limits panel shows each limit, and the paused type with a PAUSED badge (read
    # through the waits that ignore a replaced row)

    def cells(task_type):
        return lambda d: [td.text for td in d.find_elements(By.CSS_SELECTOR, "#limits tr[data-limit='%s'] td"
                                                            % task_type)]

    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#limits tr[data-limit='PRIME_COUNT'] .badge.paused")
                .text == "PAUSED")
    wait.until(lambda d: cells("FAIL")(d) == ["FAIL", "active", "3", "-", "2/s (burst 2)", "-", "0", "0"])
    assert "1 paused" in browser.find_element(By.ID, "limits-hint").text
    # a job of the paused type waits, and the panel counts it
    held = client.submit_ok("PRIME_COUNT", {"limit": 10})
    wait.until(lambda d: cells("PRIME_COUNT")(d)[1:] == ["PAUSED", "-", "-", "-", "-", "0", "1"])
    assert client.status(held)["waitingReason"] == "TYPE_PAUSED"
    # the workers and the job list render
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#workers tr[data-worker='w-1']")))
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#jobs tr[data-job='%s']" % queued)))
    row = browser.find_element(By.CSS_SELECTOR, "#jobs tr[data-job='%s']" % queued)
    assert "QUEUED" in row.text and "SHA256" in row.text and "workers busy" in row.text
    # the running job that reported progress has a bar, the other none
    bar = browser.find_element(By.CSS_SELECTOR, "#jobs tr[data-job='%s'] .progress" % reporting["jobId"])
    assert bar.get_attribute("data-progress") == "42" and "42% compressing chunk 7" in bar.text
    assert bar.find_element(By.CSS_SELECTOR, ".bar > div").get_attribute("style") == "width: 42%;"
    assert not browser.find_elements(By.CSS_SELECTOR, "#jobs tr[data-job='%s'] .progress"
                                     % (set(running) - {reporting["jobId"]}).pop())
    # the chart has drawn its lines
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-depth path[data-series='running']"))
    if SCREENSHOT_DIR:
        # one more poll, so the chart reaches the latest sample: its next redraw
        drawn = browser.find_element(By.ID, "chart-depth").get_attribute("innerHTML")
        wait.until(lambda d: d.find_element(By.ID, "chart-depth").get_attribute("innerHTML") != drawn)
        _save(browser, "dashboard.png")

    # The state filter narrows the list
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.ID, "f-state")).select_by_visible_text("COMPLETED")
    wait.until(lambda d: all("COMPLETED" in r.text for r in d.find_elements(By.CSS_SELECTOR, "#jobs tbody tr"))
               and d.find_elements(By.CSS_SELECTOR, "#jobs tr[data-job='%s']" % done))
    Select(browser.find_element(By.ID, "f-state")).select_by_visible_text("any")
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#jobs tr[data-job='%s']" % retrying)))

    # Clicking a job shows its page: state, waiting reason in words, and the timeline
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#jobs tr[data-job='%s'] a" % retrying).click() or True)
    wait.until(lambda d: d.find_element(By.ID, "jv-id").text == retrying)
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#timeline li[data-event='RETRY_WAIT']")))
    events = [li.get_attribute("data-event") for li in browser.find_elements(By.CSS_SELECTOR, "#timeline li")]
    assert events == ["SUBMITTED", "ASSIGNED", "ATTEMPT_FAILED", "RETRY_WAIT"]
    reason = browser.find_element(By.ID, "jv-reason")
    assert reason.get_attribute("data-reason") == "RETRY_BACKOFF"
    assert "retry backoff" in reason.text
    assert "attempt 1 failed" in browser.find_element(By.ID, "jv-fields").text
    assert browser.find_element(By.CSS_SELECTOR, "#jv-state .state").text == "RETRY_WAIT"
    if SCREENSHOT_DIR:
        _save(browser, "dashboard-job.png")

    # and back to the overview
    browser.find_element(By.LINK_TEXT, "← all jobs").click()
    wait.until(lambda d: d.find_element(By.ID, "overview").is_displayed())
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#jobs tr[data-job='%s']" % done), timeout=10,
               message="the job list again")

    # The list has an error column; times are UTC on a 24-hour clock, with the zone
    headers = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#jobs thead th")]
    assert headers[7].lower() == "error", headers
    wait.until(lambda d: "attempt 1 failed" in d.find_element(
        By.CSS_SELECTOR, "#jobs tr[data-job='%s'] td:nth-child(8)" % retrying).text)
    assert re.fullmatch(r"updated \d{4}-\d\d-\d\d [0-2]\d:[0-5]\d:[0-5]\d UTC",
                        browser.find_element(By.ID, "updated").text)
    # The finished job's page names the worker of its last attempt and shows its payload
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#jobs tr[data-job='%s'] a" % done).click() or True)
    wait.until(lambda d: d.find_element(By.ID, "jv-id").text == done and d.find_elements(By.ID, "jv-payload")
               and "Worker" in d.find_element(By.ID, "jv-fields").text.splitlines())
    fields = browser.find_element(By.ID, "jv-fields").text.splitlines()
    assert fields[fields.index("Worker") + 1] == "w-1 (attempt 1)", fields
    assert json.loads(browser.find_element(By.ID, "jv-payload").text) == {"text": "a b c"}
    snapshot = client.status(done)
    created = datetime.fromtimestamp(snapshot["createdAtMillis"] / 1000, timezone.utc)
    assert fields[fields.index("Created") + 1].startswith(
        created.strftime("%Y-%m-%d %H:%M:%S.") + "%03d UTC" % (snapshot["createdAtMillis"] % 1000)), fields
    # The reporting job's page shows its progress after its attempts
    browser.get(coord.metrics_url + "/#/job/" + reporting["jobId"])
    wait.until(lambda d: "Progress" in d.find_element(By.ID, "jv-fields").text.splitlines())
    fields = browser.find_element(By.ID, "jv-fields").text.splitlines()
    assert fields[fields.index("Progress") - 2:fields.index("Progress") + 2] == [
        "Attempts", "1 of 3", "Progress", "42% compressing chunk 7"], fields

    # (the same browser and coordinator: the workers above are full, so workflows get their own)
    _check_workflow_view(browser, coord, client, peers.worker(coord, "w-flow", capacity=2,
                                                              task_types=["FLOW_UI", "FLOW_HELD"]))


# Read in one script run, so that a redraw of the graph between two reads cannot mix them.
NODES_JS = """return [...document.querySelectorAll('#wf-graph g.node')].map((g) => ({
  ref: g.dataset.ref || null, group: g.dataset.group || null, state: g.dataset.state,
  count: g.dataset.count || null, fill: getComputedStyle(g.querySelector('rect.box')).fill}));"""
EDGES_JS = """return [...document.querySelectorAll('#wf-graph path.edge')].map((p) => [p.dataset.from, p.dataset.to]);"""
# The page's colour of every state it dresses, as the browser computes it (rgb(...)).
COLORS_JS = """return Object.fromEntries(Object.entries(COLORS).map(([state, color]) => {
  const probe = document.createElement('span'); probe.style.color = color; document.body.append(probe);
  const value = getComputedStyle(probe).color; probe.remove(); return [state, value]; }));"""


def _check_workflow_view(browser, coord, client, worker) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 15, ignored_exceptions=(StaleElementReferenceException,))

    def submit(name, jobs):
        reply = client.request({"type": "SUBMIT_WORKFLOW", "name": name, "jobs": jobs})
        assert reply["type"] == "WORKFLOW_SUBMITTED", reply
        return reply["workflowId"], reply["jobIds"]

    def job(ref, *depends, task_type="FLOW_UI"):
        return {"ref": ref, "taskType": task_type, "payload": {}, "dependsOn": list(depends), "maxAttempts": 1}

    def nodes():
        return {n["ref"] or "group:" + n["group"]: n for n in browser.execute_script(NODES_JS)}

    def states():
        return {ref: n["state"] for ref, n in nodes().items()}

    def click(selector):
        def clicked(d):
            d.find_element(By.CSS_SELECTOR, selector).click()
            return True
        wait.until(clicked)

    # Given a diamond (a; b and c after it; d after both) and e after b: a completes, c
    # fails (so d is cancelled), b runs, and e waits for it
    workflow_id, ids = submit("nightly etl", [job("a"), job("b", "a"), job("c", "a"), job("d", "b", "c"),
                                              job("e", "b")])
    worker.complete(worker.await_assign())
    assigned = {a["jobId"]: a for a in (worker.await_assign(), worker.await_assign())}
    worker.fail(assigned[ids["c"]], "c broke")
    client.wait_state(ids["d"], "CANCELLED")
    # When its view is opened
    browser.get(coord.metrics_url + "/#/workflow/" + workflow_id)
    expected = {"a": "COMPLETED", "b": "RUNNING", "c": "FAILED", "d": "CANCELLED", "e": "WAITING"}
    wait.until(lambda d: states() == expected)
    # Then the name, the state and the counts by state are on top
    assert browser.find_element(By.ID, "wf-name").text == "nightly etl"
    assert browser.find_element(By.CSS_SELECTOR, "#wf-state .state").text == "RUNNING"
    counts = {c.get_attribute("data-count"): c.text for c in browser.find_elements(By.CSS_SELECTOR, "#wf-counts .count")}
    assert counts == {"RUNNING": "RUNNING 1", "WAITING": "WAITING 1", "COMPLETED": "COMPLETED 1",
                      "FAILED": "FAILED 1", "CANCELLED": "CANCELLED 1"}
    # each job is a node in its state's colour, the colour of that state's badge, and the
    # waiting one's colour is no other state's
    colors = browser.execute_script(COLORS_JS)
    badges = browser.execute_script("""return Object.fromEntries([...document.querySelectorAll('#wf-counts .count')]
      .map((c) => [c.dataset.count, getComputedStyle(c.querySelector('.state')).backgroundColor]));""")
    drawn = nodes()
    for ref, state in expected.items():
        assert drawn[ref]["fill"] == colors[state] == badges[state], (ref, drawn[ref], colors, badges)
    assert colors["WAITING"] not in [c for s, c in colors.items() if s != "WAITING"], colors
    # and an arrow runs from each job to each job that depends on it
    assert sorted(map(tuple, browser.execute_script(EDGES_JS))) == [
        ("a", "b"), ("a", "c"), ("b", "d"), ("b", "e"), ("c", "d")]
    if SCREENSHOT_DIR:  # once the cards (polled apart from the graph) count the waiting job too
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#card-waiting .value").text == "1")
        _save(browser, "dashboard-workflow.png")

    # Clicking a node opens that job's page, which links back to its workflow
    click("#wf-graph g.node[data-ref='c']")
    wait.until(lambda d: d.find_element(By.ID, "jv-id").text == ids["c"])
    # (read and clicked through waits: the job's page redraws as it refreshes)
    wait.until(lambda d: d.find_element(By.ID, "jv-workflow").text == workflow_id)
    wait.until(lambda d: "ref c" in d.find_element(By.ID, "jv-fields").text)
    click("#jv-workflow")
    wait.until(lambda d: d.find_element(By.ID, "wfview").is_displayed() and states() == expected)

    # While it runs the view follows it: b completes, e runs, then completes; the workflow FAILED
    worker.complete(assigned[ids["b"]])
    wait.until(lambda d: states()["e"] == "RUNNING")
    worker.complete(worker.await_assign())
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#wf-state .state").text == "FAILED")
    assert states() == dict(expected, b="COMPLETED", e="COMPLETED")

    # A fan-out of 30 is one group node with its count, between its root and its join
    assert client.request({"type": "TYPE_PAUSE", "taskType": "FLOW_HELD"})["type"] == "LIMIT"
    fan_id, _ids = submit("fan", [job("root", task_type="FLOW_HELD")]
                          + [job("part-%02d" % n, "root", task_type="FLOW_HELD") for n in range(30)]
                          + [job("join", *("part-%02d" % n for n in range(30)), task_type="FLOW_HELD")])
    browser.get(coord.metrics_url + "/#/workflow/" + fan_id)
    wait.until(lambda d: states() == {"root": "QUEUED", "group:part-00": "WAITING", "join": "WAITING"})
    assert nodes()["group:part-00"]["count"] == "30"
    assert sorted(map(tuple, browser.execute_script(EDGES_JS))) == [("group:part-00", "join"),
                                                                     ("root", "group:part-00")]
    # and clicking it lists its jobs
    click("#wf-graph g.node[data-group='part-00']")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#wf-group tbody tr")) == 30)
    assert client.request({"type": "WORKFLOW_CANCEL", "workflowId": fan_id})["type"] == "WORKFLOW"


def _save(browser, name: str) -> None:
    path = Path(SCREENSHOT_DIR) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    # The whole page: grow the window to the document's height first.
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, max(900, min(int(height) + 20, 2400)))
    # two animation frames: the page has been laid out and painted at the new size
    browser.execute_async_script("const done = arguments[arguments.length - 1];"
                                 "requestAnimationFrame(() => requestAnimationFrame(() => done()));")
    assert browser.save_screenshot(str(path)), path
