"""Knowledge distillation into small GLM-5-architecture students (`glm5 distill`, docs/eval.md)."""
