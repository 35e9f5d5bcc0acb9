"""Fine-tuning on the distributed mesh (2 gloo processes, CPU, tiny config) against one process.

* gradients: LoRA on attention, indexer, dense/shared MLP and routed experts, sharded by FSDP2, expert
  parallel or tensor parallel: loss and every adapter gradient equal the single-process ones;
* the trainer: `FinetuneTrainer` losses and the saved adapter equal the single-process run; the adapter
  written by the 2-process run loads in PEFT on transformers' GlmMoeDsaForCausalLM with the same logits;
  a run interrupted at step 2 and resumed from its DCP checkpoint (2 processes, or 1) gives the
  uninterrupted run's losses;
* the gather / assembly and the mesh refusals without processes (default suite).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from glm5.core.config import from_dict
from glm5.core.resources import bundled
from glm5.data.tokenizer import load_tokenizer
from glm5.finetune.adapters import GLM5AdapterModel, from_pretrained
from glm5.finetune.config import FinetuneConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.lora import LoraConfig

from ._tiny import tiny_config, tiny_model

ALL = ["attn", "indexer", "mlp", "experts"]
WORLD, ROWS, STEPS = 2, 4, 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


# --- gradients of the sharded model --------------------------------------------------------------------
def _adapted_model(quant: str = "none") -> GLM5AdapterModel:
    """The tiny model with LoRA everywhere; `quant`: its base held int8 / fp8 (model.base_quant) first."""
    from glm5.finetune.quant_base import quantize_base
    torch.manual_seed(0)
    block = {"block": (16, 16)} if quant == "fp8" else {}  # several FP8 tiles per matrix, aligned with a TP split
    model = quantize_base(GLM5AdapterModel(tiny_config(index_topk=16)).init_weights(0), quant, **block)
    torch.manual_seed(1)
    model.add_lora(LoraConfig(r=4, alpha=8, targets=ALL))
    with torch.no_grad():  # B != 0: every A gets a gradient too
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model.train()


def _ids() -> torch.Tensor:  # 80 tokens over index_topk = 16: sparse layers read kv_b_proj.weight (absorbed MLA)
    return torch.randint(2, 512, (ROWS, 80), generator=torch.Generator().manual_seed(3))


def _loss_and_grads(model, ids, context=contextlib.nullcontext, scale=1.0):
    from torch.distributed.tensor import DTensor

    from glm5.train.step import ce_sum
    with context():
        loss = ce_sum(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
        (loss * scale).backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[n] = g.detach().clone()
    return float(loss.detach()), grads


def _grad_worker(rank: int, port: int, parallel: dict, out: str, quant: str = "none") -> None:
    _env(rank, port)
    torch.distributed.init_process_group("gloo")
    try:
        from glm5.train.parallel import apply_parallel
        model = apply_parallel(_adapted_model(quant), **parallel)
        plan = model.parallel_plan
        ids = _ids().chunk(plan.data_world)[plan.data_rank]
        # FSDP averages gradients over the data ranks: scale to the single process's sum
        loss, grads = _loss_and_grads(model, ids, plan.loss_context, float(plan.data_world))
        total = torch.tensor([loss], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        if rank == 0:
            torch.save({"loss": float(total) / plan.tp, "grads": grads}, out)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"dp": 2}, {"ep": 2}, {"tp": 2}], ids=["fsdp", "ep", "tp"])
def test_sharded_lora_gradients_equal_one_process(tmp_path, parallel):
    _assert_sharded_gradients(tmp_path, parallel)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("parallel", [{"dp": 2}, {"ep": 2}, {"tp": 2}], ids=["fsdp", "ep", "tp"])
def test_lora_gradients_on_a_quantised_base_equal_one_process(tmp_path, parallel, quant):
    """QLoRA-style on the mesh: FSDP2 shards the int8 / fp8 storage like any frozen parameter, expert
    parallel gives each rank its experts' storage and scales, tensor parallel its rows / columns of each
    split weight with their scales (FP8 tiles 16 x 16 here); the same loss and adapter gradients as one
    process on the same quantised base."""
    _assert_sharded_gradients(tmp_path, parallel, quant)


@pytest.mark.slow
def test_quantised_base_under_bf16_mixed_precision(tmp_path):
    """FSDP's bf16 policy (the GPU default): the fp8 storage is dequantised to bf16, the dtype of the
    gathered parameters and activations (it was loaded for fp32); the loss is one fp32 process's within
    bf16 rounding and every adapter gets a finite gradient."""
    loss, grads = _loss_and_grads(_adapted_model("fp8"), _ids())
    mp.spawn(_grad_worker, args=(_port(), {"dp": 2, "dtype": "bf16"}, str(tmp_path / "out.pt"), "fp8"), nprocs=WORLD,
             join=True)
    got = torch.load(tmp_path / "out.pt")
    assert abs(got["loss"] - loss) <= 1e-3 * abs(loss)
    assert set(got["grads"]) == set(grads) and all(g.isfinite().all() for g in got["grads"].values())


def _assert_sharded_gradients(tmp_path, parallel: dict, quant: str = "none") -> None:
    loss, grads = _loss_and_grads(_adapted_model(quant), _ids())
    mp.spawn(_grad_worker, args=(_port(), parallel, str(tmp_path / "out.pt"), quant), nprocs=WORLD, join=True)
    got = torch.load(tmp_path / "out.pt")
    assert abs(got["loss"] - loss) <= 1e-5 * abs(loss)
    assert set(got["grads"]) == set(grads) and any("experts.parametrizations" in n for n in grads)
    for n, g in grads.items():
        assert got["grads"][n].shape == g.shape, n
        assert (got["grads"][n] - g).abs().max() <= 1e-5 * max(1.0, float(g.abs().max())), n


# --- the trainer ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny base checkpoint with the bundled tokenizer and 30 training conversations."""
    root = tmp_path_factory.mktemp("ftdist")
    save_pretrained(tiny_model(seed=1, vocab_size=8192, num_hidden_layers=2, index_topk=8), root / "base")
    load_tokenizer(bundled("tokenizer-8k")).save(root / "base")
    with gzip.open(bundled("sft/train.jsonl.gz"), "rt", encoding="utf-8") as f:
        (root / "train.jsonl").write_text("".join(f.readlines()[::45]))
    return root


def _cfg(base: Path, run: Path, rows: int, steps: int = STEPS, resume: str = "", method: str = "lora",
         quant: str = "none", **parallel) -> FinetuneConfig:
    return from_dict(FinetuneConfig, {
        "method": method, "model": {"name": str(base / "base"), "base_quant": quant},
        "data": {"train_path": str(base / "train.jsonl"), "val_path": "", "batch_size": rows, "seq_len": 48,
                 "pack": method != "prefix"},
        "lora": {"r": 4, "alpha": 8, "targets": ALL}, "prefix": {"num_virtual_tokens": 4},
        "optim": {"lr": 3e-3}, "train": {"steps": steps, "num_threads": 1},
        "parallel": {"backend": "gloo", **parallel}, "checkpoint": {"every": 2, "resume": resume},
        "log": {"run_dir": str(run), "progress": False, "eval_batches": 0, "measure_peak": False}})


def _fit(cfg: FinetuneConfig) -> list[float]:
    from glm5.finetune.trainer import FinetuneTrainer
    trainer = FinetuneTrainer(cfg)
    trainer.fit()
    return [h["loss"] for h in trainer.history]


def _fit_worker(rank: int, port: int, cfg: FinetuneConfig, out: str) -> None:
    _env(rank, port)
    try:
        losses = _fit(cfg)
        if rank == 0:
            Path(out).write_text(json.dumps(losses))
    finally:
        torch.distributed.destroy_process_group()


def _spawn(cfg: FinetuneConfig) -> list[float]:
    out = Path(cfg.log.run_dir) / "losses.json"
    mp.spawn(_fit_worker, args=(_port(), cfg, str(out)), nprocs=WORLD, join=True)
    return json.loads(out.read_text())


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "adapter_model.safetensors")


@pytest.mark.slow
def test_fsdp_lora_matches_one_process_resumes_and_loads_in_peft(base, tmp_path):
    ref = _fit(_cfg(base, tmp_path / "one", ROWS))
    dist = _spawn(_cfg(base, tmp_path / "fsdp", ROWS // WORLD))
    assert _close(dist, ref), (dist, ref)
    a, b = _adapter(tmp_path / "one"), _adapter(tmp_path / "fsdp")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)
    assert json.loads((tmp_path / "fsdp/final/adapter_config.json").read_text()) == \
        json.loads((tmp_path / "one/final/adapter_config.json").read_text())
    # the checkpoints hold the adapters (DCP) and the gathered PEFT adapter, not the base
    step2 = tmp_path / "fsdp" / "checkpoints" / "step_00000002"
    assert (step2 / "model" / "adapter_model.safetensors").is_file() and not (step2 / "model" / "config.json").exists()
    # resumed from step 2 on the same mesh: bit-exact; on one process (DCP reshards): the same losses
    again = _spawn(_cfg(base, tmp_path / "again", ROWS // WORLD, resume=str(step2)))
    assert again == dist[2:], (again, dist)
    alone = _fit(_cfg(base, tmp_path / "alone", ROWS, resume=str(step2)))
    assert _close(alone, dist[2:]), (alone, dist)
    _assert_peft_logits(base, tmp_path / "fsdp" / "final")  # the 2-process adapter in PEFT on transformers


def _assert_peft_logits(base: Path, adapter: Path) -> None:
    """`adapter` loaded by PEFT on transformers' model of the base gives glm5's logits for base + adapter,
    and the adapter changes them (B trained away from 0)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base / "base", attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    x = torch.randint(2, 8192, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = hf(x).logits
        theirs = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()(x).logits
        ours = from_pretrained(base / "base", adapter=adapter)(x).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (theirs - plain).abs().max() > 1e-3  # PEFT applied the adapter


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"expert_parallel": 2}, {"tensor_parallel": 2}], ids=["ep", "tp"])
def test_ep_tp_lora_match_one_process_and_resume_on_one(base, tmp_path, parallel):
    ref = _fit(_cfg(base, tmp_path / "one", ROWS, steps=3))
    rows = ROWS if "tensor_parallel" in parallel else ROWS // WORLD  # TP peers read the same rows
    dist = _spawn(_cfg(base, tmp_path / "dist", rows, steps=3, **parallel))
    assert _close(dist, ref), (dist, ref)
    a, b = _adapter(tmp_path / "one"), _adapter(tmp_path / "dist")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)
    # its step-2 DCP checkpoint (experts' / heads' adapter shards) resumed in one process
    step2 = tmp_path / "dist" / "checkpoints" / "step_00000002"
    alone = _fit(_cfg(base, tmp_path / "alone", ROWS, steps=3, resume=str(step2)))
    assert _close(alone, dist[2:]), (alone, dist)
    _assert_peft_logits(base, tmp_path / "dist" / "final")  # the EP / TP adapter (gathered) in PEFT


@pytest.mark.slow
@pytest.mark.parametrize("quant,parallel", [("int8", {}), ("fp8", {"expert_parallel": 2}),
                                            ("int8", {"tensor_parallel": 2})], ids=["int8_fsdp", "fp8_ep", "int8_tp"])
def test_lora_on_a_quantised_base_matches_one_process_and_resumes(base, tmp_path, quant, parallel):
    """LoRA on a frozen int8 / fp8 base under torchrun: the losses and the adapter equal one process on the
    same quantised base; the DCP checkpoints hold the adapters only (no int8 / fp8 storage, no scales);
    resumed from step 2 on the same mesh the run continues bit for bit, and in one process the same.
    (fp8 with TP is in the gradient test: this base's 128 x 128 tiles do not split over 2 ranks.)"""
    ref = _fit(_cfg(base, tmp_path / "one", ROWS, steps=3, quant=quant))
    dist = _spawn(_cfg(base, tmp_path / "dist", _rows(parallel), steps=3, quant=quant, **parallel))
    assert _close(dist, ref), (dist, ref)
    a, b = _adapter(tmp_path / "one"), _adapter(tmp_path / "dist")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)
    step2 = tmp_path / "dist" / "checkpoints" / "step_00000002"
    from torch.distributed.checkpoint import FileSystemReader
    saved = [k for k in FileSystemReader(str(step2 / "dcp")).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert any("experts.parametrizations" in k and "lora_A" in k for k in saved)
    assert not [k for k in saved if k.endswith((".original", ".scale")) or "base_layer" in k], saved
    again = _spawn(_cfg(base, tmp_path / "again", _rows(parallel), steps=3, resume=str(step2), quant=quant, **parallel))
    assert again == dist[2:], (again, dist)
    alone = _fit(_cfg(base, tmp_path / "alone", ROWS, steps=3, resume=str(step2), quant=quant))
    assert _close(alone, dist[2:]), (alone, dist)


@pytest.mark.slow
@pytest.mark.parametrize("method,parallel", [("prefix", {}), ("prefix", {"expert_parallel": 2}),
                                             ("prefix", {"tensor_parallel": 2}), ("full", {}),
                                             ("full", {"expert_parallel": 2}), ("full", {"tensor_parallel": 2})],
                         ids=["prefix_fsdp", "prefix_ep", "prefix_tp", "full_fsdp", "full_ep", "full_tp"])
def test_prefix_and_full_on_the_mesh_match_one_process(base, tmp_path, method, parallel):
    ref = _fit(_cfg(base, tmp_path / "one", ROWS, steps=3, method=method))
    rows = ROWS if "tensor_parallel" in parallel else ROWS // WORLD
    dist = _spawn(_cfg(base, tmp_path / "dist", rows, steps=3, method=method, **parallel))
    assert _close(dist, ref), (dist, ref)
    if method == "prefix":
        a, b = _adapter(tmp_path / "one"), _adapter(tmp_path / "dist")
    else:  # the whole model, HF layout
        from glm5.core.io import LazyTensors, safetensors_files
        a, b = (LazyTensors(safetensors_files(tmp_path / d / "final")).load_all() for d in ("one", "dist"))
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)


def _failing_export_worker(rank: int, port: int, cfg: FinetuneConfig, out: str) -> None:
    _env(rank, port)
    import glm5.finetune.trainer as trainer

    def refuse(*args, **kwargs):
        raise ValueError("assemble refused the gathered tensors")

    trainer.assemble = refuse  # runs on rank 0 only
    try:
        _fit(cfg)
    except Exception as e:  # noqa: BLE001
        Path(f"{out}{rank}").write_text(f"{type(e).__name__}: {e}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_failure_writing_the_adapter_on_rank_0_is_raised_on_every_rank(base, tmp_path):
    """Rank 0 alone assembles and writes the adapter: when that fails (here at the step-2 checkpoint), every
    rank raises instead of waiting for rank 0 in its next collective."""
    import time
    out = str(tmp_path / "error")
    ctx = mp.spawn(_failing_export_worker, args=(_port(), _cfg(base, tmp_path / "run", ROWS // WORLD, steps=3), out),
                   nprocs=WORLD, join=False)
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks hung after rank 0 failed to write the adapter")
    assert Path(f"{out}0").read_text() == "ValueError: assemble refused the gathered tensors"
    assert Path(f"{out}1").read_text().startswith("RuntimeError: rank 0 could not write the adapter")


def _trained_state(trainer) -> dict[str, torch.Tensor]:
    """Collective: every trained tensor and its AdamW state (`name#exp_avg`, ...), gathered to full tensors."""
    from torch.distributed.tensor import DTensor
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    out = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            out[name] = full(p)
            for key, value in sorted(trainer.optimizer.state[p].items()):
                out[f"{name}#{key}"] = full(value)
    return out


def _state_worker(rank: int, port: int, cfg: FinetuneConfig, out: str) -> None:
    """Train (or, with checkpoint.resume, only resume) and save the gathered state on rank 0."""
    _env(rank, port)
    try:
        from glm5.finetune.trainer import FinetuneTrainer
        trainer = FinetuneTrainer(cfg)
        if not cfg.checkpoint.resume:
            trainer.fit()
        state = _trained_state(trainer)
        if rank == 0:
            torch.save({"step": trainer.step, "state": state}, out)
    finally:
        torch.distributed.destroy_process_group()


def _spawn_state(cfg: FinetuneConfig) -> dict:
    out = Path(cfg.log.run_dir) / "state.pt"
    out.parent.mkdir(parents=True, exist_ok=True)  # a resume alone writes nothing there
    mp.spawn(_state_worker, args=(_port(), cfg, str(out)), nprocs=WORLD, join=True)
    return torch.load(out)


def _rows(parallel: dict) -> int:
    return ROWS if "tensor_parallel" in parallel else ROWS // WORLD  # TP peers read the same rows


@pytest.mark.slow
@pytest.mark.parametrize("mesh,other", [({}, {"expert_parallel": 2}), ({"expert_parallel": 2}, {"tensor_parallel": 2}),
                                        ({"tensor_parallel": 2}, {})], ids=["fsdp_to_ep", "ep_to_tp", "tp_to_fsdp"])
def test_resume_at_another_world_size_and_mesh_restores_the_state_bit_for_bit(base, tmp_path, mesh, other):
    """A 2-process run's step-2 DCP checkpoint resumed in one process and on another 2-process mesh: every
    adapter tensor and its AdamW moments and step equal, bit for bit, what the writing run held."""
    written = _spawn_state(_cfg(base, tmp_path / "dist", _rows(mesh), steps=2, **mesh))
    step2 = tmp_path / "dist" / "checkpoints" / "step_00000002"
    assert written["step"] == 2 and any("experts.parametrizations" in n and n.endswith("#exp_avg_sq")
                                         for n in written["state"])
    from glm5.finetune.trainer import FinetuneTrainer
    alone = FinetuneTrainer(_cfg(base, tmp_path / "alone", ROWS, steps=2, resume=str(step2)))
    resharded = _spawn_state(_cfg(base, tmp_path / "other", _rows(other), steps=2, resume=str(step2), **other))
    for got in ({"step": alone.step, "state": _trained_state(alone)}, resharded):
        assert got["step"] == 2 and got["state"].keys() == written["state"].keys()
        for n, t in written["state"].items():
            assert torch.equal(got["state"][n], t), n
    # and the checkpoint's gathered adapter (model/) is the state it resumed
    adapter = GLM5AdapterModel(alone.raw_model.config)
    adapter.add_lora(alone.cfg.lora)
    from glm5.model import peft_adapter
    peft_adapter.copy_adapter_weights(adapter, step2 / "model")
    mine = dict(adapter.named_parameters())
    assert all(torch.equal(mine[n], t) for n, t in written["state"].items() if "#" not in n)


# --- without processes ---------------------------------------------------------------------------------
def test_a_single_process_adapter_checkpoint_is_refused_on_the_mesh(tmp_path):
    """A 1-process LoRA checkpoint (safetensors, no dcp/) cannot resume under torchrun: the refusal does
    not send the user to --model.name=PATH/model, which holds an adapter, not a base."""
    from glm5.train.checkpointer import DCPCheckpointer
    model = _adapted_model()
    adapters = DCPCheckpointer(model, model, torch.optim.AdamW(model.parameters()), trainable_only=True)
    with pytest.raises(ValueError, match="resume it with one process") as e:
        adapters.load(tmp_path)
    assert "--model.name" not in str(e.value)
    full = DCPCheckpointer(model, model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="--model.name=PATH/model"):
        full.load(tmp_path)


def test_assembled_adapter_is_the_single_process_layout(tmp_path):
    """`gather_trainable` + `assemble` (what rank 0 writes) rebuild the PEFT files of the trained model."""
    from glm5.finetune.parallel import assemble, gather_trainable
    from glm5.model import peft_adapter
    model = _adapted_model()
    cfg = from_dict(FinetuneConfig, {"lora": {"r": 4, "alpha": 8, "targets": ALL}})
    shadow = assemble(cfg, model.config, gather_trainable(model), "base")
    peft_adapter.save_adapter(model, tmp_path / "direct", "base")
    peft_adapter.save_adapter(shadow, tmp_path / "assembled", "base")
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("direct", "assembled"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "direct/adapter_config.json").read_text()) == \
        json.loads((tmp_path / "assembled/adapter_config.json").read_text())
    wrong = from_dict(FinetuneConfig, {"lora": {"r": 2, "alpha": 8, "targets": ALL}})
    with pytest.raises(ValueError, match="has shape"):
        assemble(wrong, model.config, gather_trainable(model), "base")


def test_meshes_that_cannot_hold_the_adapters_are_refused():
    from glm5.finetune.parallel import check_mesh
    from glm5.train.parallel import check_model
    from glm5.train.parallel_tp import check_lora_tp
    with pytest.raises(ValueError, match="parallel.pipeline_parallel=2"):
        check_mesh(from_dict(FinetuneConfig, {"parallel": {"pipeline_parallel": 2}}))
    check_mesh(from_dict(FinetuneConfig, {"method": "full", "parallel": {"pipeline_parallel": 2}}))
    for quant in ("int8", "fp8"):  # a quantised base runs on FSDP, expert and tensor parallel meshes
        for parallel in ({}, {"expert_parallel": 2}, {"tensor_parallel": 2}):
            check_mesh(from_dict(FinetuneConfig, {"model": {"base_quant": quant}, "parallel": parallel}), world=2)
    # ... but tensor parallel does not split a FP8 weight across a 128 x 128 tile (parallel_tp._shard_held
    # refuses it naming the key and the layer)
    from glm5.finetune.quant_base import FP8Weight, quantize_base
    fp8 = quantize_base(tiny_model(), "fp8").get_submodule("model.layers.0.self_attn.q_b_proj").parametrizations.weight[0]
    with pytest.raises(ValueError, match=r"48 rows per tensor-parallel rank do not align with the FP8 block \[128, 128\]"):
        fp8.split(-2, 48, 96)
    assert fp8.split(-2, 0, 48).scale.shape == fp8.scale.shape  # the first rank's rows: the same tile
    tiles = FP8Weight(torch.ones(1, 6, 2), (16, 16), torch.float32)
    assert tiles.split(-2, 48, 96).scale.shape == (1, 3, 2) and tiles.split(-1, 16, 32).scale.shape == (1, 6, 1)
    with pytest.raises(ValueError, match="n_routed_experts=6"):
        check_model(tiny_config(n_routed_experts=6), {"pp": 1, "dp": 1, "ep": 4, "tp": 1})
    model = GLM5AdapterModel(tiny_config(num_attention_heads=3, qk_nope_head_dim=15))
    model.add_lora(LoraConfig(r=4, targets=["attn"]))
    with pytest.raises(ValueError, match=r"q_b_proj's out_features=69"):
        check_lora_tp(model, 2)


def test_merge_on_a_sharded_base(tmp_path):
    """`glm5 merge` on a multi-file base (index + shards): the merged checkpoint is sharded too and
    computes what base + adapter compute."""
    from glm5.cli.merge import main as merge_main
    from glm5.core.io import safetensors_files
    save_pretrained(tiny_model(seed=2), tmp_path / "base", max_shard_size="400KB")
    assert (tmp_path / "base/model.safetensors.index.json").is_file() and len(safetensors_files(tmp_path / "base")) > 2
    model = from_pretrained(tmp_path / "base")
    model.add_lora(LoraConfig(r=4, alpha=8, targets=ALL))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.save_adapter(tmp_path / "adapter")
    assert merge_main([str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    assert len(safetensors_files(tmp_path / "merged")) > 2
    x = torch.randint(2, 512, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        merged = from_pretrained(tmp_path / "merged")(x).logits
        adapted = from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")(x).logits
    assert (merged - adapted).abs().max() <= 1e-5


@pytest.mark.parametrize("args,says", [(["--parallel.pipeline_parallel=2"], "parallel.pipeline_parallel=2"),
                                       (["--model.base_quant=int8", "--parallel.pipeline_parallel=2"],
                                        "parallel.pipeline_parallel=2")],
                         ids=["pipelined", "pipelined_quantised_base"])
def test_cli_refuses_meshes_adapters_cannot_use_in_one_line(base, tmp_path, capsys, monkeypatch, args, says):
    from glm5.finetune import trainer
    from glm5.finetune.launch import main
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it (no process group: refused before one is needed)
    monkeypatch.setattr(trainer, "from_pretrained", lambda *a, **k: pytest.fail("the base was loaded"))
    rc = main(["--config", "configs/finetune/lora.toml", f"--model.name={base}/base", f"--log.run_dir={tmp_path}",
               *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and says in err, err
