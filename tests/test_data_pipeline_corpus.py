"""The bundled corpus snapshot is reproducible: rebuilding from the Debian packages gives the same bytes
(slow; skipped where the packages are not installed)."""

import pytest

from glm5.core.resources import bundled
from glm5.data.pipeline.corpus import FORTUNES, MATH_SOURCES, MAXIMA_INFO, PYDOC, build


@pytest.mark.slow
@pytest.mark.skipif(not (FORTUNES / "tang300").is_file() or not PYDOC.is_dir(),
                    reason="corpus Debian packages are not installed")
def test_rebuild_matches_committed_snapshot(tmp_path):
    counts = build(tmp_path)
    assert counts["train"] > 20_000
    for name in ("train.jsonl.gz", "validation.jsonl.gz"):
        assert (tmp_path / name).read_bytes() == bundled(f"corpus/{name}").read_bytes(), name


@pytest.mark.slow
@pytest.mark.skipif(not (MAXIMA_INFO / "maxima.info-1.gz").is_file(), reason="maxima-doc is not installed")
def test_math_set_rebuild_matches_committed_snapshot(tmp_path):
    counts = build(tmp_path, sources=MATH_SOURCES)
    assert counts["train"] > 100
    for name in ("train.jsonl.gz", "validation.jsonl.gz"):
        assert (tmp_path / name).read_bytes() == bundled(f"corpus-math/{name}").read_bytes(), name
