"""Untrusted image input: every bad file is an ImageError naming the problem; good ones decode to RGB."""

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from glm5.apps.ocr.image import ImageError, decode_base64, decode_data_url, load_image


def encode(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (and carries one tiny IDAT): Pillow reads only the header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0\0")) + chunk(b"IEND", b"")


def test_png_jpeg_rgba_and_grey16_decode_to_rgb():
    rgba = Image.new("RGBA", (7, 5), (255, 0, 0, 0))  # fully transparent red -> white background
    out = load_image(encode(rgba))
    assert out.shape == (5, 7, 3) and out.dtype == np.uint8 and (out == 255).all()
    jpg = load_image(encode(Image.new("RGB", (9, 4), (10, 200, 30)), "JPEG"))
    assert jpg.shape == (4, 9, 3) and abs(int(jpg[0, 0, 1]) - 200) < 8
    grey16 = Image.fromarray(np.array([[0, 1000], [2000, 4000]], dtype=np.uint16))
    g = load_image(encode(grey16))
    assert g[0, 0, 0] == 0 and g[1, 1, 0] == 255


@pytest.mark.parametrize("data,words", [
    (b"", "empty"),
    (b"hello, this is not an image", "not a supported image"),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not a supported image"),  # EPS would run Ghostscript
    (png_header(7_000, 7_000), "more than the limit"),  # ours: 49M > 40M pixels
    (png_header(50_000, 50_000), "too large"),  # Pillow's own decompression-bomb error, reworded
    (png_header(0, 10), "image"),
])
def test_bad_inputs_are_clear_errors(data, words):
    with pytest.raises(ImageError, match=words):
        load_image(data, "upload.png")


def test_truncated_and_corrupt_files():
    good = encode(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)))
    with pytest.raises(ImageError, match="upload.png: corrupt or truncated"):
        load_image(good[: len(good) // 2], "upload.png")
    jpg = encode(Image.new("RGB", (64, 64), "white"), "JPEG")
    with pytest.raises(ImageError, match="upload.jpg"):
        load_image(jpg[:40], "upload.jpg")


def test_pixel_limit_is_configurable():
    data = encode(Image.new("RGB", (100, 100), "white"))
    assert load_image(data, max_pixels=10_000).shape == (100, 100, 3)
    with pytest.raises(ImageError, match="limit of 9999"):
        load_image(data, max_pixels=9_999)


def test_data_urls_and_base64():
    data = encode(Image.new("RGB", (3, 2), "white"))
    b64 = base64.b64encode(data).decode()
    assert decode_data_url(f"data:image/png;base64,{b64}") == data
    assert decode_base64(b64[:10] + "\n" + b64[10:]) == data  # line-wrapped base64 is fine
    with pytest.raises(ImageError, match="only inline `data:` URLs"):
        decode_data_url("https://example.com/a.png")
    with pytest.raises(ImageError, match="base64-encoded"):
        decode_data_url("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="invalid base64"):
        decode_base64("not base64 !!!")
