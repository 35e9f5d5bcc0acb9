"""Evaluation harness (`glm5 eval`): tasks, model backends, sandbox, report. See docs/eval.md.

Backends are imported lazily (the engine pulls in the model code)."""

from .harness import EvalConfig, ModelSpec, build_model, run_config, run_task
from .lm import EvalModel, GenerationParams
from .tasks import TaskConfig, build_task


def __getattr__(name):
    if name == "EngineModel":
        from .engine_model import EngineModel
        return EngineModel
    if name == "OpenAIModel":
        from .openai_model import OpenAIModel
        return OpenAIModel
    raise AttributeError(name)


__all__ = ["EngineModel", "EvalConfig", "EvalModel", "GenerationParams", "ModelSpec", "OpenAIModel", "TaskConfig",
           "build_model", "build_task", "run_config", "run_task"]
