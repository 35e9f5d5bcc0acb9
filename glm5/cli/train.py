"""`glm5 train --config configs/train/<name>.toml [--resume auto] [--section.key=value ...]`."""

from glm5.train.launch import main

__all__ = ["main"]
