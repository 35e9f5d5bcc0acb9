"""Perception: text detection + line recognition on CPU, with per-character confidences and rivals.

Built on RapidOCR (`pip install glm5[ocr]`), which ships PaddleOCR's PP-OCR models as ONNX inside
its wheel: a DB text detector (a convolutional vision encoder + segmentation head) finds line
quadrilaterals through RapidOCR's public pipeline (`use_rec=False`), and the CTC recogniser
(an SVTR encoder) runs here through onnxruntime on the same model file, so that every line comes
back as a confusion network (`ctc.Slot`s) instead of a bare string. Why this library: see
docs/ocr.md (measured against tesseract and RapidOCR's PP-OCRv6 release on this CPU).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from glm5.apps.ocr import ctc

if TYPE_CHECKING:
    from glm5.apps.ocr.limits import Deadline

REC_HEIGHT = 48  # the recogniser's input height
MAX_RATIO = 80  # widest crop (width / height) fed in one piece
MIN_BATCH_WIDTH = 320  # batches are padded to at least this width


class OcrUnavailable(RuntimeError):
    """The OCR extra is not installed."""


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise OcrUnavailable(f"the OCR agent needs `{module}`: pip install 'glm5[ocr]'")


@dataclass
class Reading:
    """One recognised text line as a confusion network."""

    slots: list[ctc.Slot]

    @property
    def text(self) -> str:
        return ctc.text_of(self.slots)

    @property
    def conf(self) -> float:
        return ctc.line_conf(self.slots)

    @property
    def char_confs(self) -> list[float]:
        return ctc.char_confs(self.slots)

    @property
    def min_conf(self) -> float:
        """Lowest slot confidence, insertion slots included (1.0 for an empty reading)."""
        return min((s.conf for s in self.slots), default=1.0)


@dataclass
class Line:
    """A detected line: its quadrilateral (4 corners, clockwise from top-left) and its reading."""

    quad: np.ndarray  # [4, 2] float32 page pixels
    reading: Reading
    source: str = "raw"  # which crop variant produced the reading (round 1 may replace it)
    history: list[dict] = field(default_factory=list)
    alternatives: list[tuple[str, Reading]] = field(default_factory=list)
    """Round 1's other readings of this line (source, reading): the language-model rounds draw candidates from them."""

    @property
    def box(self) -> tuple[float, float, float, float]:
        return (float(self.quad[:, 0].min()), float(self.quad[:, 1].min()),
                float(self.quad[:, 0].max()), float(self.quad[:, 1].max()))

    @property
    def height(self) -> float:
        return float(np.linalg.norm(self.quad[3] - self.quad[0]) + np.linalg.norm(self.quad[2] - self.quad[1])) / 2

    @property
    def angle(self) -> float:
        """Slope of the top edge in degrees (positive = falling to the right on screen)."""
        dx, dy = self.quad[1] - self.quad[0]
        return math.degrees(math.atan2(float(dy), float(dx)))


class Recognizer:
    """The PP-OCR CTC recogniser through onnxruntime: BGR crops -> `Reading`s."""

    def __init__(self, model_path: str | Path, num_threads: int = 0, batch_size: int = 8):
        _require("onnxruntime")
        import onnxruntime as ort  # noqa: PLC0415 - optional dependency

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = num_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        if "character" not in meta:
            raise OcrUnavailable(f"{model_path}: recogniser model carries no character list")
        # class 0 is the CTC blank; the model's list follows, then the space class
        self.charset = ["", *meta["character"].splitlines(), " "]
        self.input_name = self.session.get_inputs()[0].name
        self.batch_size = batch_size

    def __call__(self, crops: list[np.ndarray], deadline: Deadline | None = None,
                 stage: str = "recognition") -> list[Reading]:
        """crops: BGR uint8 [h, w, 3] line images, any size -> one Reading each (same order). The
        deadline is checked before every batch (`OcrTimeout` naming `stage`)."""
        order = sorted(range(len(crops)), key=lambda i: crops[i].shape[1] / max(1, crops[i].shape[0]))
        out: list[Reading | None] = [None] * len(crops)
        for start in range(0, len(order), self.batch_size):
            if deadline is not None:
                deadline.check(stage)
            idx = order[start:start + self.batch_size]
            batch, widths = self._batch([crops[i] for i in idx])
            probs = self.session.run(None, {self.input_name: batch})[0]  # [B, T, C]
            total = batch.shape[3]
            for j, i in enumerate(idx):
                frames = max(1, math.ceil(probs.shape[1] * widths[j] / total))
                out[i] = Reading(ctc.decode(probs[j], self.charset, frames))
        return out  # type: ignore[return-value]

    @staticmethod
    def _batch(crops: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
        """Resize to height 48 keeping the aspect ratio, normalise to [-1, 1], right-pad with zeros."""
        import cv2  # noqa: PLC0415 - optional dependency

        widths = [min(REC_HEIGHT * MAX_RATIO, max(8, math.ceil(REC_HEIGHT * c.shape[1] / max(1, c.shape[0]))))
                  for c in crops]
        width = max(MIN_BATCH_WIDTH, max(widths))
        batch = np.zeros((len(crops), 3, REC_HEIGHT, width), dtype=np.float32)  # [B, 3, 48, W]
        for k, (c, w) in enumerate(zip(crops, widths)):
            img = cv2.resize(c, (w, REC_HEIGHT), interpolation=cv2.INTER_LINEAR).astype(np.float32)
            batch[k, :, :, :w] = (img.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
        return batch, widths


BOX_THRESH = 0.3
"""Mean text probability a detected region needs to count as a line. RapidOCR's default, 0.5, drops
whole clean lines (a monospace docstring on the seed-0 code page scores 0.3-0.5); over the 60
evaluation pages of seeds 0-1 (every condition) 0.3 adds 4 regions: 2 missed lines, 1 empty and 1
one-character fragment (docs/ocr.md)."""


class Detector:
    """RapidOCR's DB text detector through its public pipeline (`use_cls=False, use_rec=False`)."""

    def __init__(self, num_threads: int = 0, box_thresh: float = BOX_THRESH):
        _require("rapidocr_onnxruntime")
        from rapidocr_onnxruntime import RapidOCR  # noqa: PLC0415 - optional dependency

        threads = num_threads if num_threads > 0 else -1
        self.engine = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1)
        self.box_thresh = box_thresh

    def __call__(self, bgr: np.ndarray) -> list[np.ndarray]:
        """BGR uint8 page -> line quads [4, 2] float32 (clockwise from top-left)."""
        # RapidOCR keeps call options on the engine (and resets those not passed to their defaults):
        # pass every one on every call so that no earlier call decides this one's boxes
        result, _ = self.engine(bgr, use_det=True, use_cls=False, use_rec=False,
                                box_thresh=self.box_thresh, unclip_ratio=1.6, text_score=0.5)
        return [np.asarray(q, dtype=np.float32).reshape(4, 2) for q in result or []]

    @staticmethod
    def recognizer_model() -> Path:
        spec = importlib.util.find_spec("rapidocr_onnxruntime")
        assert spec is not None and spec.origin is not None
        return Path(spec.origin).parent / "models" / "ch_PP-OCRv4_rec_infer.onnx"


def crop_line(bgr: np.ndarray, quad: np.ndarray, pad: float = 0.0) -> np.ndarray:
    """Perspective-rectified crop of a line quad, grown by `pad` x line height above and below (and a
    quarter of that at the ends: more would take in a neighbouring piece's characters)."""
    import cv2  # noqa: PLC0415 - optional dependency

    q = quad.astype(np.float32)
    if pad:
        h = float(np.linalg.norm(q[3] - q[0]))
        along = (q[1] - q[0]) / max(1e-6, float(np.linalg.norm(q[1] - q[0])))
        across = np.array([-along[1], along[0]], dtype=np.float32)
        signs = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=np.float32)  # (along, across) per corner
        q = q + signs[:, :1] * along * (0.25 * pad * h) + signs[:, 1:] * across * (pad * h)
    w = max(1, int(round(max(np.linalg.norm(q[0] - q[1]), np.linalg.norm(q[2] - q[3])))))
    h = max(1, int(round(max(np.linalg.norm(q[0] - q[3]), np.linalg.norm(q[1] - q[2])))))
    dst = np.array([[0, 0], [w, 0], [w, h], [0, h]], dtype=np.float32)
    m = cv2.getPerspectiveTransform(q, dst)
    return cv2.warpPerspective(bgr, m, (w, h), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC)


class Perception:
    """Detector + recogniser: an RGB page -> `Line`s (detection order)."""

    def __init__(self, num_threads: int = 0):
        self.detector = Detector(num_threads)
        self.recognizer = Recognizer(Detector.recognizer_model(), num_threads)

    def __call__(self, rgb: np.ndarray) -> list[Line]:
        bgr = np.ascontiguousarray(rgb[:, :, ::-1])
        return self.recognise(bgr, self.detector(bgr))

    def recognise(self, bgr: np.ndarray, quads: list[np.ndarray], deadline: Deadline | None = None) -> list[Line]:
        """Detected quads on a BGR page -> `Line`s (same order), checking `deadline` between batches."""
        readings = self.recognizer([crop_line(bgr, q) for q in quads], deadline)
        return [Line(q, r) for q, r in zip(quads, readings)]
