"""Small test images drawn with the generator's fonts (shared by the OCR agent, CLI and server tests)."""

import io

from PIL import Image, ImageDraw, ImageFont

from glm5.apps.ocr.fonts import find_font

LINES = ["The quick brown fox jumps", "over the lazy dog 1234"]


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
