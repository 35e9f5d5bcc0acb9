"""glm5 as an lm-evaluation-harness model: `--model glm5 --model_args pretrained=DIR[,max_length=..]`.

Importing this module registers the name "glm5" in lm-eval's model registry (lm-eval 0.4 has no
entry-point discovery, so its own `lm_eval` command cannot see third-party models):

    glm5 lm-eval run --model glm5 --model_args pretrained=runs/tiny/final --tasks mmlu   # lm-eval's CLI
    import glm5.eval.lm_eval_model; lm_eval.simple_evaluate(model="glm5", model_args="pretrained=DIR", ...)

Requests are served by `EngineModel` (the glm5 engine, batched; one forward per multiple-choice
question), so scores are the harness's own: identical to lm-eval's `hf` model on the same checkpoint.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (lm-eval registers its own models on first import; keep them)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from .engine_model import EngineModel
from .lm import GenerationParams


def _bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("glm5")
class GLM5LM(LM):
    def __init__(self, pretrained: str = "tiny", max_length: int = 2048, batch_size: int | str = 64,
                 device: str | None = None, dtype: str | None = None, add_special_tokens: bool | str = True,
                 max_gen_toks: int = 256, **unused):
        super().__init__()
        bs = 64 if str(batch_size).startswith("auto") else int(batch_size)
        opts = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        self.model = EngineModel(pretrained, max_length=int(max_length), batch_size=bs,
                                 add_special_tokens=_bool(add_special_tokens), **opts)
        self.max_gen_toks = int(max_gen_toks)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.model.loglikelihood([tuple(r.args) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [lp for lp, _ in self.model.loglikelihood_rolling([r.args[0] for r in requests])]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings are generated together."""
        groups: dict[GenerationParams, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self._params(r.args[1]), []).append(i)
        out = [""] * len(requests)
        for params, idx in groups.items():
            texts = self.model.generate([requests[i].args[0] for i in idx], params)
            for i, t in zip(idx, texts):
                out[i] = t[0]
        return out

    def _params(self, kw: dict) -> GenerationParams:
        until = kw.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        greedy = not kw.get("do_sample", False)
        return GenerationParams(max_tokens=int(kw.get("max_gen_toks", self.max_gen_toks)),
                                temperature=0.0 if greedy else float(kw.get("temperature", 1.0)),
                                top_p=float(kw.get("top_p", 1.0)), stop=tuple(until))
