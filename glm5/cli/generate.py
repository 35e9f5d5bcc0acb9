"""`glm5 generate`: text generation from a checkpoint directory or a preset (random weights).

    glm5 generate --model tiny --prompt "Hello" --max-tokens 32 --temperature 0.7 --seed 1
    glm5 generate --model runs/ckpt --prompt "a" --prompt "b"          # several prompts, one batch
    glm5 generate --model runs/ckpt --interactive                      # chat with the chat template
    glm5 generate --model runs/code --prompt "def f(x):" --suffix "    return y" --temperature 0   # infill
    glm5 generate --model runs/code --prompt "import" --beam-width 4                # beam search
    glm5 generate --model runs/code --prompt "def" --temperature-schedule 0.8 0.2 # decaying temperature

Streams the completion of a single prompt as it is generated. Engine options (`--quantization int8`,
`--speculative-num-tokens 2`, `--max-model-len`, `--device`) go to `EngineConfig`.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv):
    p = argparse.ArgumentParser(prog="glm5 generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint directory or preset name (tiny, small, ...); default: the embedded "
                        "model bundled:smollm2-glm5 (SmolLM2-135M-Instruct in GLM-5 architecture)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat using the chat template")
    p.add_argument("--system", default=None, help="system message for --interactive")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per completion")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--temperature-schedule", type=float, nargs=2, metavar=("START", "END"), default=None,
                   help="temperature decaying linearly over --max-tokens (code: 0.8 0.2)")
    p.add_argument("--beam-width", type=int, default=1, help="> 1: beam search (HF semantics), best beam shown")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam score = logprob / length ** this")
    p.add_argument("--early-stopping", choices=["true", "false", "never"], default="false",
                   help="beam search stopping rule (HF semantics)")
    p.add_argument("--suffix", default=None, help="fill the gap between --prompt (prefix) and this text")
    p.add_argument("--infill-format", choices=["auto", "glm", "codegeex", "spm", "psm"], default="auto",
                   help="infill prompt format (auto: GLM [MASK] on a blank-infilling model, else GLM's "
                        "code-completion prompt with <|code_*|>, else FIM sentinels)")
    p.add_argument("--quantization", choices=["int8"], default=None, help="weight-only INT8")
    p.add_argument("--speculative-num-tokens", type=int, default=None,
                   help="MTP draft tokens per step (default: 0; 1 for the embedded model)")
    p.add_argument("--prompt-lookup-max", type=int, default=None,
                   help="correct MTP drafts by prompt lookup of the last N..2 tokens (0 = off; default: 0, "
                        "3 for the embedded model)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's max_position_embeddings)")
    p.add_argument("--max-session-len", type=int, default=None, help="--interactive: history token limit")
    p.add_argument("--session-policy", choices=["drop", "summarize"], default="drop",
                   help="--interactive: past --max-session-len drop the oldest turns or summarise them")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--compile-decode", choices=["none", "inductor", "cuda_graphs"], default="none",
                   help="decode steps compiled (torch.compile) or replayed from CUDA graphs (docs/engine.md)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.prompt and not args.interactive:
        print("glm5 generate: give --prompt TEXT or --interactive", file=sys.stderr)
        return 2
    from glm5.infer.llm import LLM  # noqa: PLC0415 (keep `glm5 --help` cheap)
    from glm5.infer.malloc import tune_malloc  # noqa: PLC0415
    from glm5.infer.sampling import SamplingParams  # noqa: PLC0415
    # one prompt (or one beam per request): size the default KV cache for a few full-length sequences,
    # not the engine's 256 (max_model_len is the model's whole context unless given)
    from glm5.cli.models import EMBEDDED_ENGINE_DEFAULTS, is_embedded, resolve_model  # noqa: PLC0415
    embedded = is_embedded(args.model) and args.beam_width <= 1
    spec = args.speculative_num_tokens
    if spec is None:
        spec = EMBEDDED_ENGINE_DEFAULTS["speculative_num_tokens"] if embedded else 0
    lookup = args.prompt_lookup_max
    if lookup is None:
        lookup = EMBEDDED_ENGINE_DEFAULTS["prompt_lookup_max"] if embedded and spec else 0
    if lookup and not spec:
        print("glm5 generate: --prompt-lookup-max corrects MTP drafts: it needs --speculative-num-tokens >= 1",
              file=sys.stderr)
        return 2
    model = resolve_model(args.model)
    opts = dict(quantization=args.quantization, speculative_num_tokens=spec, prompt_lookup_max=lookup,
                max_model_len=args.max_model_len, max_session_len=args.max_session_len,
                session_policy=args.session_policy, max_num_seqs=max(4, 2 * (args.beam_width or 1)),
                compile_decode=args.compile_decode)
    if args.device:
        opts["device"] = args.device
    tune_malloc()
    llm = LLM(model, **opts)
    beam = args.beam_width > 1
    stopping = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0 if beam else args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, use_beam_search=beam,
                            beam_width=args.beam_width, length_penalty=args.length_penalty,
                            early_stopping=stopping,
                            temperature_schedule=tuple(args.temperature_schedule) if args.temperature_schedule
                            else None)
    if llm.tokenizer is None:
        print("glm5 generate: this model has no tokenizer (text prompts need one)", file=sys.stderr)
        return 2
    if args.interactive:
        return chat(llm, params, args.system)
    if args.suffix is not None:
        for prompt in args.prompt:
            out = llm.infill(prompt, args.suffix, params, format=args.infill_format)
            print(f"{prompt}\033[1m{out.outputs[0].text}\033[0m{args.suffix}" if sys.stdout.isatty()
                  else out.outputs[0].text)
        return 0
    if beam:
        for prompt, out in zip(args.prompt, llm.beam_search(args.prompt, params)):
            print(f"=== {prompt!r} (best of {args.beam_width} beams)\n{out.outputs[0].text}")
        return 0
    if len(args.prompt) == 1:
        stream(llm, args.prompt[0], params)
        return 0
    for prompt, out in zip(args.prompt, llm.generate(args.prompt, params)):
        print(f"=== {prompt!r}\n{out.outputs[0].text}")
    return 0


def stream(llm, prompt: str, params) -> None:
    shown = 0
    for out in llm.generate_stream(prompt, params):
        text = out.outputs[0].text
        print(text[shown:], end="", flush=True)
        shown = len(text)
    print()


def chat(llm, params, system: str | None) -> int:
    from glm5.infer.session import Session  # noqa: PLC0415
    session = Session(llm.engine, system=system)
    print("chat: an empty line or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("user> ").strip()
        except EOFError:
            break
        if not line:
            break
        out = session.send(line, params)
        print(f"assistant> {out.outputs[0].text}")
    st = session.stats()
    print(f"[{st['turns']} turns, {st['cached_tokens']}/{st['prompt_tokens']} prompt tokens from the prefix cache]",
          file=sys.stderr)
    return 0
