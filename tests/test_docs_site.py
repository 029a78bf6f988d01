"""The documentation site (issue 38): it builds with MkDocs in strict mode (warnings, broken internal
links and anchors are errors), its reference pages hold everything the code defines (every CLI verb,
configuration key, metric, policy parameter), and a real headless Chromium, driven by selenium,
renders the main pages served from 127.0.0.1: title, navigation, the theme's stylesheet, a code
block, the images.

Chromium and its driver are Debian packages (`chromium`, `chromium-driver`), installed by
`.ci/run`; without them the browser test is skipped here and fails under CI."""

from __future__ import annotations

import functools
import html
import os
import re
import shutil
import subprocess
import sys
import threading
import typing
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: MkDocs 1.x plugins print a banner about MkDocs 2 unless told not to; it is no build warning
QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built from this checkout with ``mkdocs build --strict`` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **QUIET})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert not re.search(r"^(WARNING|ERROR)\b", log, re.M), log
    return out


def _text(site: Path, page: str) -> str:
    """The visible text of a built page's article (tags stripped, entities decoded)."""
    doc = (site / page / "index.html").read_text()
    article = doc.split('<article class="md-content__inner', 1)[1].split("</article>", 1)[0]
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def test_cli_reference_has_every_verb_and_option(site):
    import click

    from mergestream.agent.cli import agent
    from mergestream.cli import cli

    text = _text(site, "reference/cli")
    assert "Sentinel" not in text  # click's unset-default marker leaking into the page

    def walk(cmd: click.Command, path: str):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    for root, name in ((cli, "mergestream"), (agent, "mergestream-agent")):
        for path, cmd in walk(root, name):
            assert path in text, path
            for p in cmd.params:
                for opt in p.opts if isinstance(p, click.Option) else ():
                    assert opt in text, f"{path} {opt}"


def test_config_reference_has_every_key_with_its_default(site):
    from pydantic import BaseModel

    from mergestream.config import Config

    text = _text(site, "reference/config")
    count = 0

    def walk(model, prefix=""):
        nonlocal count
        for name, field in model.model_fields.items():
            key = prefix + name
            assert key in text, key
            if field.description:
                assert " ".join(field.description.replace("`", "").split())[:40] in text, key
            count += 1
            sub = [a for a in (field.annotation, *typing.get_args(field.annotation))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
            if sub:
                walk(sub[0], key + ("[]." if typing.get_origin(field.annotation) is list else "."))

    walk(Config)
    assert count > 80  # every section, not a stub
    assert "MERGESTREAM_MLFLOW__WEBHOOK__SECRET" in text and "5368709120" in text


def test_metrics_reference_is_the_registry(site):
    from prometheus_client.metrics import MetricWrapperBase

    from mergestream.daemon.metrics import Metrics

    text = _text(site, "reference/metrics")
    names = [c._name + ("_total" if c._type == "counter" else "")
             for c in vars(Metrics()).values() if isinstance(c, MetricWrapperBase)]
    assert len(names) > 25
    for name in names:
        assert name in text, name
    assert len(re.findall(r"\bmergestream_\w+", text)) >= len(names)


def test_policy_reference_has_every_policy_and_parameter(site):
    from mergestream.policies import REGISTRY, parameter_names

    text = _text(site, "reference/policies")
    for name in REGISTRY:
        assert name in text
        for param in parameter_names(name):
            assert param in text, f"{name}.{param}"
    assert "lines_alpha" in text
    quality = _text(site, "policies")  # the table generated from bench/results/quality.json
    assert re.search(r"iso_c\s*alpha=2\.0, lambda=0\.2\s*79\.7\s*0\.994 / 0\.915", quality), quality[:2000]


@pytest.fixture(scope="module")
def served(site):
    """``site`` served over HTTP on 127.0.0.1 (a free port) for the test's duration: its base URL."""
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):  # no line per request on stderr
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Debian's) driven through its chromedriver by selenium."""
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver_path):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are missing: .ci/run installs chromium chromium-driver")
        pytest.skip("needs the Debian packages chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


#: page path -> its heading (h1) and what its code block must contain (None: a page of tables)
PAGES = {
    "": ("mergestream", "mergestream fold"),
    "getting-started/": ("Getting started", "pip install -c constraints.txt"),
    "daemon/": ("The daemon", "mergestream status"),
    "policies/": ("Policies", None),
    "fleet/": ("Fleet updates", "mergestream-agent pull"),
    "reference/cli/": ("Command line", "mergestream fold [OPTIONS]"),
    "reference/config/": ("Configuration keys", None),
}


def test_main_pages_render_in_a_real_browser(served, browser):
    from selenium.webdriver.common.by import By

    for path, (title, code) in PAGES.items():
        browser.get(f"{served}/{path}")
        assert browser.title == "mergestream" if not path else browser.title.endswith(" - mergestream"), \
            (path, browser.title)
        assert "404" not in browser.title
        h1 = browser.find_element(By.CSS_SELECTOR, "article h1")
        assert h1.text.strip().rstrip("¶").strip() == title, (path, h1.text)
        nav = [a.get_attribute("textContent").strip()
               for a in browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link")]
        for entry in ("Getting started", "Policies", "The daemon", "Configuration keys", "Prometheus metrics"):
            assert entry in nav, (path, nav)
        # the theme's stylesheet applied: the header is laid out and coloured, not plain HTML
        header = browser.find_element(By.CSS_SELECTOR, "header.md-header")
        assert header.size["height"] > 30 and header.value_of_css_property("position") in ("sticky", "fixed")
        assert header.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "transparent")
        if code:
            blocks = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "article div.highlight pre")]
            assert any(code in b for b in blocks), (path, blocks)
            assert all(b.is_displayed() for b in browser.find_elements(By.CSS_SELECTOR, "article div.highlight"))
        else:  # a page made of tables: rendered as tables
            assert browser.find_elements(By.CSS_SELECTOR, "article table tbody tr"), path
        # everything the page loaded (stylesheets, scripts, fonts, images) came from this site
        loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert loaded and all(u.startswith(served) for u in loaded), [u for u in loaded if not u.startswith(served)]
    browser.get(f"{served}/policies/")
    images = browser.find_elements(By.CSS_SELECTOR, "article img")
    assert len(images) == 2
    for img in images:  # loaded and decoded, not a broken-image icon
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 500
    browser.get(f"{served}/404.html")  # the theme's page for a missing page
    assert "404" in browser.find_element(By.CSS_SELECTOR, "article").text
