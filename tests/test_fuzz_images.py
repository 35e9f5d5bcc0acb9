"""Issue 30 item 6: the image reader under generated input. Any bytes (random, or a real PNG / JPEG / GIF /
BMP / TIFF / WebP with bytes flipped, cut short, or its declared size rewritten) become an RGB uint8 array
within the pixel limit or an `ImageError`; nothing else escapes, and no input decodes past the limit."""

import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from glm5.apps.ocr.image import FORMATS, ImageError, decode_data_url, load_image

LIMIT = 4096  # pixels: small, so that rewritten sizes cross it often


def _encoded(fmt: str, w: int, h: int, mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


@st.composite
def images(draw) -> bytes:
    fmt = draw(st.sampled_from(FORMATS))
    mode = draw(st.sampled_from(["RGB", "L", "1", "P"] + (["RGBA", "LA"] if fmt in ("PNG", "WEBP", "TIFF") else [])))
    if fmt == "JPEG" and mode in ("1", "P"):
        mode = "L"
    data = bytearray(_encoded(fmt, draw(st.integers(1, 40)), draw(st.integers(1, 40)), mode, draw(st.integers(0, 99))))
    for _ in range(draw(st.integers(0, 4))):  # flip bytes anywhere, headers included
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    if fmt == "PNG" and len(data) >= 24 and draw(st.booleans()):  # claim another size in the IHDR
        data[16:24] = struct.pack(">II", draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**31 - 1)))
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _check(data: bytes) -> None:
    try:
        rgb = load_image(data, "x.png", max_pixels=LIMIT)
    except ImageError as e:
        assert str(e).startswith("x.png: "), e
        return
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3
    assert 0 < rgb.shape[0] * rgb.shape[1] <= LIMIT


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(images())
def test_mutated_images_decode_or_fail_with_an_image_error(data):
    _check(data)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=512) | st.builds(lambda head, tail: head + tail, st.sampled_from(
    [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*", b"RIFF\x00\x00\x00\x00WEBPVP8 ",
     b"%!PS-Adobe-3.0 EPSF-3.0\n"]), st.binary(max_size=256)))
def test_arbitrary_bytes_are_an_image_error_or_an_image(data):
    _check(data)


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.text(max_size=80))
def test_arbitrary_data_urls_are_a_value_error_or_bytes(url):
    try:
        out = decode_data_url("data:" + url)
    except ValueError:
        return
    assert isinstance(out, bytes)


def test_the_generator_makes_both_outcomes():
    """The property tests above see real images as well as broken ones (a check that they can fail)."""
    ok = bad = 0
    for seed in range(20):
        data = _encoded("PNG", 10 + seed, 10, "RGB", seed)
        for blob in (data, data[: len(data) // 2]):
            try:
                load_image(blob, "x.png", max_pixels=LIMIT)
                ok += 1
            except ImageError:
                bad += 1
    assert ok == 20 and bad == 20
    with pytest.raises(ImageError, match="more than the limit"):
        load_image(_encoded("PNG", 100, 100, "RGB", 0), "x.png", max_pixels=LIMIT)
