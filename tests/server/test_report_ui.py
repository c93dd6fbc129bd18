"""The run report as a Prefect UI user sees it: the `report-<config>` artifact, created by the real
`report` task against the real server, opened on the server's own UI in headless Chromium (Debian's
package, driven by playwright without a browser download of its own).

Checked on the rendered page, at a 1280x800 laptop viewport: every <img> loaded (complete, naturalWidth
> 0), nothing wider than its container (the report, each table, each cell: the UI renders cells without
wrapping, so one long cell widens its table past the page; a table taller than the screen scrolls
inside its box), no number with more than 6 significant
digits in the report's text. A control artifact in the old format (relative image paths, one wide
"key numbers" column, raw floats) must fail each of the three checks. The screenshot is saved under
the test's tmp dir; its path is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from eagle3_pipeline.report.record import RunReport  # module level: Prefect resolves the flow's annotations here
from tests.helpers.report_sample import long_numbers, sample_metrics, sample_report
from tests.helpers.server import artifacts

VIEWPORT = {"width": 1280, "height": 800}

# Everything measured in the page, in one pass: image states, what is wider than its box, and the text
# of the report outside code spans (hashes, paths and ids are code), one entry per text node.
MEASURE = """() => {
  const art = document.querySelector('.artifact-data-markdown');  // the artifact's data (the description is markdown too)
  const over = [];
  const fits = (el, inner, what) => {
    if (inner.scrollWidth > el.clientWidth + 1) over.push(`${what}: ${inner.scrollWidth}px wide in ${el.clientWidth}px`);
  };
  fits(art, art, 'the report');
  art.querySelectorAll('table').forEach((t, i) => {  // the UI's table box: at most 100vh tall, scrolls inside
    const what = `table ${i + 1} ("${t.querySelector('th')?.textContent.trim()}" ...)`;
    fits(t.parentElement, t, what);
    const box = t.parentElement;
    if (box.scrollHeight > box.clientHeight + 1) over.push(`${what}: ${box.scrollHeight}px tall in ${box.clientHeight}px`);
  });
  art.querySelectorAll('td, th').forEach(c => fits(c, c, `cell "${c.textContent.trim().slice(0, 50)}"`));
  const right = art.getBoundingClientRect().right;
  art.querySelectorAll('img').forEach(i => {
    if (i.getBoundingClientRect().right > right + 1) over.push(`image "${i.alt}" past the report's right edge`);
  });
  const texts = [];
  const walk = document.createTreeWalker(art, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    if (!n.parentElement.closest('code, pre') && n.data.trim()) texts.push(n.data);
  }
  return {
    images: [...document.images].map(i => ({src: (i.getAttribute('src') || '').slice(0, 60), alt: i.alt,
                                            complete: i.complete, width: i.naturalWidth})),
    tables: art.querySelectorAll('table').length, over, texts,
  };
}"""


def problems(page: dict) -> dict[str, list[str]]:
    """The three checks on one measured page: broken images, overflow, over-long numbers."""
    broken = [f"{i['alt'] or i['src']}: complete={i['complete']} naturalWidth={i['width']}"
              for i in page["images"] if not (i["complete"] and i["width"] > 0)]
    return {"broken_images": broken, "overflow": page["over"], "long_numbers": long_numbers(page["texts"])}


def chromium() -> str:
    path = os.environ.get("EAGLE3_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, ("no Chromium: `make test` installs Debian's `chromium` package (apt-get install chromium); "
                  "or point EAGLE3_CHROMIUM at a Chromium binary")
    return path


def open_artifact(browser, url: str, n_images: int, screenshot: Path | None = None) -> dict:
    """Open an artifact page like a user, wait until the report and its images are there, measure it."""
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(url)
        page.wait_for_selector(".artifact-data-markdown table", timeout=60_000)
        page.wait_for_function(f"document.images.length >= {n_images} && [...document.images].every(i => i.complete)",
                               timeout=30_000)
        measured = page.evaluate(MEASURE)
        if screenshot:
            page.screenshot(path=str(screenshot.with_name(screenshot.stem + "-first-screen.png")))
            scrolled_screenshot(page, ".artifact-data-markdown", screenshot)
        return measured
    finally:
        page.close()


# The UI scrolls its content in a box of its own (the document is one screen tall, so a full-page
# screenshot is one screen, and an element screenshot leaves what is outside the box blank): scroll that
# box a screen at a time and stitch the report's visible parts.
SCROLL_TO = """([sel, y]) => {
  const el = document.querySelector(sel);
  let box = el.parentElement;
  while (box && !(['auto', 'scroll'].includes(getComputedStyle(box).overflowY) && box.scrollHeight > box.clientHeight))
    box = box.parentElement;
  if (box) box.scrollTop = y;
  const r = el.getBoundingClientRect(), v = box ? box.getBoundingClientRect() : {top: 0, bottom: innerHeight};
  return {top: r.top, bottom: r.bottom, left: r.left, width: r.width, vtop: Math.max(0, v.top),
          vbottom: Math.min(innerHeight, v.bottom), scroll: box ? box.scrollTop : 0,
          max: box ? box.scrollHeight - box.clientHeight : 0};
}"""


def scrolled_screenshot(page, selector: str, path: Path) -> None:
    import io

    from PIL import Image

    parts, y = [], 0
    while True:
        r = page.evaluate(SCROLL_TO, [selector, y])
        lo, hi = max(r["top"], r["vtop"]), min(r["bottom"], r["vbottom"])
        if hi > lo:
            png = page.screenshot(clip={"x": r["left"], "y": lo, "width": r["width"], "height": hi - lo})
            parts.append((lo - r["top"], Image.open(io.BytesIO(png))))
        if r["bottom"] <= r["vbottom"] or r["scroll"] >= r["max"]:
            break
        y = r["scroll"] + (r["vbottom"] - r["vtop"]) - 40
    out = Image.new("RGB", (round(r["width"]), round(r["bottom"] - r["top"])))
    for offset, im in parts:
        out.paste(im, (0, round(offset)))
    out.save(path)


def old_style_markdown(report: dict) -> str:
    """report.md as it was before issue 17: one "key numbers" column of k=v pairs with raw values,
    plots as links relative to the run dir."""
    lines = [f"# eagle3-pipeline run `{report['run_id']}`", "", f"**Status:** {report['status']}", "",
             "| stage | key numbers |", "|---|---|"]
    for name, st in report["stages"].items():
        lines.append(f"| {name} | " + ", ".join(f"{k}={v}" for k, v in st.items() if k not in ("details", "per_category")) + " |")
    lines += ["", "![plots/train_loss.png](plots/train_loss.png)", "![plots/acceptance.png](plots/acceptance.png)"]
    return "\n".join(lines) + "\n"


def test_report_artifact_in_the_prefect_ui(prefect_server, client, tmp_path):
    from playwright.sync_api import sync_playwright
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact

    from tasks.stage_tasks import _k, report

    t0 = time.time()
    sample = sample_report()
    sample["config"]["name"] = "ui-report-check"
    rec = RunReport.model_validate(sample)
    metrics = sample_metrics(tmp_path / "metrics.jsonl")

    @flow(name="report-ui-check")
    def make_artifacts(run_dir: str, rec: RunReport, metrics: str) -> dict:
        paths = report(run_dir, rec, metrics)  # the pipeline's own report task: write_report + the artifact
        create_markdown_artifact(key="report-old-style", markdown=old_style_markdown(sample), description="control")
        return paths

    paths = make_artifacts(str(tmp_path / "run"), rec, str(metrics))
    key = f"report-{_k(rec.config['name'])}"
    (new,), (old,) = artifacts(client, key), artifacts(client, "report-old-style")
    assert new.data == Path(paths["report_md"]).read_text()  # the UI artifact is report.md itself
    size = len(new.data.encode())
    n_plots = len(re.findall(r"^\[\w+\]: data:image/png;base64,", new.data, flags=re.M))
    assert n_plots == 3, new.data[:2000]  # training, acceptance per position, τ per category
    print(f"\nartifact {key}: {size / 1024:.1f} KiB of markdown, {n_plots} embedded plots")

    shot = tmp_path / "report-artifact.png"
    t1 = time.time()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = open_artifact(browser, f"{prefect_server.ui}/artifacts/artifact/{new.id}", n_plots, shot)
            control = open_artifact(browser, f"{prefect_server.ui}/artifacts/artifact/{old.id}", 2)
        finally:
            browser.close()
    print(f"screenshot: {shot}\nbrowser part {time.time() - t1:.1f}s, whole test {time.time() - t0:.1f}s")

    # the rendered report: every table of report.md (per category, one per stage, time), every plot
    # shown, nothing too wide or too tall
    assert page["tables"] == new.data.count("\n|---") >= 9, page
    assert sum(1 for i in page["images"] if i["src"].startswith("data:image/png")) == n_plots, page["images"]
    found = problems(page)
    assert found == {"broken_images": [], "overflow": [], "long_numbers": []}, found
    text = " ".join(page["texts"])
    for shown in ("2.175", "0.62×", "online", "2.1 MB", "48,213", "τ at T=0.7", "multi-turn"):
        assert shown in text, f"{shown!r} not in the rendered report"
    assert shot.stat().st_size > 10_000

    # the control: the old format fails every check
    bad = problems(control)
    assert len(bad["broken_images"]) == 2 and all("naturalWidth=0" in b for b in bad["broken_images"]), bad
    assert any(o.startswith("table 1") for o in bad["overflow"]), bad
    assert "0.2856296896934509" in bad["long_numbers"], bad
