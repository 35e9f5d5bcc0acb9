"""Logging: a JSONL metrics writer (and TensorBoard when it is installed)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

logger = logging.getLogger("glm5")


class MetricsWriter:
    """Append one JSON object per line to `path`; mirror scalars to TensorBoard if available."""

    def __init__(self, path: str | Path, tensorboard: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.path.parent / "tb"))
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None

    def write(self, step: int, **metrics) -> None:
        rec = {"step": step, "time": time.time(), **metrics}
        self._f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
