"""Small test images drawn with the generator's fonts (shared by the OCR agent, CLI and server tests),
and the helpers of the limits tests: a page's work estimate and a recogniser session on a fake clock."""

import io

import numpy as np

from PIL import Image, ImageDraw, ImageFont

from glm5.apps.ocr.fonts import find_font

LINES = ["The quick brown fox jumps", "over the lazy dog 1234"]
MANY = [f"Line {k} of a longer page of text" for k in range(20)]  # 20 lines: 3 recogniser batches of 8


def text_png(lines=LINES, size=28) -> bytes:
    font = ImageFont.truetype(str(find_font("sans")), size)
    im = Image.new("RGB", (520, 40 + 50 * len(lines)), "white")
    draw = ImageDraw.Draw(im)
    for k, s in enumerate(lines):
        draw.text((20, 20 + 50 * k), s, fill="black", font=font)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def blank_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (300, 200), "white").save(buf, format="PNG")
    return buf.getvalue()


def estimate(agent, png: bytes):
    """The `WorkEstimate` the agent makes of a page (its detector on the decoded image)."""
    from glm5.apps.ocr.image import load_image
    from glm5.apps.ocr.limits import WorkEstimate

    return WorkEstimate.of(agent.perception.detector(np.ascontiguousarray(load_image(png)[:, :, ::-1])))


class CountingSession:
    """The recogniser's onnxruntime session, counting runs and advancing a fake clock by 1 s per run."""

    def __init__(self, session, now: list[float]):
        self.session, self.now, self.runs = session, now, 0

    def run(self, *args, **kwargs):
        self.runs += 1
        self.now[0] += 1.0
        return self.session.run(*args, **kwargs)
