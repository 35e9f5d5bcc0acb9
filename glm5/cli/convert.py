"""`glm5 convert SRC DST [--dtype bfloat16] [--max-shard-size 5GB]`: re-write a HF GLM-5 checkpoint;
`glm5 convert --from-llama SRC OUT [--experts 4] [--experts-per-token 2] [--first-dense 3] [--no-mtp]`:
rewrite a Llama-family checkpoint (Llama, Mistral without a sliding window, Qwen2; an HF directory, a
`.gguf` file or `bundled:smollm2`) exactly as a GLM-5 checkpoint.

GLM-5 mode: dequantises FP8 block-scaled weights (`weight_scale_inv`), casts to `--dtype` (router, its
bias and the indexer head weights stay fp32) and re-shards, streaming tensor by tensor: memory stays near
one shard. The result loads in glm5 (`glm5.from_pretrained`) and in transformers.

Llama mode (`glm5.convert.llama`): the logits of the result equal the source's (fp32 storage, the
default; bfloat16 storage rounds the weights). A source that cannot be embedded exactly is refused before
anything is written, naming the feature; OUT is written atomically (an existing OUT is replaced only on
success). Prints a one-line JSON summary. User mistakes print one line and exit 2 (`--debug`: traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LLAMA_DTYPES = ("float32", "bfloat16")
LLAMA_ONLY = {"experts": "--experts", "experts_per_token": "--experts-per-token", "first_dense": "--first-dense",
              "no_mtp": "--no-mtp", "nope_head_dim": "--qk-nope-head-dim", "index_heads": "--index-heads",
              "seed": "--seed"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="glm5 convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="GLM-5: HF checkpoint directory (config.json + safetensors); --from-llama: "
                                "an HF Llama/Mistral/Qwen2 directory, a .gguf file or bundled:smollm2")
    ap.add_argument("dst", metavar="out", help="output directory")
    ap.add_argument("--from-llama", action="store_true",
                    help="SRC is a Llama-family model: rewrite it exactly as GLM-5 (glm5.convert.llama)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32", "keep"],
                    help="storage dtype of the output. GLM-5 mode: default bfloat16 ('keep' = as stored; FP8 "
                         "becomes fp32). --from-llama: float32 (default, exact) or bfloat16 (rounded weights)")
    ap.add_argument("--max-shard-size", default=None, help="GLM-5 mode: e.g. 5GB (default), 500MB")
    lm = ap.add_argument_group("--from-llama options (the GLM-5 shape around the source; all keep it exact)")
    lm.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default 4)")
    lm.add_argument("--experts-per-token", type=int, default=None, help="routed experts per token (default 2)")
    lm.add_argument("--first-dense", type=int, default=None,
                    help="leading layers that keep the dense MLP (default 3; the rest become MoE)")
    lm.add_argument("--no-mtp", action="store_true", help="no MTP layer (default: one, for speculative decoding)")
    lm.add_argument("--qk-nope-head-dim", dest="nope_head_dim", type=int, default=None,
                    help="position-free query/key dims per head, zero at conversion (default 32)")
    lm.add_argument("--index-heads", type=int, default=None,
                    help="DSA indexer heads (default: one per attention head)")
    lm.add_argument("--seed", type=int, default=None, help="seed of the initialised (not converted) weights")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from glm5.convert.llama import ConversionError  # noqa: PLC0415 (keep `glm5 --help` cheap)
    from glm5.core.config import ConfigError  # noqa: PLC0415

    try:
        summary = convert_from_llama(args) if args.from_llama else convert_glm5(args)
    except (ConversionError, ConfigError, FileNotFoundError, NotADirectoryError) as e:
        if args.debug:
            raise
        print(f"glm5 convert: {e}".replace("\n", " "), file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def convert_glm5(args: argparse.Namespace) -> dict:
    import torch  # noqa: PLC0415

    from glm5.convert.llama import ConversionError  # noqa: PLC0415
    from glm5.model.hf_adapter import convert_checkpoint  # noqa: PLC0415

    given = [flag for key, flag in LLAMA_ONLY.items() if getattr(args, key) not in (None, False)]
    if given:
        raise ConversionError(f"{', '.join(given)}: only with --from-llama")
    _check_glm5_source(Path(args.src))
    dtype = args.dtype or "bfloat16"
    return convert_checkpoint(args.src, args.dst, None if dtype == "keep" else getattr(torch, dtype),
                              args.max_shard_size or "5GB")


def _check_glm5_source(src: Path) -> None:
    """GLM mode reads the config.json of the GLM family (GLM-5, GLM-4.5/4.6/4.7, GLM-4.7-Flash; unknown
    keys kept): refuse another architecture's."""
    from glm5.convert.llama import REFUSED, SUPPORTED, ConversionError  # noqa: PLC0415
    from glm5.model.config import MODEL_TYPES  # noqa: PLC0415

    try:
        model_type = json.loads((src / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # convert_checkpoint names the problem
    if model_type in SUPPORTED:
        raise ConversionError(f"{src}: a {model_type!r} checkpoint, not GLM-5: convert it with --from-llama")
    if model_type is not None and model_type not in MODEL_TYPES:
        hint = f" ({REFUSED[model_type]} cannot be embedded exactly)" if model_type in REFUSED else ""
        raise ConversionError(f"{src}: model_type {model_type!r} is not a GLM checkpoint (supported: "
                              f"{list(MODEL_TYPES)}){hint}")


def convert_from_llama(args: argparse.Namespace) -> dict:
    import torch  # noqa: PLC0415

    from glm5.convert.llama import ConversionError, ConvertOptions, convert_llama  # noqa: PLC0415

    dtype = args.dtype or "float32"
    if dtype not in LLAMA_DTYPES:
        raise ConversionError(f"--dtype {dtype}: --from-llama writes {' or '.join(LLAMA_DTYPES)}")
    if args.max_shard_size is not None:
        raise ConversionError("--max-shard-size: only without --from-llama")
    opts = ConvertOptions()
    for key, field in (("experts", "n_routed_experts"), ("experts_per_token", "num_experts_per_tok"),
                       ("first_dense", "first_k_dense_replace"), ("nope_head_dim", "qk_nope_head_dim"),
                       ("index_heads", "index_n_heads"), ("seed", "seed")):
        if getattr(args, key) is not None:
            setattr(opts, field, getattr(args, key))
    opts.mtp = not args.no_mtp
    return convert_llama(args.src, args.dst, opts, dtype=getattr(torch, dtype),
                         log=lambda line: print(line, file=sys.stderr))
