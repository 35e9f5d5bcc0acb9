"""Untrusted image input -> an RGB uint8 array, or an `ImageError` that says what is wrong.

Only raster formats decoded inside Pillow are accepted (PNG, JPEG, WebP, BMP, TIFF, GIF: first
frame); formats that call out to other programs (EPS runs Ghostscript) are refused. The pixel count is
checked from the header before any decoding, so a decompression bomb costs nothing; truncated files,
zero-size images and non-images are errors. `data:` URLs (base64) are decoded here; remote URLs are
refused (the server does not fetch).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF")
MAX_PIXELS = 40_000_000  # about 6300 x 6300: a 600-dpi A4 scan fits
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class ImageError(ValueError):
    """The input is not an image this reader accepts; the message names the reason."""


def load_image(data: bytes, name: str = "image", max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Encoded image bytes -> [H, W, 3] uint8 RGB (EXIF rotation applied, alpha over white)."""
    if not data:
        raise ImageError(f"{name}: empty file")
    try:
        im = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError as e:
        raise ImageError(f"{name}: not a supported image (accepted: {', '.join(FORMATS)})") from e
    except Image.DecompressionBombError as e:
        raise ImageError(f"{name}: image too large ({e})") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{name}: cannot read the image header: {e}") from e
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ImageError(f"{name}: zero-size image ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(f"{name}: image has {w}x{h} = {w * h} pixels, more than the limit of {max_pixels}")
    try:
        im.load()
        im = ImageOps.exif_transpose(im)
        return _to_rgb(im)
    except Image.DecompressionBombError as e:
        raise ImageError(f"{name}: image too large ({e})") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"{name}: corrupt or truncated image data ({e})") from e


def _to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode in ("I", "I;16", "I;16B", "I;16L", "F"):  # 16/32-bit grey: stretch to 8 bits
        a = np.asarray(im, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
        im = Image.fromarray(a.astype(np.uint8))
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        im = im.convert("RGBA")
        background = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, im)
    return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


def decode_data_url(url: str, name: str = "image_url") -> bytes:
    """`data:image/png;base64,...` -> bytes. Remote (http/https/file) URLs are refused."""
    m = _DATA_URL.match(url)
    if not m:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "(none)"
        raise ImageError(f"{name}: only inline `data:` URLs are accepted (got scheme {scheme!r}); "
                         "send the image base64-encoded as data:image/png;base64,...")
    if not m.group("b64"):
        raise ImageError(f"{name}: the data URL must be base64-encoded (data:<mime>;base64,...)")
    return decode_base64(url[m.end():], name)


def decode_base64(text: str, name: str = "image") -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{name}: invalid base64 ({e})") from e


def read_image_file(path: str | Path, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Load an image file from disk with the same checks as uploaded bytes."""
    p = Path(path)
    if not p.is_file():
        raise ImageError(f"{p}: no such file")
    return load_image(p.read_bytes(), str(p), max_pixels)
