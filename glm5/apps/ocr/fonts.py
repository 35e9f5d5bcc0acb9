"""Fonts for the evaluation page generator, found without downloads.

Latin: DejaVu Sans / Serif / Sans Mono from matplotlib's wheel (`mpl-data/fonts/ttf`, Bitstream Vera
licence), else Debian's `fonts-dejavu-core`. CJK: Noto Sans CJK from the PyPI package
`noto-cjk-sans-otc` (SIL OFL 1.1, in the `ocr` extra), else Debian's `fonts-noto-cjk` or
`fonts-wqy-microhei`/`-zenhei`. `find_font` returns None when a family is absent, so callers can
skip the pages that need it instead of failing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

Family = Literal["sans", "serif", "mono", "cjk"]

_LATIN = {"sans": "DejaVuSans.ttf", "serif": "DejaVuSerif.ttf", "mono": "DejaVuSansMono.ttf"}
_SYSTEM_DIRS = ("/usr/share/fonts/truetype/dejavu",)
_CJK_SYSTEM = ("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
               "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc",
               "/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc")


def _matplotlib_dir() -> Path | None:
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf"


def _cjk_package() -> Path | None:
    spec = importlib.util.find_spec("noto_cjk_sans_otc")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "NotoSansCJK-Regular.ttc"


def find_font(family: Family) -> Path | None:
    """Path of a font file for `family`, or None when none is installed."""
    if family == "cjk":
        candidates = [_cjk_package(), *map(Path, _CJK_SYSTEM)]
    else:
        mpl = _matplotlib_dir()
        candidates = [mpl / _LATIN[family] if mpl else None, *(Path(d) / _LATIN[family] for d in _SYSTEM_DIRS)]
    return next((p for p in candidates if p is not None and p.is_file()), None)
