"""oneDNN GEMMs for prefill-sized steps (`EngineConfig.gemm`, glm5/infer/onednn.py): the packed linear layers
and routed experts compute what the model's modules compute, a packed copy never outlives an in-place write
of its weight (an expert hot swap), and the engine's choice is made once at build, refused where it cannot run."""

import copy

import pytest
import torch
import torch.nn.functional as F

from glm5.infer import onednn
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.kernels import NativeExperts, NativeLinear, _swapped, use_onednn
from glm5.infer.layout import transpose_weights
from glm5.model.moe import Experts

from ._tiny import tiny_config, tiny_model
from .test_engine_options import run

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not onednn.available(), reason="this PyTorch build has no oneDNN")]


def _packed_linear(n_in: int, n_out: int, bias: bool) -> NativeLinear:
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    transpose_weights(lin)  # [in, out] storage, as the engine serves
    fast = _swapped(NativeLinear, lin)
    assert use_onednn(fast) == 1 and fast.onednn is not None
    return fast


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear_and_follows_in_place_writes(bias):
    torch.manual_seed(0)
    fast = _packed_linear(48, 40, bias)
    x = torch.randn(3, onednn.ONEDNN_MIN_ROWS, 48)  # 48 rows: the oneDNN path
    with torch.no_grad():
        assert torch.allclose(fast(x), F.linear(x, fast.weight, fast.bias), atol=1e-5)
        fast.weight[5].fill_(0.25)  # an in-place write, as a hot swap does
        got = fast(x)
    assert torch.allclose(got, F.linear(x, fast.weight, fast.bias), atol=1e-5)
    assert torch.allclose(got[..., 5], x @ torch.full((48,), 0.25) + (fast.bias[5] if bias else 0), atol=1e-5)


def test_weights_made_under_inference_mode_are_not_packed():
    """They keep no version counter, so a pack could not follow an in-place write: they stay on `mm`."""
    with torch.inference_mode():
        lin = torch.nn.Linear(48, 40)
    transpose_weights(lin)
    assert use_onednn(_swapped(NativeLinear, lin)) == 0


def served_experts_and_step(seed: int) -> tuple[Experts, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """4 experts (top-2) stored [in, out] as the engine serves them, and a prefill-sized step for them:
    x [40, H], idx / w [40, 2] (80 assignments, 20 rows an expert: above LOOP_MIN_ROWS_PER_EXPERT and
    ONEDNN_MIN_ROWS)."""
    cfg = tiny_config(n_routed_experts=4, num_experts_per_tok=2)
    torch.manual_seed(seed)
    ref = Experts(cfg)
    torch.nn.init.normal_(ref.gate_up_proj, std=0.2)
    torch.nn.init.normal_(ref.down_proj, std=0.2)
    transpose_weights(ref)
    n = 40
    x = torch.randn(n, cfg.hidden_size)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(n)])
    return ref, (x, idx, torch.rand(n, 2))


def test_experts_loop_on_onednn_equals_the_model_experts():
    """The routed experts' BLAS loop (prefill-sized steps) on packed weights: the model module's output,
    also after one expert's weights are rewritten in place."""
    ref, (x, idx, w) = served_experts_and_step(1)
    fast = _swapped(NativeExperts, ref)
    assert use_onednn(fast) == 1
    with torch.no_grad():
        assert torch.allclose(fast(x, idx, w), Experts.forward(ref, x, idx, w), atol=1e-5)
        ref.gate_up_proj[1, :ref.inter].copy_(torch.randn(ref.inter, x.shape[1]))
        assert torch.allclose(fast(x, idx, w), Experts.forward(ref, x, idx, w), atol=1e-5)


OPTS = dict(device="cpu", num_blocks=64, block_size=4, max_model_len=64)
PROMPTS = [list(range(3, 33)), list(range(40, 60)), [7, 8, 9]]


def test_engine_chooses_once_and_refuses_what_cannot_run():
    model = tiny_model(seed=3)
    packed = LLMEngine(EngineConfig(**OPTS, gemm="onednn"), model=copy.deepcopy(model))
    plain = LLMEngine(EngineConfig(**OPTS, gemm="torch"), model=copy.deepcopy(model))
    assert any(getattr(m, "onednn", None) is not None for m in packed.model.modules())
    assert all(getattr(m, "onednn", None) is None for m in plain.model.modules())
    assert run(packed, PROMPTS) == run(plain, PROMPTS)
    with pytest.raises(ValueError, match="gemm='onednn' needs the native CPU kernels"):
        LLMEngine(EngineConfig(**OPTS, gemm="onednn", kernels="torch"), model=copy.deepcopy(model))


def test_hot_swap_reaches_the_packed_experts():
    """After an expert hot swap, prefill-sized steps on oneDNN run the new weights: the same greedy output as
    an engine built on a model that had them from the start."""
    model = tiny_model(seed=4)
    layer = model.config.moe_layers[0]
    I, H = model.config.moe_intermediate_size, model.config.hidden_size
    update = {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight": torch.randn(*shape) * 0.5
              for e in range(model.config.n_routed_experts)
              for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
    engine = LLMEngine(EngineConfig(**OPTS, gemm="onednn"), model=copy.deepcopy(model))
    before = run(engine, PROMPTS)
    assert engine.swap_experts(update) == 1  # the new model version
    swapped = copy.deepcopy(model)
    fresh = LLMEngine(EngineConfig(**OPTS, gemm="torch"), model=swapped)
    assert fresh.swap_experts(update) == 1
    after = run(engine, PROMPTS)
    assert after == run(fresh, PROMPTS) and after != before


def test_auto_packs_only_where_it_pays_and_fits(monkeypatch):
    """gemm='auto': no packs where the build-time check finds oneDNN no faster, nor where the second copy
    would take more than half the free memory; packs otherwise."""
    from glm5.infer import engine as engine_module

    model = tiny_model(seed=5)

    def packs() -> bool:
        e = LLMEngine(EngineConfig(**OPTS, gemm="auto"), model=copy.deepcopy(model))
        return any(getattr(x, "onednn", None) is not None for x in e.model.modules())

    monkeypatch.setattr(onednn, "onednn_pays", lambda hidden: True)
    assert packs()
    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda: 1 << 10)
    assert not packs()
    monkeypatch.undo()
    monkeypatch.setattr(onednn, "onednn_pays", lambda hidden: False)
    assert not packs()
