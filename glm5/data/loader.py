"""Packed, mixed, curriculum-scheduled, rank-sharded, resumable pretraining batches.

Owns `DataLoaderConfig` (the `[data]` section of a training TOML), the per-group document streams,
row packing and the batch dicts of docs/CONTRACTS.md:
  input_ids [B,T], labels [B,T] (-100 = no loss), position_ids [B,T] (restart per document),
  segment_ids [B,T] (1.. per packed piece, 0 = padding; attend only within a segment), and, when
  `infill_ratio > 0`, attention_mask [B,T,T] bool (True = may attend) + block_position_ids [B,T].
Labels are already aligned: `labels[b, t]` is the target of `logits[b, t]` (do not shift again).

Mixing (seed D3): each row is filled from one group (domain, lang or source), drawn with the current
stage's weights; a stage also sets the sequence length and may admit only long documents.

Elastic order: the loader walks one global sequence of rows that depends only on the data, the config
and the seed, never on the rank or the world size. Call k of `next_batch` covers the global rows
[k*B*W, (k+1)*B*W) and rank r gets rows [k*B*W + r*B, k*B*W + (r+1)*B) of it (B = batch_size, W = world):
any split of the same global batch over ranks sees the same rows, and the state (step, global row
counter, stream cursors) is the same on every rank, so a run resumes at another world size at its
exact data position. Every rank advances the document cursors through all B*W rows, but only builds
the token arrays of its own B (the others cost a cursor update; infilling rows also draw their spans).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import torch

from glm5.core import dist
from glm5.data.code_completion import CodeFim, CodeTokens
from glm5.data.infilling import IGNORE, InfillConfig, InfillTokens, make_infill_sample
from glm5.data.shards import TokenShards
from glm5.data.tokenizer import load_tokenizer


@dataclass(kw_only=True)
class StageConfig:
    """One curriculum stage."""

    until_step: int = 0
    """The stage covers steps < until_step (0 = to the end; only the last stage)."""
    seq_len: int = 512
    """Row length in tokens during this stage."""
    weights: dict[str, float] = field(default_factory=dict)
    """Group (see `mix_by`) -> sampling weight; {} = proportional to each group's tokens."""
    min_doc_tokens: int = 0
    """Only start documents at least this long during the stage (seed D3: long documents last)."""


@dataclass(kw_only=True)
class DataLoaderConfig:
    """The `[data]` section: where the shards are and how batches are built."""

    train_path: str = "runs/data/tokens/train"
    """Shard directory written by `glm5 data tokenize`."""
    val_path: str = "runs/data/tokens/validation"
    """Validation shard directory (`eval_batches`)."""
    batch_size: int = 8
    """Rows per batch, per rank."""
    seq_len: int = 512
    """Row length when `stages` is empty."""
    seed: int = 1234
    """Seeds document order, group draws and infilling."""
    mix_by: Literal["domain", "lang", "source"] = "domain"
    """Document field the mixture weights refer to."""
    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights when `stages` is empty ({} = proportional to tokens)."""
    stages: list[StageConfig] = field(default_factory=list)
    """Curriculum (seed D3): ordered stages with `until_step`, `seq_len`, `weights`."""
    infill_ratio: float = 0.0
    """Fraction of rows trained with GLM blank infilling (seed M4) instead of causal LM."""
    infill: InfillConfig = field(default_factory=InfillConfig)
    """Blank-infilling settings."""
    fim_spm_ratio: float = 0.5
    """"fim" batches (fill-in-the-middle with sentinel tokens, causal): fraction of pieces in SPM order
    (suffix first), the rest in PSM order. Unused with GLM's <|code_*|> tokens (every GLM vocabulary):
    those samples take GLM's code-completion prompt, which is suffix first, as `glm5 serve` builds it."""
    groups: dict[str, list[str]] = field(default_factory=dict)
    """Named groups of `mix_by` values that mixture weights may refer to, e.g. the seeds' code mixture
    {general = ["tech", "quotes", "literature"], code = ["code"], math = ["math"]} with weights
    {general = 0.6, code = 0.3, math = 0.1}; a group's weight is split over its values by tokens."""

    def __post_init__(self):
        if not 0.0 <= self.infill_ratio <= 1.0:
            raise ValueError("infill_ratio must be in [0, 1]")
        if not 0.0 <= self.fim_spm_ratio <= 1.0:
            raise ValueError("fim_spm_ratio must be in [0, 1]")
        for name, members in self.groups.items():
            if not members:
                raise ValueError(f"groups.{name}: lists no {self.mix_by} values")
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("batch_size must be >= 1 and seq_len >= 2")
        for i, st in enumerate(self.stages):
            if st.seq_len < 2:
                raise ValueError(f"stages[{i}].seq_len must be >= 2")
            if st.until_step < 0 or (st.until_step == 0 and i < len(self.stages) - 1):
                raise ValueError(f"stages[{i}].until_step must be > 0 (only the last stage may be 0)")
            if i and 0 < st.until_step <= self.stages[i - 1].until_step:
                raise ValueError(f"stages[{i}].until_step must increase")
            if st.min_doc_tokens < 0:
                raise ValueError(f"stages[{i}].min_doc_tokens must be >= 0")

    def stage_at(self, step: int) -> StageConfig:
        """The stage that applies at `step` (the last one once every until_step is passed)."""
        for st in self.stages:
            if st.until_step <= 0 or step < st.until_step:
                return st
        if self.stages:
            return self.stages[-1]
        return StageConfig(until_step=0, seq_len=self.seq_len, weights=self.weights)


class DocStream:
    """One group's documents: epoch-wise permutation (sliced as rank::world), cursor (pos, offset).

    The training loader uses one global stream per group (rank 0 of 1); `eval_batches` too."""

    def __init__(self, shards: TokenShards, docs: np.ndarray, seed: int, key: int, rank: int, world: int,
                 shuffle: bool = True):
        if len(docs) < world:
            raise ValueError(f"a group has {len(docs)} documents, fewer than the {world} ranks")
        self.shards, self.docs, self.seed, self.key, self.rank, self.world = shards, docs, seed, key, rank, world
        self.shuffle = shuffle
        self.epoch, self.pos, self.offset = 0, 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        perm = np.random.default_rng([self.seed, self.key, self.epoch]).permutation(self.docs) \
            if self.shuffle else self.docs
        return perm[self.rank:: self.world]

    def current(self) -> tuple[int, np.ndarray]:
        """(doc index, its not yet consumed tokens)."""
        doc = int(self._order[self.pos])
        return doc, self.shards.doc(doc)[self.offset:]

    def advance(self, n: int, remaining: int) -> None:
        """Consume n of the `remaining` tokens of the current document."""
        if n >= remaining:
            self.pos, self.offset = self.pos + 1, 0
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order()
        else:
            self.offset += n

    def skip_shorter(self, min_tokens: int) -> None:
        """Skip (consume) documents shorter than `min_tokens`; a document already started is kept."""
        for _ in range(len(self._order) + 1):
            if self.offset > 0 or self.shards.doc_len[self._order[self.pos]] >= min_tokens:
                return
            self.advance(1, 1)
        raise ValueError(f"no document of >= {min_tokens} tokens in this rank's share of a group")

    def state(self) -> list[int]:
        return [self.epoch, self.pos, self.offset]

    def load(self, state: list[int]) -> None:
        self.epoch, self.pos, self.offset = map(int, state)
        self._order = self._epoch_order()


@functools.lru_cache(maxsize=4)
def _tril(T: int) -> np.ndarray:
    t = np.tril(np.ones((T, T), dtype=bool))
    t.flags.writeable = False
    return t


class Row:
    """Builds one packed row of length T from pieces (causal or infill). With `store=False` only the
    fill level is tracked (another rank's row: the cursors must advance, the tokens are not needed)."""

    def __init__(self, T: int, pad_id: int, store: bool = True):
        self.T, self.pad_id, self.n, self.seg, self.store = T, pad_id, 0, 0, store
        n = T if store else 0
        self.input_ids = np.full(n, pad_id, dtype=np.int64)
        self.labels = np.full(n, IGNORE, dtype=np.int64)
        self.position_ids = np.zeros(n, dtype=np.int64)
        self.block_position_ids = np.zeros(n, dtype=np.int64)
        self.segment_ids = np.zeros(n, dtype=np.int64)
        self.pieces: list[tuple[int, int, int]] = []  # (start, length, sep = |bidirectional prefix|)

    @property
    def room(self) -> int:
        return self.T - self.n

    def add(self, input_ids, labels, position_ids, block_position_ids=None, sep: int = 0) -> None:
        """Append a piece; its first `sep` tokens (GLM Part A) attend bidirectionally."""
        s, L = self.n, len(input_ids)
        self.seg += 1
        self.n += L
        if not self.store:
            return
        self.input_ids[s: s + L] = input_ids
        self.labels[s: s + L] = labels
        self.position_ids[s: s + L] = position_ids
        if block_position_ids is not None:
            self.block_position_ids[s: s + L] = block_position_ids
        self.segment_ids[s: s + L] = self.seg
        self.pieces.append((s, L, sep))

    def add_causal(self, tokens: np.ndarray) -> None:
        if not self.store:
            self.add(tokens, None, None)
            return
        tokens = np.asarray(tokens, dtype=np.int64)
        labels = np.append(np.asarray(tokens[1:], dtype=np.int64), IGNORE)
        self.add(tokens, labels, np.arange(len(tokens)))

    def attention_mask(self) -> np.ndarray:
        """[T, T] bool, block-diagonal over pieces: causal, except that keys in a piece's first `sep`
        tokens (GLM Part A) are visible to the whole piece. Padding (segment 0) is causal among
        itself, so no softmax row is empty."""
        m = np.zeros((self.T, self.T), dtype=bool)
        tril = _tril(self.T)
        for s, L, sep in self.pieces + [(self.n, self.T - self.n, 0)]:
            m[s: s + L, s: s + L] = tril[:L, :L]  # copies, no temporaries: this is the hot loop
            m[s: s + L, s: s + sep] = True
        return m


class PackedLoader:
    """Infinite iterator of training batches; see the module docstring."""

    def __init__(self, cfg: DataLoaderConfig, rank: int | None = None, world_size: int | None = None,
                 shards: TokenShards | None = None):
        self.cfg = cfg
        self.rank = dist.rank() if rank is None else rank
        self.world = dist.world_size() if world_size is None else world_size
        self.shards = shards or TokenShards(cfg.train_path)
        self.pad_id = int(self.shards.meta.get("pad_token_id", 0))
        groups = self.shards.groups(cfg.mix_by)
        self.group_names = sorted(groups)
        self.group_tokens = {g: int(self.shards.doc_len[d].sum()) for g, d in groups.items()}
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside world size {self.world}")
        # one global stream per group (rank 0 of 1): the row sequence never depends on the world size
        self.streams = {g: DocStream(self.shards, groups[g], cfg.seed, k, 0, 1)
                        for k, g in enumerate(self.group_names)}
        special = self.shards.special_tokens
        self.infill_ids = InfillTokens.from_special_tokens(special) \
            if all(t in special for t in ("[MASK]", "[sMASK]", "[gMASK]", "<sop>", "<eop>")) else None
        if cfg.infill_ratio > 0 and self.infill_ids is None:
            raise ValueError(f"infill_ratio > 0 but {cfg.train_path}/meta.json lacks GLM mask token ids")
        fim = [special.get(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>")]
        self.fim_ids = tuple(fim) if all(i is not None for i in fim) else None
        # GLM's <|code_*|> tokens: "fim" samples take GLM's code-completion layout (glm5.data.code_completion)
        self.code_fim_tokens = CodeTokens.from_special_tokens(special)
        self.sentence_end_ids = self.shards.sentence_end_ids
        self.step, self.rows, self.manual_step = 0, 0, False
        for st in cfg.stages or [cfg.stage_at(0)]:
            self._probs(st)  # validate every stage's weights up front

    def _probs(self, stage: StageConfig) -> np.ndarray:
        if not stage.weights:
            w = np.array([self.group_tokens[g] for g in self.group_names], dtype=np.float64)
        else:
            w = np.array([self._weight(stage.weights, g) for g in self.group_names], dtype=np.float64)
        if w.sum() <= 0 or w.min() < 0:
            raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {stage.weights}")
        return w / w.sum()

    def _weight(self, weights: dict[str, float], value: str) -> float:
        """A data value's share: its own weight, plus for each named group holding it, the group's weight
        times the value's share of the group's tokens."""
        known = set(self.group_names) | set(self.cfg.groups)
        unknown = sorted(set(weights) - known)
        if unknown:
            raise ValueError(f"mixture weights name {unknown}, but the data's {self.cfg.mix_by} values are "
                             f"{self.group_names} and the named groups {sorted(self.cfg.groups)}")
        for name, members in self.cfg.groups.items():
            missing = sorted(set(members) - set(self.group_names))
            if missing and weights.get(name, 0) > 0:
                raise ValueError(f"groups.{name} lists {missing}, not among the data's {self.cfg.mix_by} "
                                 f"values {self.group_names}")
        w = weights.get(value, 0.0)
        for name, members in self.cfg.groups.items():
            if value in members and weights.get(name, 0) > 0:
                total = sum(self.group_tokens.get(m, 0) for m in members)
                w += weights[name] * self.group_tokens[value] / total
        return w

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def set_step(self, step: int) -> None:
        """Tell the loader the training step (curriculum stage); without it, one batch = one step."""
        self.step, self.manual_step = int(step), True

    def next_batch(self, objective: Literal["clm", "glm", "fim"] | None = None) -> dict[str, torch.Tensor]:
        """The next batch. `objective` forces every row to causal LM ("clm"), blank infilling ("glm") or
        sentinel fill-in-the-middle ("fim", causal); None draws each row's objective with `infill_ratio`."""
        if objective not in (None, "clm", "glm", "fim"):
            raise ValueError(f"objective must be None, 'clm', 'glm' or 'fim', got {objective!r}")
        if objective == "glm" and self.infill_ids is None:
            raise ValueError("objective 'glm' needs the shards' [MASK]/<sop>/<eop> ids (special_tokens in meta)")
        if objective == "fim" and self.fim_ids is None and self.code_fim_tokens is None:
            raise ValueError("objective 'fim' needs a tokenizer with GLM's <|code_prefix|>/<|code_suffix|>/"
                             "<|code_middle|> or <|fim_prefix|>/<|fim_suffix|>/<|fim_middle|> "
                             "(train one with `glm5 data tokenizer --fim_tokens=true`) in the shards' meta")
        stage = self.cfg.stage_at(self.step)
        probs = self._probs(stage)
        B = self.cfg.batch_size
        mine = range(self.rank * B, (self.rank + 1) * B)  # this rank's rows of the global batch
        rows = [self._build_row(stage, probs, objective, store=i in mine) for i in range(B * self.world)]
        rows = rows[mine.start: mine.stop]
        if not self.manual_step:
            self.step += 1
        with_mask = objective == "glm" or (objective is None and self.cfg.infill_ratio > 0)
        return collate(rows, with_mask=with_mask)

    def _build_row(self, stage: StageConfig, probs: np.ndarray, objective: str | None, store: bool) -> Row:
        """Global row number `self.rows`; its randomness depends on (seed, row) alone. The 0 keeps the
        seeding of the single-process stream that runs before elastic order produced."""
        rng = np.random.default_rng([self.cfg.seed, 0, self.rows, 7])
        self.rows += 1
        stream = self.streams[self.group_names[int(rng.choice(len(probs), p=probs))]]
        row = Row(stage.seq_len, self.pad_id, store)
        draw = rng.random()  # drawn even when the objective is forced, so row streams stay aligned
        infill = objective == "glm" or (objective is None and self.infill_ids is not None
                                        and draw < self.cfg.infill_ratio)
        while row.room >= 2:
            if stage.min_doc_tokens > 0:
                stream.skip_shorter(stage.min_doc_tokens)
            if infill and row.room >= self.cfg.infill.min_tokens + 2:
                self._add_infill(row, stream, rng)
            elif objective == "fim" and row.room >= FIM_MIN_TOKENS + 4:
                self._add_fim(row, stream, rng)
            else:
                self._add_causal(row, stream)
        return row

    def _add_causal(self, row: Row, stream: DocStream) -> None:
        _, rest = stream.current()
        take = min(len(rest), row.room)
        row.add_causal(rest[:take])
        # A document cut at the row's end continues in the next row from its last token again, so
        # every token but a document's first is a target exactly once.
        stream.advance(take if take == len(rest) else take - 1, len(rest))

    def _add_infill(self, row: Row, stream: DocStream, rng: np.random.Generator) -> None:
        _, rest = stream.current()
        n = min(len(rest), row.room - 2)
        if n < self.cfg.infill.min_tokens:  # short tail of a document: plain causal LM
            self._add_causal(row, stream)
            return
        while True:  # each span adds 2 tokens (mask + <sop>); shrink the piece until it fits
            sample = make_infill_sample(np.asarray(rest[:n], dtype=np.int64), rng, self.cfg.infill,
                                        self.infill_ids, self.sentence_end_ids)
            over = len(sample.input_ids) - row.room
            if over <= 0:
                break
            n -= over
            if n < self.cfg.infill.min_tokens:
                self._add_causal(row, stream)
                return
        row.add(sample.input_ids, sample.labels, sample.position_ids, sample.block_position_ids, sample.sep)
        stream.advance(n, len(rest))

    @cached_property
    def code_fim(self) -> CodeFim:
        """GLM's code-completion layout for "fim" samples, from the tokenizer the shards carry (its headers
        are text, so they are encoded with it)."""
        path = self.shards.dir / "tokenizer"
        path = path if path.is_dir() else Path(self.shards.meta.get("tokenizer", path))
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"objective 'fim' with GLM's <|code_*|> tokens encodes its headers with the shards' "
                             f"tokenizer, but {self.shards.dir} has no tokenizer/ (re-run `glm5 data tokenize`)")
        return CodeFim.from_tokenizer(load_tokenizer(path))

    def _add_fim(self, row: Row, stream: DocStream, rng: np.random.Generator) -> None:
        """A document piece as prefix/middle/suffix around two uniform cut points (token level), the middle
        ended by <|endoftext|>; causal loss on every token. With GLM's <|code_*|> tokens in GLM's
        code-completion prompt (as `/infill` builds it), else in SPM or PSM order with the sentinels."""
        _, rest = stream.current()
        overhead = self.code_fim.overhead if self.code_fim_tokens is not None else 4  # sentinels + end token
        n = min(len(rest), row.room - overhead)
        if n < FIM_MIN_TOKENS:
            self._add_causal(row, stream)
            return
        spm = rng.random() < self.cfg.fim_spm_ratio
        i, j = np.sort(rng.integers(0, n, size=2, endpoint=True))
        piece = np.asarray(rest[:n], dtype=np.int64)
        if self.code_fim_tokens is not None:
            row.add_causal(self.code_fim.sample(piece, int(i), int(j)))
        elif row.store:
            row.add_causal(fim_sample(piece, int(i), int(j), self.fim_ids, spm))
        else:
            row.add(np.empty(n + 4), None, None)
        stream.advance(n, len(rest))

    def state_dict(self) -> dict:
        return {"step": self.step, "rows": self.rows, "manual_step": self.manual_step, "rank": self.rank,
                "world_size": self.world, "seed": self.cfg.seed, "mix_by": self.cfg.mix_by,
                "streams": {g: s.state() for g, s in self.streams.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved global row, at any rank and world size (the state is the same on every
        rank); `rows` counts global rows, so a new batch_size x world_size splits what follows anew."""
        for key, mine in (("seed", self.cfg.seed), ("mix_by", self.cfg.mix_by)):
            if state[key] != mine:
                raise ValueError(f"loader state has {key}={state[key]!r}, this loader {mine!r}")
        if sorted(state["streams"]) != self.group_names:
            raise ValueError(f"loader state groups {sorted(state['streams'])} != data's {self.group_names}")
        self.step, self.rows = int(state["step"]), int(state["rows"])
        self.manual_step = bool(state.get("manual_step", False))
        for g, s in state["streams"].items():
            self.streams[g].load(s)


FIM_MIN_TOKENS = 8  # shorter pieces (document tails) stay plain causal LM


def fim_sample(tokens: np.ndarray, i: int, j: int, ids: tuple[int, int, int, int], spm: bool) -> np.ndarray:
    """prefix = tokens[:i], middle = tokens[i:j], suffix = tokens[j:] laid out as glm5.infer.infill prompts them:
    SPM `<suf> suffix <pre> prefix <mid> middle <end>`, PSM `<pre> prefix <suf> suffix <mid> middle <end>`."""
    pre, suf, mid, end = ids
    p, m, s = tokens[:i], tokens[i:j], tokens[j:]
    parts = ([suf], s, [pre], p) if spm else ([pre], p, [suf], s)
    return np.concatenate([*[np.asarray(x, dtype=np.int64) for x in parts], [mid], m, [end]]).astype(np.int64)


def collate(rows: list[Row], with_mask: bool) -> dict[str, torch.Tensor]:
    """Stack rows into the batch dict of docs/CONTRACTS.md."""
    stack = lambda name: torch.from_numpy(np.stack([getattr(r, name) for r in rows]))  # noqa: E731
    batch = {"input_ids": stack("input_ids"), "labels": stack("labels"),
             "position_ids": stack("position_ids"), "segment_ids": stack("segment_ids")}
    if with_mask:
        batch["attention_mask"] = torch.from_numpy(np.stack([r.attention_mask() for r in rows]))  # [B,T,T]
        batch["block_position_ids"] = stack("block_position_ids")
    return batch


def eval_batches(path: str, seq_len: int, batch_size: int, rank: int | None = None,
                 world_size: int | None = None, max_batches: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """One deterministic pass over a shard directory (documents in order), packed as causal LM rows.
    For validation loss / perplexity.

    Elastic like the training loader: global batch k is rows [k*B*W, (k+1)*B*W) of one world-independent
    row sequence and rank r gets its B rows of it. With W > 1 every rank's batch is padded to B rows
    (padding has no labels) so that all ranks run the same number of forward passes (FSDP, TP and PP
    forwards are collective); with W = 1 the last batch may be short. `max_batches` counts global batches.
    """
    rank = dist.rank() if rank is None else rank
    world = dist.world_size() if world_size is None else world_size
    shards = TokenShards(path)
    pad_id = int(shards.meta.get("pad_token_id", 0))
    stream = DocStream(shards, np.arange(len(shards)), 0, 0, 0, 1, shuffle=False)
    mine = range(rank * batch_size, (rank + 1) * batch_size)
    done = 0
    while stream.epoch == 0:
        rows = []
        for i in range(batch_size * world):
            if stream.epoch > 0:
                break
            row = Row(seq_len, pad_id, store=i in mine)
            while row.room >= 2 and stream.epoch == 0:
                _, rest = stream.current()
                take = min(len(rest), row.room)
                row.add_causal(rest[:take])
                stream.advance(take if take == len(rest) else take - 1, len(rest))
            rows.append(row)
        rows = rows[mine.start: mine.stop]
        if world > 1:
            rows += [Row(seq_len, pad_id) for _ in range(batch_size - len(rows))]
        if rows:
            yield collate(rows, with_mask=False)
        done += 1
        if max_batches and done >= max_batches:
            return


def stage_table(cfg: DataLoaderConfig) -> list[dict]:
    """The curriculum as plain dicts (for logs)."""
    return [dataclasses.asdict(s) for s in (cfg.stages or [cfg.stage_at(0)])]
