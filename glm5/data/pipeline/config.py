"""`DataConfig`: the typed config of `glm5 data run` (TOML in `configs/data/`, `--section.key=value` overrides).

One section per stage, in pipeline order. Thresholds default to the published values (Gopher, C4,
FineWeb as implemented in datatrove); `configs/data/default.toml` relaxes a few for the bundled corpus
and says why. `skip_domains` lists input `domain` labels a rule group is not applied to (per-domain
filtering: code is not prose, Tang poems are short lines by design).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .executor import ExecutorConfig

# Chinese varieties the langid model separates; classical poems often score as Wu or Cantonese
ZH_VARIETIES = {"wuu": "zh", "yue": "zh", "lzh": "zh", "gan": "zh", "hak": "zh", "nan": "zh", "cmn": "zh"}


@dataclass(kw_only=True)
class InputConfig:
    paths: list[str] = field(default_factory=lambda: ["bundled:corpus/train.jsonl.gz"])  # JSONL(.gz) files or globs
    text_key: str = "text"  # field holding the document text
    limit: int = 0  # read at most this many documents (0 = all); for quick runs


@dataclass(kw_only=True)
class RunConfig(ExecutorConfig):
    """Run layout; the executor fields (executor, ray_address, num_workers, max_retries) change where
    shards run, never the output."""

    output_dir: str = "runs/data/clean"  # final shards in <output_dir>/data, exclusions in /excluded
    shard_docs: int = 2000  # documents per shard (memory per worker is bounded by one shard)
    dedup_partitions: int = 8  # global dedup: keys and LSH band records are split into this many (output unchanged)
    overwrite: bool = False  # allow reusing an output_dir whose recorded config differs (wipes it)
    progress: bool = True  # tqdm progress bars


@dataclass(kw_only=True)
class NormalizeConfig:
    form: Literal["NFKC", "NFC", "none"] = "NFKC"  # Unicode normalisation form
    max_blank_lines: int = 1  # collapse longer runs of empty lines to this many


@dataclass(kw_only=True)
class LangIdConfig:
    enabled: bool = True
    languages: list[str] = field(default_factory=lambda: ["en", "zh"])  # keep these (ISO 639-1)
    min_score: float = 0.5  # py3langid normalised probability of the top language
    max_chars: int = 2000  # classify the first N characters (langid saturates quickly)
    skip_domains: list[str] = field(default_factory=lambda: ["code"])  # not natural language
    aliases: dict[str, str] = field(default_factory=lambda: dict(ZH_VARIETIES))  # merged before scoring


@dataclass(kw_only=True)
class GopherConfig:
    enabled: bool = True
    min_words: int = 50  # CJK characters count as words
    max_words: int = 100_000
    min_avg_word_length: float = 3.0  # only over non-CJK words; skipped for CJK-dominant text
    max_avg_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # ('#' + '...') / words
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = 0.8  # min fraction of words containing a letter (CJK counts)
    min_stop_words: int = 2
    skip_domains: list[str] = field(default_factory=lambda: ["code"])


@dataclass(kw_only=True)
class RepetitionConfig:
    enabled: bool = True
    dup_line_frac: float = 0.3  # fraction of lines that are duplicates
    dup_para_frac: float = 0.3
    dup_line_char_frac: float = 0.2  # fraction of characters in duplicate lines
    dup_para_char_frac: float = 0.2
    top_ngram_char_frac: list[float] = field(default_factory=lambda: [0.2, 0.18, 0.16])  # n = 2, 3, 4
    dup_ngram_char_frac: list[float] = field(default_factory=lambda: [0.15, 0.14, 0.13, 0.12, 0.11, 0.10])  # n=5..10
    ignore_layout_lines: bool = False  # leave letter-free lines (table borders) out of all repetition stats
    skip_domains: list[str] = field(default_factory=lambda: ["code"])


@dataclass(kw_only=True)
class C4Config:
    enabled: bool = True
    remove_no_terminal_punct_lines: bool = True  # C4 drops lines not ending in . ! ? " (and CJK 。！？)
    min_words_per_line: int = 3  # C4 drops lines with fewer words (CJK: characters)
    min_sentences: int = 5
    max_word_length: int = 1000  # drop lines with a longer word
    remove_javascript_lines: bool = True
    remove_policy_lines: bool = True  # "terms of use", "cookie policy", ...
    drop_lorem_ipsum: bool = True
    drop_curly_bracket: bool = True  # C4 drops pages with '{' (code); keep code out via skip_domains
    skip_domains: list[str] = field(default_factory=lambda: ["code"])


@dataclass(kw_only=True)
class FineWebConfig:
    enabled: bool = True
    line_punct_thr: float = 0.12  # min fraction of lines ending in punctuation
    short_line_thr: float = 0.67  # max fraction of lines shorter than short_line_length
    short_line_length: int = 30
    char_dup_ratio: float = 0.01  # max fraction of characters in duplicated lines
    new_line_ratio: float = 0.3  # max newlines per word
    ignore_layout_lines: bool = False  # leave letter-free lines out of the duplicated-characters ratio
    skip_domains: list[str] = field(default_factory=lambda: ["code"])


@dataclass(kw_only=True)
class CodeConfig:
    enabled: bool = True  # The Stack / StarCoder-style rules, applied only to domain == "code"
    max_avg_line_length: float = 100.0
    max_line_length: int = 1000
    min_alnum_frac: float = 0.25
    min_lines: int = 3


@dataclass(kw_only=True)
class PIIConfig:
    enabled: bool = True
    emails: bool = True
    ips: bool = True
    phones: bool = True
    redact_non_global_ips: bool = False  # 127.0.0.1, 192.168.x.x, 2001:db8:: ... are not personal data


@dataclass(kw_only=True)
class DedupConfig:
    exact: bool = True  # drop documents whose whitespace/case-normalised text was seen before
    minhash: bool = True
    num_bands: int = 20  # LSH bands b; num_perm = b * r
    rows_per_band: int = 5  # rows r; P(candidate | Jaccard s) = 1 - (1 - s^r)^b
    verify_threshold: float = 0.7  # candidates must also have estimated Jaccard >= this (0 = off)
    word_ngram: int = 5  # shingle size in words (non-CJK text)
    char_ngram: int = 5  # shingle size in characters (CJK-dominant text)
    cjk_ratio: float = 0.3  # a document with this fraction of CJK characters uses character shingles
    seed: int = 1


@dataclass(kw_only=True)
class QualityConfig:
    enabled: bool = True
    threshold: float = 0.5  # keep documents with P(high quality) >= threshold
    positive_sources: list[str] = field(default_factory=list)  # [] = all kept docs are positives
    max_train_docs: int = 4000  # positives sampled (deterministically) for training
    num_buckets: int = 1 << 18  # hashed n-gram feature space
    epochs: int = 10
    lr: float = 0.5  # Adagrad step size
    weight_decay: float = 1e-5
    max_chars: int = 4000  # featurise the first N characters
    seed: int = 0


@dataclass(kw_only=True)
class DomainConfig:
    enabled: bool = True
    keep_existing: bool = True  # keep a non-empty input `domain`; stats still report tagger agreement


@dataclass(kw_only=True)
class DataConfig:
    """`glm5 data run` configuration: input, run layout, then one section per stage in order."""

    input: InputConfig = field(default_factory=InputConfig)
    run: RunConfig = field(default_factory=RunConfig)
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    langid: LangIdConfig = field(default_factory=LangIdConfig)
    gopher: GopherConfig = field(default_factory=GopherConfig)
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    c4: C4Config = field(default_factory=C4Config)
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
    pii: PIIConfig = field(default_factory=PIIConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    domain: DomainConfig = field(default_factory=DomainConfig)
