"""`klevict inspect --html`: the page is parsed back and checked against the file — one shaded span per streamed
token, its class from the share of heads that kept it, per-layer counts, escaped metadata, nothing from elsewhere.
Where a headless Chromium is installed, the page is also rendered and its DOM read back."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from klevict_cli.html_report import shade
from klevict_cli.kvc import load_kvc
from klevict_cli.report import kept_share
from tests.test_cli import DOC_TEXT, FAST, assert_error, assert_ok, invoke
from tests.test_cli import HOSTILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Page(HTMLParser):
    """The classes of the spans inside the document, the text of the page, and every tag and attribute seen."""

    def __init__(self):
        super().__init__()
        self.in_document = False
        self.spans: list[str] = []
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if attrs.get("id") == "document":
            self.in_document = True
        elif self.in_document and tag == "span":
            self.spans.append(attrs["class"])

    def handle_endtag(self, tag):
        if tag == "div" and self.in_document:
            self.in_document = False

    def handle_data(self, data):
        self.text.append(data)


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def kvc_path(tmp_path_factory, tiny_model_dir) -> Path:
    folder = tmp_path_factory.mktemp("html")
    doc = folder / "doc.txt"
    doc.write_text(DOC_TEXT, encoding="utf-8")
    out = folder / "doc.kvc"
    assert_ok(invoke("compress", doc, "-o", out, "--model", tiny_model_dir, "--budget", "48", "--no-reconstruct",
                     "--estimate", *FAST))
    return out


def test_shades():
    assert [shade(s) for s in (0.0, 0.01, 0.1, 0.11, 0.5, 1.0)] == ["s0", "s1", "s1", "s2", "s5", "s10"]


def test_page_has_a_span_per_token_shaded_by_the_share_that_kept_it(kvc_path, tmp_path):
    out = tmp_path / "page.html"
    result = invoke("inspect", kvc_path, "--html", out)
    assert_ok(result)
    assert "kept entries per layer" in result.stdout and f"wrote {out}" in result.stderr
    kvc = load_kvc(kvc_path)
    page = parse(out)
    assert page.spans == [shade(s) for s in kept_share(kvc).tolist()]
    assert len(page.spans) == len(kvc.tokens) and "s0" in page.spans and any(c != "s0" for c in page.spans)
    text = "".join(page.text)
    assert "Ishmael" in text and "went home for supper." in text
    drift = json.loads(kvc.metadata["estimated_kl"])  # and how far the cache moved the model, in words
    assert f"Estimated drift (mean next-token KL against the whole read's cache): {drift['kl']:.3g}" in text
    assert "80 % range" in text
    per_layer = [int(layer.lengths.sum()) for layer in kvc.layers]
    widths = [a["style"] for tag, a in page.tags if a.get("class") == "bar"]
    assert len(widths) == len(per_layer) and "width: 100.0%" in widths[per_layer.index(max(per_layer))]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"]


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium on this machine")
def test_a_browser_renders_every_token_and_a_screenshot(kvc_path, tmp_path):
    out = tmp_path / "page.html"
    assert_ok(invoke("inspect", kvc_path, "--html", out))
    browser = [CHROMIUM, *HEADLESS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120).stdout
    rendered = Page()
    rendered.feed(dom)
    assert rendered.spans == parse(out).spans and len(rendered.spans) == len(load_kvc(kvc_path).tokens)
    shot = tmp_path / "shot.png"
    subprocess.run([*browser, "--window-size=1000,1200", f"--screenshot={shot}", out.as_uri()], capture_output=True,
                   timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_the_legend_keeps_each_range_on_one_line(kvc_path, tmp_path):
    """At 1,400 pixels the legend wrapped inside a chip ('40–50' at a line's end, '%' on the next)."""
    out = tmp_path / "page.html"
    assert_ok(invoke("inspect", kvc_path, "--html", out))
    rule = re.search(r"\.legend span \{([^}]*)\}", out.read_text(encoding="utf-8"))
    assert rule and "white-space: nowrap" in rule[1]


def test_page_loads_nothing_from_elsewhere(kvc_path, tmp_path):
    out = tmp_path / "page.html"
    assert_ok(invoke("inspect", kvc_path, "--html", out, "--json"))
    page = parse(out)
    assert not any(tag in ("script", "link", "img", "iframe", "object") for tag, _ in page.tags)
    assert not any(key in ("src", "href") for _, attrs in page.tags for key in attrs)
    policy = next(a["content"] for tag, a in page.tags if a.get("http-equiv") == "Content-Security-Policy")
    assert "default-src 'none'" in policy


def test_metadata_and_text_from_the_file_are_escaped(kvc_path, tmp_path):
    from tests.test_kvc import raw_parts, write_raw

    hostile = tmp_path / "hostile.kvc"
    tensors, metadata = raw_parts(kvc_path)
    script = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    write_raw(hostile, tensors, {**metadata, "source_name": script + HOSTILE, "model_id": metadata["model_id"]})
    out = tmp_path / "page.html"
    assert_ok(invoke("inspect", hostile, "--html", out))
    raw = out.read_text(encoding="utf-8")
    assert "<script" not in raw and "<img" not in raw
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in raw
    assert script in "".join(parse(out).text)
    assert "\\x1b]0;pwned\\x07" in raw and not any(c in raw for c in "\x1b\x07\u202e\x9b")


def test_html_into_a_missing_folder_fails_before_loading(kvc_path, tmp_path):
    assert_error(invoke("inspect", kvc_path, "--html", tmp_path / "no" / "page.html"), 7, "--html")


def test_html_to_a_device_does_not_suggest_standard_output(kvc_path, tmp_path):
    """`--html /dev/full` advised "or - for standard output", which --html refuses; compress -o takes it."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = assert_error(invoke("inspect", kvc_path, "--html", fifo), 7, "not a regular file")
    assert "standard output" not in line
    (tmp_path / "doc.txt").write_text(DOC_TEXT, encoding="utf-8")
    assert_error(invoke("compress", tmp_path / "doc.txt", "-o", fifo), 7, "or - for standard output")


def test_quiet_leaves_standard_error_empty(kvc_path, tmp_path):
    """README: notes go to stderr, none with --quiet; inspect had no --quiet, and 'wrote PAGE' could not be hushed."""
    page = tmp_path / "quiet.html"
    result = invoke("inspect", kvc_path, "--html", page, "--json", "--quiet")
    assert result.exit_code == 0 and result.stderr == "" and page.is_file()
    assert json.loads(result.stdout)["file"]
