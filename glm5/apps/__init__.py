"""Applications built on the glm5 stack (above `serve`, below `cli`): `ocr` is the OCR agent."""
