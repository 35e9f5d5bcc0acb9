"""What the OCR limits (glm5/apps/ocr/limits.py) bound, measured: per evaluation page its work estimate,
the recogniser pixels actually fed and the time at rounds 0 and 1; then a large page over the default
budget (time to the refusal) and a blank 6000 x 6000 page. The numbers in docs/ocr.md ("Limits").

    python bench/ocr_limits.py [--seed 0] [--no-large]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from glm5.apps.ocr.agent import OcrAgent, OcrConfig  # noqa: E402
from glm5.apps.ocr.image import load_image  # noqa: E402
from glm5.apps.ocr.limits import OcrOverBudget, WorkEstimate  # noqa: E402
from glm5.apps.ocr.pages import LAYOUTS, bundled_pool, layout_fonts, render_page  # noqa: E402


class Fed:
    """The recogniser's session, summing the pixels it is fed (B x 48 x W per batch) and its run time."""

    def __init__(self, session):
        self.session, self.px, self.s = session, 0, 0.0

    def run(self, names, feed):
        x = next(iter(feed.values()))
        self.px += x.shape[0] * x.shape[2] * x.shape[3]
        t = time.perf_counter()
        out = self.session.run(names, feed)
        self.s += time.perf_counter() - t
        return out


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-large", action="store_true", help="skip the large pages")
    args = p.parse_args(argv)
    pool = bundled_pool()
    free = OcrAgent(OcrConfig(rounds=1, max_work_mpx=None))  # no budget: time every page
    fed = Fed(free.perception.recognizer.session)
    free.perception.recognizer.session = fed
    free.read_bytes(png(render_page("single", pool, args.seed + 1).image), rounds=1)  # warm-up
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("layout      size       lines  est r0  est r0-1 (Mpx) | rounds 0: s, fed Mpx | rounds 1: s, fed Mpx | rec Mpx/s")
    for layout in LAYOUTS:
        if layout_fonts(layout) is None:
            print(f"{layout}: skipped, a font is missing")
            continue
        data = png(render_page(layout, pool, args.seed).image)
        rgb = load_image(data)
        est = WorkEstimate.of(free.perception.detector(np.ascontiguousarray(rgb[:, :, ::-1])))
        row = f"{layout:11s} {rgb.shape[1]}x{rgb.shape[0]}  {est.lines:5d}  {est.total(0):6.2f}  {est.total(1):6.2f}"
        for rounds in (0, 1):
            fed.px, fed.s = 0, 0.0
            t = time.perf_counter()
            free.read_bytes(data, layout, rounds=rounds)
            row += f"       | {time.perf_counter() - t:6.2f} s {fed.px / 1e6:5.2f}"
        print(f"{row}       | {fed.px / 1e6 / fed.s:.2f}", flush=True)
    if not args.no_large:
        agent = OcrAgent(OcrConfig(rounds=1), perception=free.perception)  # the default budget
        page = render_page("two_column", pool, args.seed).image
        for nx, ny in ((2, 2), (4, 3)):  # the page tiled nx x ny
            big = Image.new("RGB", (page.width * nx, page.height * ny), "white")
            for i in range(nx):
                for j in range(ny):
                    big.paste(page, (i * page.width, j * page.height))
            est = WorkEstimate.of(agent.perception.detector(np.ascontiguousarray(np.asarray(big)[:, :, ::-1])))
            t = time.perf_counter()
            try:
                res = agent.read_bytes(png(big), f"tiled-{nx}x{ny}.png")
                print(f"two_column tiled {nx}x{ny} {big.width}x{big.height}: estimate {est.total(1):.1f} Mpx, "
                      f"{len(res.lines)} lines read in {time.perf_counter() - t:.1f} s")
            except OcrOverBudget as e:
                print(f"two_column tiled {nx}x{ny} {big.width}x{big.height}: refused after "
                      f"{time.perf_counter() - t:.1f} s: {e}")
        t = time.perf_counter()
        res = agent.read_bytes(png(Image.new("RGB", (6000, 6000), "white")), "blank.png")
        print(f"blank 6000x6000: {len(res.lines)} lines, {time.perf_counter() - t:.1f} s")
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
