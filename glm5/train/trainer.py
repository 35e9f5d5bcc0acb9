"""The pretraining loop: `Trainer(cfg).fit()`.

Owns the order of operations in one optimizer step: fetch the step's micro-batches (objectives drawn
by ratio), forward/backward each under autocast, non-finite guard, clipping, optimizer step, MoE bias
update; then logging (tqdm + metrics JSONL), periodic validation and checkpoints, and at the end the
validation loss against a unigram baseline and the final HF-format model in `RUN_DIR/final`.
Topology lives in one object, `self.dims` (`ParallelDims`, glm5/train/dims.py): built from
`cfg.parallel` and the environment, it applies `parallelize(model, cfg)` (glm5/train/parallel.py) when
launched with several processes (the model itself stays pure math) and holds the process groups. The
loop calls its collectives (metric sums, gradient norm and clipping, barriers) unconditionally: in one
process they are the identity. The checkpoint writer (DCP or plain safetensors, glm5/train/checkpointer.py)
is chosen from it once, at construction.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from glm5.core import dist
from glm5.core.config import to_dict
from glm5.core.io import (CheckpointError, LazyTensors, check_finite, remove_stale_tmp, safetensors_files,
                          save_file_checked)
from glm5.core.log import MetricsWriter
from glm5.model.config import ModelConfig
from glm5.model.generation_config import GenerationConfig
from glm5.model.hf_adapter import load_hf_state_dict, save_pretrained
from glm5.model.model import GLM5ForCausalLM

from . import perf
from .balance import LoadTracker, find_gates, load_metrics, update_expert_bias
from .checkpoint import read_hf_model, resume_candidates
from .checkpointer import Checkpointer, make_checkpointer
from .config import TrainConfig
from .data import DataSource, build_data
from .dims import ParallelDims
from .grads import KeptGrads
from .indexer_warmup import AttnCapture, indexer_parameters, warmup_step
from .optim import build_optimizer
from .schedule import BatchRamp, lr_factor, pick_objective
from .stability import NonFiniteGuard, layer_groups
from .step import IGNORE, MODEL_KEYS, forward_micro, micro_loss, mtp_labels

logger = logging.getLogger("glm5.train")
TRAINED_FILE = "trained.safetensors"  # a frozen run's checkpoint `model/`: the trained tensors only


def build_model(cfg: TrainConfig, device: torch.device) -> GLM5ForCausalLM:
    """A fresh model from a preset (seeded init), or a checkpoint directory's config (+ its weights when
    `model.load_weights`); `model.overrides` apply in both cases. fp32 master weights."""
    name = cfg.model.name
    mcfg = ModelConfig.load(name, **dict(cfg.model.overrides))
    model = GLM5ForCausalLM(mcfg).init_weights(seed=cfg.train.seed)
    if cfg.model.load_weights and (Path(name) / "config.json").is_file():
        load_hf_state_dict(model, LazyTensors(safetensors_files(name), verify=True))  # strict: names every mismatch
        model.generation_config = GenerationConfig.from_pretrained(name) or model.generation_config  # kept in final/
    return model.to(device).train()


def trainable_names(model: torch.nn.Module, trainable: str) -> list[str]:
    """Parameter names that `train.trainable` trains: every one ("all"), the MTP layers' (`model.layers.{i}.`
    for i >= num_hidden_layers; the tied embedding and lm_head are not theirs), or the DSA indexers'."""
    names = [n for n, _ in model.named_parameters()]
    if trainable == "all":
        return names
    if trainable == "mtp":
        first = model.config.num_hidden_layers
        mtp = tuple(f"model.layers.{first + j}." for j in range(model.config.num_nextn_predict_layers))
        return [n for n in names if n.startswith(mtp)]
    if trainable == "indexer":
        return [n for n in names if ".indexer." in n]
    raise ValueError(f"train.trainable: unknown value {trainable!r}; use all, mtp, indexer")


def freeze_except(model: torch.nn.Module, trainable: str) -> int:
    """Set requires_grad False on every parameter `train.trainable` leaves out; returns how many train.
    Fails naming the key when nothing would train (a model without MTP layers / indexers)."""
    keep = set(trainable_names(model, trainable))
    if not keep:
        what = {"mtp": "MTP layers (num_nextn_predict_layers = 0)", "indexer": "DSA indexers"}[trainable]
        raise ValueError(f"train.trainable = {trainable!r} but the model has no {what}")
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
    return sum(p.numel() for n, p in model.named_parameters() if n in keep)


def check_compatible(cfg: TrainConfig, model_cfg: ModelConfig, data_vocab: int) -> None:
    """Fail early, naming the config keys, on a model that cannot train on this data / objective mix."""
    if data_vocab > model_cfg.vocab_size:
        raise ValueError(f"the data's tokenizer has {data_vocab} ids but model vocab_size is "
                         f"{model_cfg.vocab_size}: set model.overrides.vocab_size >= {data_vocab}")
    if cfg.train.objectives.get("glm", 0) > 0 and not model_cfg.block_position_embedding:
        raise ValueError("train.objectives has 'glm' (blank infilling, 2D positions) but the model has "
                         "block_position_embedding = false: add model.overrides.block_position_embedding = true")
    indexer_keys = [k for k, on in (("dsa.indexer_loss_coef", cfg.dsa.indexer_loss_coef > 0),
                                     ("dsa.indexer_warmup_steps", cfg.dsa.indexer_warmup_steps > 0)) if on]
    if indexer_keys and model_cfg.attention_kind != "dsa":
        raise ValueError(f"{', '.join(indexer_keys)} train the DSA indexer, but model_type {model_cfg.model_type!r} "
                         "has none (its attention is always dense): set them to 0")


def set_threads(n: int) -> int:
    """Apply `train.num_threads` (see its doc) on CPU; returns the thread count in use."""
    if n <= 0 and not torch.cuda.is_available():
        cores = os.cpu_count() or 1
        busy = hasattr(os, "getloadavg") and os.getloadavg()[0] >= cores
        n = 1 if busy else 0
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: TrainConfig, model: torch.nn.Module | None = None, data: DataSource | None = None,
                 parallelize_fn=None, micro_fn=None):
        # micro_fn: the training forward+loss of one micro-batch (default `forward_micro`; distillation
        # passes one that mixes in the teacher's targets); validation always uses plain `forward_micro`
        self.cfg = cfg
        self.dims = ParallelDims.from_env(cfg.parallel)
        seed_everything(cfg.train.seed)
        self.num_threads = set_threads(cfg.train.num_threads)
        self.device = torch.device(f"cuda:{dist.local_rank()}" if torch.cuda.is_available() else "cpu")
        self._setup_model(model, parallelize_fn, own_loss=micro_fn is not None)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.checkpointer = self.build_checkpointer()
        self._setup_step(micro_fn)
        # data ranks read different rows of the global batch (tensor/pipeline peers share one)
        self.data = data if data is not None else build_data(cfg, self.dims.data_rank, self.dims.data_world)
        check_compatible(cfg, self.raw_model.config, getattr(self.data, "vocab_size", 0))
        self.ramp = BatchRamp(self.data.micro_batch_size, self.dims.data_world, cfg.train.grad_accum,
                              cfg.train.batch_ramp_start, cfg.train.batch_ramp_steps)
        self.step = 0
        self.unigram = torch.zeros(self.raw_model.config.vocab_size, dtype=torch.float64)
        self.run_dir = Path(cfg.log.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.peak_flops = 0.0
        self.history: list[dict] = []
        self.time_budget: tuple[float, float] | None = None  # (start, seconds) while fit() runs with a limit
        self._resume(cfg.checkpoint.resume)

    # --- setup --------------------------------------------------------------------------------------
    def build_checkpointer(self) -> Checkpointer:
        """The checkpoint writer, chosen once from the dims (subclasses choose what their checkpoints hold)."""
        return make_checkpointer(self.dims, self.model, self.raw_model, self.optimizer, self.write_model,
                                 self.read_model)

    def _setup_model(self, model: torch.nn.Module | None, parallelize_fn, own_loss: bool) -> None:
        """The model (built unless given), placed by the dims (parallelised under torchrun), frozen to
        `train.trainable`; `active_params` for MFU."""
        cfg = self.cfg
        self.model = model if model is not None else build_model(cfg, self.device)
        self.raw_model = self.model  # the unwrapped module: checkpoints, gates, config
        self.uses_mtp = (cfg.train.mtp_weight > 0 and self.raw_model.config.num_nextn_predict_layers > 0
                         and cfg.train.trainable != "indexer")  # the indexer runs freeze the MTP layer too
        # before any pipeline cut prunes the model to this rank's layers
        self.active_params = perf.active_params(self.raw_model, include_mtp=self.uses_mtp)
        self.model, self.dims = self.dims.parallelize(self.model, cfg, parallelize_fn)
        if cfg.precision.activation_checkpointing:
            self.raw_model.gradient_checkpointing = True
        self.frozen = cfg.train.trainable != "all"
        if not self.frozen:
            return
        if self.dims.distributed:
            raise ValueError(f"train.trainable = {cfg.train.trainable!r} runs in one process (got a world of "
                             f"{self.dims.world})")
        if own_loss:
            raise ValueError(f"train.trainable = {cfg.train.trainable!r} needs the trainer's own forward "
                             "(this command passes its own loss)")
        self.trainable_params = freeze_except(self.raw_model, cfg.train.trainable)
        # MFU's 6 FLOPs per active parameter assume a backward through all of them: the frozen part
        # costs its forward (2), the trained part forward and backward (6)
        trained = perf.active_params(self.raw_model, include_mtp=True,
                                     names=set(trainable_names(self.raw_model, cfg.train.trainable)))
        self.active_params = (2 * self.active_params + 4 * trained) // 6
        dist.print0(f"train.trainable = {cfg.train.trainable}: {self.trainable_params:,} parameters train, "
                    "the rest is frozen")

    def _setup_step(self, micro_fn) -> None:
        """What one optimizer step uses: the micro-batch loss, gradient buffers, guard, balance state,
        clipping groups, the indexer's attention capture, autocast."""
        cfg = self.cfg
        # the LM loss fused with the head (glm5/train/loss.py) in one process with a plain head: a sharded
        # head (FSDP/TP) has its own loss path, and an adapted one (LoRA with dropout) is more than its
        # `.weight`. A custom micro_fn (distillation) keeps its own loss.
        self.fused_ce = (not self.dims.distributed
                         and type(getattr(self.raw_model, "lm_head", None)) is torch.nn.Linear)
        if micro_fn is None or micro_fn is forward_micro:
            kw = {"fused_ce": True} if self.fused_ce else {}
            if cfg.train.trainable != "all" or cfg.train.mtp_target != "data":
                kw.update(trainable=cfg.train.trainable, mtp_target=cfg.train.mtp_target)
            micro_fn = functools.partial(forward_micro, **kw) if kw else forward_micro
        elif cfg.train.mtp_target != "data":
            raise ValueError("train.mtp_target = 'self' needs the trainer's own forward (this command passes its own loss)")
        self.micro_fn = micro_fn
        if cfg.train.mtp_target == "self" and not self.uses_mtp:
            raise ValueError("train.mtp_target = 'self' but the model has no MTP layer (num_nextn_predict_layers = 0)")
        # one process on CPU: gradient buffers live on between steps (no page faults refilling them;
        # grads.py). CUDA's caching allocator already reuses freed blocks.
        keep = cfg.train.keep_grad_buffers and not self.dims.distributed and self.device.type == "cpu"
        self.kept_grads = KeptGrads() if keep else None
        self.pipeline = self.dims.pipeline  # runs this rank's stages under parallel.pipeline_parallel > 1
        if self.pipeline is not None and cfg.dsa.indexer_loss_coef > 0:
            raise ValueError("dsa.indexer_loss_coef > 0 is not supported with parallel.pipeline_parallel > 1")
        if self.pipeline is not None and cfg.train.mtp_target != "data":
            raise ValueError("train.mtp_target = 'self' is not supported with parallel.pipeline_parallel > 1")
        self.guard = NonFiniteGuard(cfg.stability.max_bad_steps, cfg.stability.nan_lr_factor)
        self.gates, self.tracker = find_gates(self.raw_model), LoadTracker()
        if self.frozen:  # a frozen router keeps its correction bias: only the MTP layers' gates update
            first = self.raw_model.config.num_hidden_layers
            self.gates = {i: g for i, g in self.gates.items() if cfg.train.trainable == "mtp" and i >= first}
        self.layer_groups = layer_groups(self.raw_model)
        need_capture = cfg.dsa.indexer_loss_coef > 0 or cfg.train.trainable == "indexer"
        self.capture = AttnCapture(self.raw_model, cfg.dsa.indexer_kl_rows) if need_capture else None
        self.autocast_dtype = self._autocast_dtype()
        self.mtp_agree: int | None = None  # the step's MTP/trunk argmax agreements (`self` target)

    @property
    def distributed(self) -> bool:
        """Launched with several processes (`self.dims.distributed`)."""
        return self.dims.distributed

    # --- state --------------------------------------------------------------------------------------
    def _autocast_dtype(self) -> torch.dtype | None:
        want = self.cfg.precision.dtype
        if want == "bf16" or (want == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    def trainer_state(self) -> dict:
        return {"guard": self.guard.state_dict(), "data": self.data.state_dict(), "unigram": self.unigram,
                "num_threads": self.num_threads}

    def _resume(self, resume: str) -> None:
        """Remove what interrupted checkpoint writes left, then load the checkpoint to resume from.
        With "auto" a checkpoint that fails to load (corrupt, truncated, NaN) is reported and the
        previous one is tried; a named checkpoint that fails is an error."""
        if self.dims.is_main:
            for stale in remove_stale_tmp(self.ckpt_root) + remove_stale_tmp(self.run_dir):
                dist.print0(f"removed {stale} (left by an interrupted checkpoint write)")
        self.dims.barrier()
        failures = []
        for path in resume_candidates(resume, self.ckpt_root):
            try:
                self._load(path)
                return
            except CheckpointError as e:
                if resume != "auto":
                    raise
                failures.append(f"{path.name}: {e}")
                dist.print0(f"checkpoint {path} is unusable ({e}); falling back to the previous one")
        if failures:
            raise CheckpointError(f"--resume auto: no usable checkpoint under {self.ckpt_root} ("
                                  + "; ".join(failures) + "); delete them to start afresh")

    def _load(self, path: Path) -> None:
        state = self.checkpointer.load(path)
        self.step = int(state["step"])
        self.guard.load_state_dict(state["guard"])
        self.data.load_state_dict(state["data"])
        self.unigram = state["unigram"].to(torch.float64)
        self._reuse_threads(state.get("num_threads"))
        dist.print0(f"resumed from {path} at step {self.step}")

    def _reuse_threads(self, recorded: int | None) -> None:
        """CPU reductions depend on the thread count, so an automatic count (`train.num_threads = 0`)
        is taken from the checkpoint rather than chosen afresh: the resumed run then computes what
        the uninterrupted one would have."""
        if not recorded or self.device.type != "cpu" or recorded == self.num_threads:
            return
        if self.cfg.train.num_threads > 0:
            dist.print0(f"note: the checkpoint ran with {recorded} CPU threads, this run uses {self.num_threads} "
                        "(train.num_threads); results can differ slightly from an uninterrupted run")
            return
        torch.set_num_threads(recorded)
        self.num_threads = torch.get_num_threads()
        dist.print0(f"using {recorded} CPU threads, as recorded in the checkpoint (train.num_threads = 0)")

    def save(self) -> Path | None:
        """`RUN_DIR/checkpoints/step_N` (the writer of `self.checkpointer`: DCP shards under torchrun)."""
        return self.checkpointer.save(self.ckpt_root, self.step, self.trainer_state(), to_dict(self.cfg),
                                      self.cfg.checkpoint.keep_last)

    def write_model(self, model: torch.nn.Module, directory: Path) -> None:
        """What a single-process checkpoint's `model/` holds: the whole model in HF layout (fine-tuning
        overrides this to write only what trains). With `train.trainable` other than "all", only what
        trains: `trained.safetensors` (the trained parameters and their layers' buffers, e.g. the MTP
        router's bias); the frozen rest is `model.name`'s, rebuilt from it on resume."""
        if not self.frozen:
            save_pretrained(model, directory)
            return
        directory.mkdir(parents=True, exist_ok=True)
        state = model.state_dict()
        save_file_checked({k: state[k].detach().cpu().contiguous() for k in self._trained_keys()},
                          directory / TRAINED_FILE, metadata={"trainable": self.cfg.train.trainable})

    def read_model(self, model: torch.nn.Module, directory: Path) -> None:
        """Inverse of `write_model`, in place (checksums verified)."""
        if not self.frozen:
            read_hf_model(model, directory)
            return
        file = directory / TRAINED_FILE
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (a train.trainable = {self.cfg.train.trainable!r} checkpoint "
                                  "holds only what trains)")
        tensors = LazyTensors([file], verify=True).load_all()
        want = self._trained_keys()
        if set(tensors) != set(want):
            raise CheckpointError(f"{file}: holds {sorted(set(tensors) ^ set(want))[:5]} unlike this run's "
                                  f"train.trainable = {self.cfg.train.trainable!r} tensors")
        state = model.state_dict()
        with torch.no_grad():
            for k in want:
                check_finite(tensors[k], k, file)
                state[k].copy_(tensors[k])

    def _trained_keys(self) -> list[str]:
        """State-dict keys a frozen run changes: its trainable parameters, and for "mtp" the MTP layers'
        buffers (the router's correction bias moves with the balance update)."""
        names = trainable_names(self.raw_model, self.cfg.train.trainable)
        if self.cfg.train.trainable == "mtp":
            first = self.raw_model.config.num_hidden_layers
            prefixes = tuple(f"model.layers.{first + j}." for j in range(self.raw_model.config.num_nextn_predict_layers))
            names += [n for n, _ in self.raw_model.named_buffers() if n.startswith(prefixes)]
        persistent = set(self.raw_model.state_dict())
        return [n for n in names if n in persistent]

    # --- one optimizer step -------------------------------------------------------------------------
    def _set_lr(self) -> float:
        """base_lr x schedule x guard scale. With `train.time_limit_min`, the schedule runs on whichever
        budget is further along, steps or wall time, so a run cut by time still ends annealed."""
        step, total = self.step, self.cfg.train.steps
        if self.time_budget is not None:
            start, limit = self.time_budget
            frac = self.dims.mean((time.monotonic() - start) / limit)  # the same on every rank
            step = max(step, min(total - 1, int(frac * total)))
        factor = lr_factor(step, self.cfg.schedule, total) * self.guard.lr_scale
        for g in self.optimizer.param_groups:
            g["lr"] = g["base_lr"] * factor
        return self.optimizer.param_groups[0]["lr"]

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _fetch(self) -> list[tuple[str, dict]]:
        """The step's micro-batches, each with its objective (drawn by ratio, stateless in the seed)."""
        self.data.set_step(self.step)
        accum = self.ramp.accum(self.step)
        mix, seed = self.cfg.train.objectives, self.cfg.train.seed
        out = []
        for micro in range(accum):
            # one objective per step under pipeline parallel: a schedule call runs one batch layout
            objective = pick_objective(mix, seed, self.step, 0 if self.pipeline is not None else micro)
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                     for k, v in self.data.next_batch(objective).items()}
            out.append((objective, batch))
        return out

    def train_step(self) -> dict:
        """Forward/backward over the step's micro-batches, then guard, clip, update. Returns metrics."""
        lr = self._set_lr()
        metrics = {"lr": lr, **self._forward_backward(self._fetch())}
        if self.kept_grads is not None:
            self.kept_grads.drop_untouched()
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = self.dims.grad_norm(params)
        metrics["grad_norm"] = float(norm)
        if not self.guard.check(self.raw_model, metrics["loss"], float(norm), self.step):
            metrics["skipped"] = True
            self.step += 1
            return metrics
        self._clip(params, norm)
        self.optimizer.step()
        if self.kept_grads is not None:
            self.kept_grads.zero(params)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        loads = self.tracker.reduce(self.dims.data_group)
        trained = {i: v for i, v in loads.items() if i in self.gates} if self.frozen else loads  # frozen: logged only
        update_expert_bias(self.gates, trained, self.cfg.balance.bias_update_rate)
        metrics.update(load_metrics(self.dims.gather_stages(loads)))  # every pipeline stage's layers
        self.step += 1
        return metrics

    def _forward_backward(self, micro: list[tuple[str, dict]]) -> dict:
        """Accumulate gradients over the micro-batches. Losses are normalised by the step's *global*
        token count (over all data ranks), so the update is that of one process on the global batch
        however the rows fall on ranks (elastic; see `micro_loss`)."""
        cfg = self.cfg
        n_tok = sum(int((b["labels"] != IGNORE).sum()) for _, b in micro)
        n_mtp = sum(int((mtp_labels(b["labels"]) != IGNORE).sum()) for o, b in micro if o == "clm") \
            if self.uses_mtp else 0
        n_tok, n_mtp = self.dims.sum([n_tok, n_mtp], self.dims.replicas)
        self.tracker.reset()
        run = self._run_pipeline if self.pipeline is not None else self._run_micro
        lm_sum, mtp_sum, extra = run(micro, n_tok / self.dims.data_world, n_mtp / self.dims.data_world)
        for _, batch in micro:
            labels = batch["labels"][batch["labels"] != IGNORE]
            self.unigram += torch.bincount(labels.cpu(), minlength=self.unigram.numel()).double()
        # logged values are global (the same on every rank, so the guard agrees): token means, and the
        # balance terms averaged over data ranks (each rank's term is already scaled to the global one).
        # Loss sums exist once per (data rank, tp rank): on the last pipeline stage, or per stage's layers.
        names = sorted(self._balance_names(extra))
        lm_sum, mtp_sum, *extras = self.dims.sum([lm_sum, mtp_sum] + [extra.get(k, 0.0) for k in names],
                                                 self.dims.tp)
        metrics = {"loss": lm_sum / max(1, n_tok), "tokens": int(n_tok),
                   "objectives": {o: sum(1 for m, _ in micro if m == o) for o in cfg.train.objectives}}
        if n_mtp:
            metrics["mtp_loss"] = mtp_sum / n_mtp
            if self.mtp_agree is not None:  # `self` target: teacher-forced greedy draft acceptance
                metrics["mtp_agree"] = self.dims.sum(self.mtp_agree, self.dims.tp) / n_mtp
        return {**metrics, **{k: v / self.dims.data_world for k, v in zip(names, extras)}}

    def _run_micro(self, micro: list[tuple[str, dict]], step_tokens: float, step_mtp: float):
        """Forward/backward of each micro-batch in turn -> (lm sum, MTP sum, balance terms / n_micro)."""
        cfg = self.cfg
        lm_sum, mtp_sum, extra = 0.0, 0.0, {}
        self.mtp_agree = None
        for objective, batch in micro:
            with self.dims.loss_context():  # forward and backward (tensor parallel: vocab-parallel loss)
                with self._autocast():
                    res = self.micro_fn(self.model, batch, objective, cfg.train.mtp_weight, cfg.balance,
                                        cfg.dsa.indexer_loss_coef, self.capture, self.dims.data_group)
                    loss = micro_loss(res, step_tokens, step_mtp, cfg.train.mtp_weight, len(micro))
                loss.backward()
            lm_sum += float(res.lm_sum.detach())
            mtp_sum += float(res.mtp_sum.detach()) if res.mtp_sum is not None else 0.0
            if res.mtp_agree is not None:
                self.mtp_agree = (self.mtp_agree or 0) + res.mtp_agree
            for k, v in res.balance.items():
                extra[k] = extra.get(k, 0.0) + float(v.detach()) / len(micro)
            self.tracker.add(res.router_stats)
        return lm_sum, mtp_sum, extra

    def _run_pipeline(self, micro: list[tuple[str, dict]], step_tokens: float, step_mtp: float):
        """The same through the pipeline schedule (one objective per step)."""
        cfg = self.cfg
        with self.dims.loss_context(), self._autocast():
            sums = self.pipeline.run([b for _, b in micro], micro[0][0] == "clm" and self.uses_mtp,
                                     step_tokens, step_mtp, cfg.train.mtp_weight, cfg.balance, self.dims.data_group)
        self.pipeline.sync_tied_grads()
        for stats in sums.stats:
            self.tracker.add(stats)
        return sums.lm_sum, sums.mtp_sum, sums.balance

    def _balance_names(self, extra: dict) -> list[str]:
        """The balance terms every rank reports (pipeline stages without MoE layers report none)."""
        if self.pipeline is None:
            return list(extra)
        b = self.cfg.balance
        return [k for k, c in (("seq_aux_loss", b.seq_aux_coef), ("aux_loss", b.aux_coef),
                               ("z_loss", b.z_loss_coef)) if c]

    def _clip(self, params, norm: torch.Tensor) -> None:
        stab = self.cfg.stability
        if stab.clip in ("layerwise", "both"):
            self.layer_norms = self.dims.clip_layerwise(self.layer_groups, stab.layerwise_base)
            norm = self.dims.grad_norm(params)
        if stab.clip in ("global", "both"):
            self.dims.clip_global(params, stab.max_grad_norm, norm)

    def indexer_warmup(self, writer) -> None:
        """DSA stage 1 (before step 0): `dsa.indexer_warmup_steps` steps training only the indexers by
        KL to the frozen model's dense attention, with their own AdamW (not checkpointed: it is short)."""
        params = indexer_parameters(self.raw_model)
        if not params:
            return
        opt = torch.optim.AdamW(params, lr=self.cfg.dsa.indexer_warmup_lr, weight_decay=0.0)
        capture = AttnCapture(self.raw_model, self.cfg.dsa.indexer_kl_rows)
        try:
            for i in range(self.cfg.dsa.indexer_warmup_steps):
                batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                         for k, v in self.data.next_batch("clm").items()}
                with self._autocast():
                    kl = warmup_step(self.raw_model, batch, opt, capture, MODEL_KEYS)
                if i % self.cfg.log.every == 0 or i == self.cfg.dsa.indexer_warmup_steps - 1:
                    self._write(writer, {"event": "indexer_warmup", "warmup_step": i, "indexer_kl": kl})
        finally:
            capture.remove()

    def mtp_warm_start(self, writer) -> None:
        """`train.mtp_init = "lstsq"` (before step 0): the MTP layer's linear maps fitted in closed form to
        the frozen trunk's next hidden states over `train.mtp_init_batches` training batches
        (glm5/train/mtp_init.py). Those batches are consumed from the data stream; a run resumed past
        step 0 has the fitted weights in its checkpoint and does not fit again."""
        if self.dims.distributed:
            raise ValueError("train.mtp_init = 'lstsq' runs in one process")
        from .mtp_init import fit_mtp_lstsq
        t0 = time.perf_counter()
        self.data.set_step(0)
        n = self.cfg.train.mtp_init_batches
        if n == 0:
            if not hasattr(self.data, "epoch_batches"):
                raise ValueError("train.mtp_init_batches = 0 (one pass over the data) needs chat JSONL data; "
                                 "set a batch count")
            n = self.data.epoch_batches()
        batches = ({k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                    for k, v in self.data.next_batch("clm").items()} for _ in range(n))
        with self._autocast():
            info = fit_mtp_lstsq(self.raw_model, batches, self.cfg.train.mtp_init_ridge)
        record = {"event": "mtp_init", **info, "seconds": time.perf_counter() - t0}
        if self.cfg.log.eval_batches and self.data.val_batches(1):
            record.update({f"init_{k}": v for k, v in self.evaluate().items() if k.startswith("val_mtp")})
        self._write(writer, record)
        dist.print0(f"mtp_init: lstsq fit on {info['positions']} positions in {record['seconds']:.0f} s"
                    + "".join(f", {k} {record[k]:.4f}" for k in ("init_val_mtp_loss", "init_val_mtp_agree") if k in record))

    # --- evaluation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation LM loss (token-weighted) and the add-one unigram baseline fitted on the training
        targets seen so far, on the same validation tokens. With `train.trainable = "mtp"` also the MTP
        layer's validation loss (`val_mtp_loss`) and, for the `self` target, `val_mtp_agree` (the share of
        positions whose MTP argmax is the trunk's next argmax: teacher-forced greedy acceptance)."""
        self.model.eval()
        if self.capture is not None:
            self.capture.enabled = False
        total, count, uni = 0.0, 0, 0.0
        mtp = {"sum": 0.0, "tokens": 0, "agree": 0}
        counts = self.dims.sum_over_data_(self.unigram.clone())  # the global batch's targets, as one process's
        logp = torch.log((counts + 1) / (counts.sum() + counts.numel()))
        for batch in self.data.val_batches(self.cfg.log.eval_batches):
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with self._autocast(), self.dims.loss_context():
                if self.pipeline is not None:  # lm sum and tokens on the last stage, 0 elsewhere
                    total += self.pipeline.run([batch], False, 1.0, 0.0, 0.0, self.cfg.balance, self.dims.data_group,
                                               train=False).lm_sum
                    count += self.pipeline.lm_tokens([batch])
                elif self.cfg.train.trainable == "mtp":  # one frozen pass gives both losses
                    res = self.micro_fn(self.model, batch, "clm", self.cfg.train.mtp_weight, self.cfg.balance)
                    total += float(res.lm_sum)
                    count += res.lm_tokens
                    mtp["sum"] += float(res.mtp_sum)
                    mtp["tokens"] += res.mtp_tokens
                    mtp["agree"] += res.mtp_agree or 0
                else:
                    res = forward_micro(self.model, batch, "clm", 0.0, self.cfg.balance, fused_ce=self.fused_ce)
                    total += float(res.lm_sum)
                    count += res.lm_tokens
            labels = batch["labels"][batch["labels"] != IGNORE].cpu()
            uni -= float(logp[labels].sum())
        self.model.train()
        if self.capture is not None:
            self.capture.enabled = True
        total, count = self.dims.sum([total, count], self.dims.tp)  # over the data ranks' shards
        uni = self.dims.sum(uni, self.dims.replicas)
        count = int(count)
        if count == 0:
            return {}
        out = {"val_loss": total / count, "unigram_loss": uni / count, "val_tokens": count}
        if mtp["tokens"]:
            out["val_mtp_loss"] = mtp["sum"] / mtp["tokens"]
            if self.cfg.train.mtp_target == "self":
                out["val_mtp_agree"] = mtp["agree"] / mtp["tokens"]
        return out

    # --- the loop -----------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        writer = MetricsWriter(self.run_dir / "metrics.jsonl") if self.dims.is_main else None
        if writer is not None and self.step == 0:
            writer.write(0, event="config", config=to_dict(cfg), active_params=self.active_params,
                         num_threads=self.num_threads, device=str(self.device))
        if cfg.log.measure_peak:
            self.peak_flops = perf.measure_matmul_peak(self.device, self.autocast_dtype or torch.float32)
        if self.step == 0 and cfg.dsa.indexer_warmup_steps > 0:
            self.indexer_warmup(writer)
        if self.step == 0 and cfg.train.mtp_init == "lstsq":
            self.mtp_warm_start(writer)
        bar = _progress(cfg.log.progress and self.dims.is_main, self.step, cfg.train.steps)
        last_saved, summary = self.step, {}
        deadline = None
        if cfg.train.time_limit_min:
            self.time_budget = (time.monotonic(), 60 * cfg.train.time_limit_min)
            deadline = sum(self.time_budget)
        try:
            while self.step < cfg.train.steps:
                if deadline is not None and self.dims.max(float(time.monotonic() > deadline)) > 0:  # any rank
                    dist.print0(f"train.time_limit_min={cfg.train.time_limit_min} reached at step {self.step}")
                    break
                every = cfg.log.profile_comm_every
                profiled = self.dims.distributed and every > 0 and (self.step % every == 0 or self.step == 0)
                t0 = time.perf_counter()
                if profiled:  # communication time beside MFU (the profiler slows this step a little)
                    from .comm import profile_step
                    m, comm = profile_step(self.train_step)
                else:
                    m = self.train_step()
                dt = time.perf_counter() - t0
                m["step_s"] = dt
                m["tokens_per_s"] = m["tokens"] / dt  # m["tokens"] is already the global count
                # tokens/s is global, so the peak is one device's times the number of ranks
                m["mfu"] = perf.mfu(self.active_params, m["tokens_per_s"], self.peak_flops * self.dims.world)
                if profiled:
                    m.update(comm.as_metrics(dt))
                self.history.append({"step": self.step, **{k: v for k, v in m.items() if k != "expert_load"}})
                self._log(writer, bar, m)
                if cfg.log.eval_every and self.step % cfg.log.eval_every == 0 and self.step < cfg.train.steps:
                    self._write(writer, {"event": "eval", **self.evaluate()})
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save()
                    last_saved = self.step
            summary = self.evaluate()
            self._write(writer, {"event": "final", **summary})
            self.save_final()
        finally:
            if cfg.checkpoint.at_exit and self.step > last_saved:
                self.save()
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
        return summary

    def _log(self, writer, bar, m: dict) -> None:
        if bar is not None:
            bar.update(1)
            if self.frozen and "mtp_loss" in m:  # the MTP layer is what trains: its loss and agreement
                shown = {"mtp": f"{m['mtp_loss']:.3f}"}
                if "mtp_agree" in m:
                    shown["agree"] = f"{m['mtp_agree']:.2f}"
            else:
                shown = {"loss": f"{m['loss']:.3f}"}
            bar.set_postfix(**shown, lr=f"{m['lr']:.2e}", gnorm=f"{m['grad_norm']:.2f}",
                            tok_s=f"{m['tokens_per_s']:.0f}", mfu=f"{m['mfu']:.1%}",
                            **({"comm": f"{m['comm_frac']:.0%}"} if "comm_frac" in m else {}))
        if (self.step % self.cfg.log.every == 0 or self.step == self.cfg.train.steps or m.get("skipped")
                or "comm_s" in m):
            self._write(writer, m)

    def _write(self, writer, record: dict) -> None:
        if writer is not None:
            writer.write(self.step, **record)
        if record.get("event") in ("eval", "final") and record.get("val_loss") is not None:
            mtp = "".join(f"  {k} {record[k]:.4f}" for k in ("val_mtp_loss", "val_mtp_agree") if k in record)
            dist.print0(f"step {self.step}: val_loss {record['val_loss']:.4f}  "
                        f"unigram baseline {record['unigram_loss']:.4f}{mtp}")

    def save_final(self) -> Path | None:
        """`RUN_DIR/final`: the model in HF layout plus the tokenizer files (for `glm5 generate`)."""
        return self.checkpointer.save_final(self.run_dir / "final", self.data.save_tokenizer)


def _progress(enabled: bool, start: int, total: int):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)
