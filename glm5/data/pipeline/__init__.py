"""Data-cleaning pipeline: normalise -> langid -> rule filters -> PII -> exact dedup -> MinHash -> quality
-> domain tags, over JSONL shards (`glm5 data run --config configs/data/default.toml`). See docs/data.md."""
