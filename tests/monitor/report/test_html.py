"""The HTML report renders in headless Chromium: every plot present, none broken."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from monitor.report import build_report, load_registry, render_html
from monitor.settings import Settings
from tests.monitor.report.synthetic import fill_week

PLOTS = ("p99", "acceptance", "memory", "recompiles", "shapes")
CHROMIUM = shutil.which("chromium")
# Records each image's decoded width into the DOM, so --dump-dom reports broken images.
PROBE = """<script>
window.addEventListener("load", () => {
  const pre = document.createElement("pre");
  pre.id = "img-check";
  pre.textContent = [...document.images].map(i => `${i.id}=${i.naturalWidth}`).join(" ");
  document.body.appendChild(pre);
});
</script>
<img id="control-broken" src="data:image/png;base64,AAAA">
</body>"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test-deps)"),
]


def _chromium(tmp: Path, *args: str) -> str:
    cmd = [CHROMIUM or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
           *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def test_html_renders_every_plot(sessionmaker, report_settings: Settings,
                                 tmp_path: Path) -> None:
    fill_week(sessionmaker)
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", datetime(2026, 11, 30, 6, tzinfo=UTC),
                              load_registry(), report_settings)
    html = render_html(report)
    assert re.findall(r'(?:src|href)="(?!data:)', html) == []  # nothing from the network
    page = tmp_path / "report.html"
    page.write_text(html)
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", PROBE))

    dom = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    m = re.search(r'<pre id="img-check">([^<]*)</pre>', dom)
    assert m is not None, dom[-2000:]
    widths = dict(item.split("=") for item in m.group(1).split())
    assert widths.pop("control-broken") == "0"  # the check does see a broken image
    assert set(widths) == {f"plot-{k}" for k in PLOTS}
    assert all(int(w) > 0 for w in widths.values()), widths

    shot = tmp_path / "shot.png"
    _chromium(tmp_path, "--screenshot=" + str(shot), "--window-size=1200,4000",
              "--hide-scrollbars", page.as_uri())
    from PIL import Image

    with Image.open(shot) as img:
        rgb = img.convert("RGB")
        assert rgb.size == (1200, 4000)
        colors = rgb.getcolors(maxcolors=1 << 20) or []
    # A blank page has one colour; text plus plots give hundreds.
    assert len(colors) > 100
    non_white = sum(n for n, c in colors if c != (255, 255, 255))
    assert non_white > 0.02 * 1200 * 4000
