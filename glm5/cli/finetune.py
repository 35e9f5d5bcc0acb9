"""`glm5 finetune --config configs/finetune/<name>.toml [--method ...] [--resume auto] [--section.key=value ...]`."""

from glm5.finetune.launch import main

__all__ = ["main"]
