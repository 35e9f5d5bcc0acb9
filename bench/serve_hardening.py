"""Hardening runs against `glm5 serve` on a tiny checkpoint (loopback only, bounded in time).

    python bench/serve_hardening.py disconnect [--clients 64] [--duration-s 60] [--model DIR]
    python bench/serve_hardening.py hugeprompt [--prompt-mb 3.9] [--model DIR]
    python bench/serve_hardening.py fuzz [--cases 2000]
    python bench/serve_hardening.py probe [--ocr]

`disconnect`: the issue-16 load run. N streaming clients for D seconds; each request streams a random
number of chunks and then drops the connection (about three in four) or reads to the end. Reports
requests, abrupt disconnects, failures (any non-200 or malformed stream), the server's RSS before
(after a warm-up) and after (once idle), the gauges once idle (running requests, KV usage), and
whether /health and a greedy completion are still right afterwards.
`hugeprompt`: /health latency and the inter-chunk gaps of 4 other streams, first with nothing else
going on, then while a multi-megabyte prompt is being tokenised; reports both and their ratio.
`probe`: the issue-30 probe against one `glm5 serve` with two API keys, an admin key and per-key limits
(and the OCR agent with `--ocr`): poisoned adapters (NaN, Inf, overflow, catastrophic regexes, a huge
rank), multi-megabyte prompts in parallel on every route that tokenises, a 20,000-property schema, a
6000x6000 page, one tenant flooding its queue, and every hand-written hostile request of tests/_fuzz.py;
meanwhile /health and a second tenant's small greedy completions are timed. Then the sandbox escapes.
Reports handled / failed per case (handled: the expected answer within 30 s), /health and small-request
p99 during the abuse, RSS before (after a warm-up) and after (once idle), escapes contained.
`fuzz`: the API fuzzer of tests/_fuzz.py (Hypothesis, random seed) for N cases plus the hand-written
hostile requests, against the real engine in-process; prints the result table of docs/serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from glm5.serve.testing import free_port  # noqa: E402

PROMPT = "The capital of France is"


def tiny_checkpoint(path: Path) -> Path:
    """The tiny preset (2 layers), random init, with the bundled tokenizer: what the tests serve."""
    import torch

    from glm5.data.tokenizer import load_tokenizer
    from glm5.model.config import ModelConfig
    from glm5.model.hf_adapter import save_pretrained
    from glm5.model.model import GLM5ForCausalLM
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    save_pretrained(GLM5ForCausalLM(cfg).init_weights(0).eval(), path)
    load_tokenizer("bundled:tokenizer-8k").save(path)
    return path


class Server:
    """`glm5 serve` as a subprocess on a free loopback port."""

    def __init__(self, model: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glm5.cli.main", "serve", "--model", str(model), "--port", str(self.port),
             "--device=cpu", "--batch_timeout_ms=0", "--max_model_len=512", "--num_blocks=512",
             "--max_num_seqs=64", "--max_batch_size=64", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("server did not start")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def greedy(self) -> str:
        r = httpx.post(self.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                       timeout=60)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=120)


async def _client(url: str, until: float, rng: random.Random, tally: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        while time.monotonic() < until:
            body = {"prompt": PROMPT + " " + str(rng.random()), "max_tokens": rng.randint(8, 64), "stream": True,
                    "ignore_eos": True}
            cut = rng.randint(1, 6) if rng.random() < 0.75 else None  # chunks before an abrupt disconnect
            tally["requests"] += 1
            try:
                async with h.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        _fail(tally, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    seen, done = 0, False
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        if "error" in json.loads(line[len("data: "):]):  # an error chunk, not the word in text
                            _fail(tally, line[:300])
                            break
                        seen += 1
                        if cut is not None and seen >= cut:
                            break  # leaving the block closes the connection mid-stream
                    if cut is not None and not done and seen >= cut:
                        tally["disconnects"] += 1
                    elif done:
                        tally["completed"] += 1
            except httpx.HTTPError as e:
                _fail(tally, f"{type(e).__name__}: {e}")


def _fail(tally: dict, why: str) -> None:
    tally["failed"] += 1
    tally.setdefault("failures", []).append(why)


def _settled_rss(server: Server) -> float:
    """RSS once the server is idle again (no running request)."""
    deadline = time.monotonic() + 60
    while server.metric("vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    return server.rss_mib()


def disconnect(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_checkpoint(Path(tmp) / "tiny")
        server = Server(model)
        try:
            reference = server.greedy()
            asyncio.run(_load(server.url, args.clients, 10.0, 1))  # warm-up: allocator, caches, buffers
            before = _settled_rss(server)
            tally = {"requests": 0, "completed": 0, "disconnects": 0, "failed": 0}
            t0 = time.monotonic()
            asyncio.run(_load(server.url, args.clients, args.duration_s / 2, 2, tally))
            middle = _settled_rss(server)  # a leak keeps growing from here; a warm heap does not
            asyncio.run(_load(server.url, args.clients, args.duration_s / 2, 3, tally))
            elapsed = time.monotonic() - t0
            after = _settled_rss(server)
            out = {**tally, "clients": args.clients, "seconds": round(elapsed, 1),
                   "rss_before_mib": round(before, 1), "rss_half_mib": round(middle, 1),
                   "rss_after_mib": round(after, 1), "rss_second_half_ratio": round(after / middle, 3),
                   "running_after": server.metric("vllm:num_requests_running"),
                   "kv_usage_after": server.metric("vllm:kv_cache_usage_perc"),
                   "health_after": httpx.get(server.url + "/health", timeout=30).status_code,
                   "greedy_unchanged": server.greedy() == reference}
            out["rss_ratio"] = round(out["rss_after_mib"] / out["rss_before_mib"], 3)
        finally:
            out_code = server.stop()
        out["exit_code_on_sigterm"] = out_code
        return out


async def _load(url: str, clients: int, seconds: float, seed: int, tally: dict | None = None) -> None:
    tally = tally if tally is not None else {"requests": 0, "completed": 0, "disconnects": 0, "failed": 0}
    until = time.monotonic() + seconds
    await asyncio.gather(*[_client(url, until, random.Random(seed * 1000 + i), tally) for i in range(clients)])


async def _probe(url: str, seconds: float, stop: asyncio.Event | None = None) -> tuple[list[float], list[float]]:
    """(/health latencies, inter-chunk gaps of 4 streams) for `seconds`, or until `stop` is set."""
    health, gaps = [], []
    until = time.monotonic() + seconds

    def going() -> bool:
        return not stop.is_set() if stop is not None else time.monotonic() < until

    async def stream(h):
        while going():
            async with h.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "stream": True,
                                                                 "ignore_eos": True}) as r:
                last = time.monotonic()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last = now

    async def ping(h):
        while going():
            t = time.monotonic()
            await h.get("/health")
            health.append(time.monotonic() - t)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, timeout=300) as h:
        await asyncio.gather(ping(h), *[stream(h) for _ in range(4)])
    return health, gaps


def hugeprompt(args) -> dict:
    text = ("The quick brown fox jumps over the lazy dog; def f(x): return x + 1\n" * 80000)
    text = text[: int(args.prompt_mb * 1e6)]  # ASCII: one byte per character, under the 4 MiB body bound
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_checkpoint(Path(tmp) / "tiny")
        server = Server(model)
        try:
            quiet = asyncio.run(_probe(server.url, args.window_s))

            async def with_huge():
                async with httpx.AsyncClient(base_url=server.url, timeout=600) as h:
                    done = asyncio.Event()
                    probe = asyncio.create_task(_probe(server.url, 0, done))
                    t = time.monotonic()
                    r = await h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                    huge_s = time.monotonic() - t
                    done.set()
                    return r.status_code, huge_s, await probe
            status, huge_s, busy = asyncio.run(with_huge())
        finally:
            server.stop()
    def summary(xs):
        xs = sorted(xs)
        return {"n": len(xs), "p50_ms": round(1000 * xs[len(xs) // 2], 1), "max_ms": round(1000 * xs[-1], 1)}
    out = {"prompt_bytes": len(body), "huge_status": status, "huge_request_s": round(huge_s, 2),
           "health_quiet": summary(quiet[0]), "health_during": summary(busy[0]),
           "stream_gap_quiet": summary(quiet[1]), "stream_gap_during": summary(busy[1])}
    out["health_max_ratio"] = round(out["health_during"]["max_ms"] / max(out["health_quiet"]["max_ms"], 1e-3), 2)
    out["gap_max_ratio"] = round(out["stream_gap_during"]["max_ms"] / max(out["stream_gap_quiet"]["max_ms"], 1e-3), 2)
    return out


KEY_A, KEY_B, ADMIN = "sk-probe-a", "sk-probe-b", "admin-probe"


def _adapters(root: Path, base: Path) -> dict[str, Path]:
    """A real rank-4 adapter of the tiny model and its poisoned copies (tensors or adapter_config.json)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from glm5.finetune.adapters import from_pretrained
    from glm5.model import lora
    m = from_pretrained(base)
    m.add_lora(lora.LoraConfig(r=4, alpha=8, targets=["attn", "experts"]))
    with torch.no_grad():
        for t, mod in lora.lora_layers(m):
            (mod.lora_B.weight if t.param is None else mod.lora_B).normal_(0, 0.3)
    m.save_adapter(root / "good")
    evil = r"([\w.]|[\w.])*Z"
    fill = lambda v: lambda k, t: t.fill_(v) if "lora_B" in k else t  # noqa: E731
    first_nan = lambda k, t: t.index_fill_(0, torch.tensor([0]), float("nan"))  # noqa: E731
    variants = {"nan": (first_nan, None), "inf": (fill(float("inf")), None), "overflow-at-load": (fill(3e38), None),
                "overflow-in-forward": (fill(1e38), None), "huge-rank": (None, ("rank_pattern", {"q_a_proj": 100000})),
                "evil-targets": (None, ("target_modules", evil)), "evil-alpha": (None, ("alpha_pattern", {evil: 4})),
                "backreference": (None, ("target_modules", r"(a)\1"))}
    out = {"good": root / "good"}
    for name, (tensor_fn, cfg_item) in variants.items():
        dst = out[name] = root / name
        shutil.copytree(root / "good", dst)
        if tensor_fn is not None:
            tensors = load_file(dst / "adapter_model.safetensors")
            save_file({k: tensor_fn(k, t.clone()) for k, t in tensors.items()}, dst / "adapter_model.safetensors")
        if cfg_item is not None:
            cfg = json.loads((dst / "adapter_config.json").read_text())
            cfg[cfg_item[0]] = cfg_item[1]
            (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def _page_png(w: int = 6000, h: int = 6000) -> bytes:
    """A 1-bit PNG page of text lines; 6000 x 6000 (36 Mpx, under the 40 Mpx decode limit) is a few
    hundred kilobytes on the wire."""
    import io

    from PIL import Image, ImageDraw
    im = Image.new("1", (w, h), 1)
    d = ImageDraw.Draw(im)
    for y in range(40, h - 40, 60):
        for x in range(40, w - 200, 400):
            d.text((x, y), "lorem ipsum", fill=0)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _p99(xs: list[float]) -> dict:
    xs = sorted(xs) or [float("nan")]
    return {"n": len(xs), "p50_ms": round(1000 * xs[len(xs) // 2], 1),
            "p99_ms": round(1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1), "max_ms": round(1000 * xs[-1], 1)}


def probe(args) -> dict:
    from tests import _fuzz
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_checkpoint(Path(tmp) / "tiny")
        adapters = _adapters(Path(tmp), model)
        extra = ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN, "--max-running-per-key=4",
                 "--max-waiting-per-key=8", "--max_loras=4"]
        if args.ocr:
            extra += ["--ocr", "--ocr-rounds", "1"]
        server = Server(model, *extra)
        try:
            out = asyncio.run(_probe_all(server, adapters, _fuzz, args.ocr, args.passes))
        finally:
            code = server.stop()
        out["exit_code_on_sigterm"] = code
    out["sandbox"] = sandbox_escapes()
    return out


async def _probe_all(server: Server, adapters: dict[str, Path], _fuzz, ocr: bool, passes: int) -> dict:
    a, b = ({"authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
    admin = {"authorization": f"Bearer {ADMIN}"}
    greedy = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as h:
        reference = (await h.post("/v1/completions", json=greedy, headers=b)).json()["choices"][0]["text"]
        for _ in range(20):  # warm-up: allocator, caches, and one ordinary request of each kind below
            await h.post("/v1/completions", json={**greedy, "max_tokens": 16}, headers=a)
        chat = {"messages": [{"role": "user", "content": "hi " * 200}], "max_tokens": 8}
        for path, body in (("/v1/chat/completions", chat), ("/tokenize", {"prompt": PROMPT * 50}),
                           ("/v1/messages", {"model": "tiny", **chat}),
                           ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
                               "name": "w", "schema": _fuzz._wide_schema(8)}}}),
                           ("/v1/completions", {**greedy, "n": 4, "beam_width": 4, "use_beam_search": True}),
                           ("/v1/load_lora_adapter", {"lora_name": "w", "lora_path": str(adapters["good"])}),
                           ("/v1/completions", {**greedy, "model": "w"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "w"})):
            r = await h.post(path, json=body, headers=admin if "lora_adapter" in path else a)
            assert r.status_code == 200, (path, r.text)
        if ocr:  # an ordinary page: 1240 x 1754 (A4 at 150 dpi)
            r = await h.post("/v1/ocr", headers=a, files={"file": ("page.png", _page_png(1240, 1754), "image/png")})
            assert r.status_code == 200, r.text
        await asyncio.sleep(3)
        rss_before = server.rss_mib()
        health, small, small_wrong = [], [], []
        health_at, running = [], []  # (latency, start, a case then running); the cases started so far
        done = asyncio.Event()

        async def watch():  # /health and tenant B's small greedy completions, all through the abuse
            while not done.is_set():
                t = time.monotonic()
                await h.get("/health", timeout=60)
                health.append(time.monotonic() - t)
                health_at.append((health[-1], t, running[-1] if running else ""))
                t = time.monotonic()
                r = await h.post("/v1/completions", json=greedy, headers=b, timeout=60)
                small.append(time.monotonic() - t)
                if r.status_code != 200 or r.json()["choices"][0]["text"] != reference:
                    small_wrong.append(r.status_code)
                await asyncio.sleep(0.1)
        cases: list[dict] = []

        async def case(name: str, send, ok) -> None:
            running.append(name)
            t = time.monotonic()
            try:
                r = await asyncio.wait_for(send(), 30)
                good, detail = bool(ok(r)), f"{r.status_code} {r.text[:160]}"
            except Exception as e:  # a timeout, a dropped connection: not handled
                good, detail = False, f"{type(e).__name__}: {e}"[:200]
            cases.append({"case": name, "handled": good, "s": round(time.monotonic() - t, 2),
                          **({"detail": detail} if not good or name.startswith(("tenant", "6000")) else {})})

        def error(status: int, *words: str):
            return lambda r: r.status_code == status and all(w in r.text for w in words)

        async def hostile() -> None:
            # poisoned adapters (admin route): refused, promptly; one that overflows only at run time fails alone
            for name, want in (("nan", "NaN or Inf"), ("inf", "NaN or Inf"), ("overflow-at-load", "overflows"),
                               ("huge-rank", "out of range"), ("evil-targets", ""), ("evil-alpha", ""),
                               ("backreference", "not a supported regular expression")):
                await case(f"adapter {name}", lambda n=name: h.post("/v1/load_lora_adapter", headers=admin, json={
                    "lora_name": n, "lora_path": str(adapters[n])}), lambda r, w=want: r.status_code in (200, 400)
                    and (r.status_code == 400 and w in r.text or r.status_code == 200 and w == ""))
            await case("adapter overflow-in-forward loads", lambda: h.post("/v1/load_lora_adapter", headers=admin, json={
                "lora_name": "hot", "lora_path": str(adapters["overflow-in-forward"])}), error(200))

            async def hot_and_base():
                rs = await asyncio.gather(*[h.post("/v1/completions", headers=a, json={**greedy, "model": m})
                                            for m in ("hot", "tiny", "hot")])
                return httpx.Response(200 if rs[1].status_code == 200 and rs[1].json()["choices"][0]["text"] == reference
                                      and all(r.status_code == 500 and "not finite" in r.text for r in (rs[0], rs[2]))
                                      else 599, text=" | ".join(r.text[:80] for r in rs))
            await case("overflowing adapter fails alone, base in its batch right", hot_and_base, error(200))

            # multi-megabyte prompts, two at a time on every route that tokenises
            huge = "ab " * 1_300_000
            for path, body in (("/v1/completions", {"prompt": huge, "max_tokens": 2}),
                               ("/tokenize", {"prompt": huge}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}),
                               ("/v1/messages", {"model": "tiny", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": huge}]})):
                for k in range(2):
                    await case(f"3.9 MB prompt {path} #{k}", lambda p=path, bd=body: h.post(p, json=bd, headers=b),
                               lambda r: r.status_code == 400 and ("context" in r.text or "prompt" in r.text))
            if ocr:
                page = _page_png()
                await case("6000x6000 page /v1/ocr", lambda: h.post("/v1/ocr", headers=b, files={
                    "file": ("page.png", page, "image/png")}), lambda r: r.status_code in (413, 504))

            # one tenant floods: its queue is bounded (429 + Retry-After), the rest of its requests answer right
            async def flood():
                rs = await asyncio.gather(*[h.post("/v1/completions", headers=a, json={
                    "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}) for _ in range(40)])
                codes = [r.status_code for r in rs]
                limited = [r for r in rs if r.status_code == 429]
                good = codes.count(200) + len(limited) == 40 and limited and all("retry-after" in r.headers for r in limited)
                return httpx.Response(200 if good else 599, text=f"{codes.count(200)} x 200, {len(limited)} x 429")
            await case("tenant flood (40 at once, 4 running + 8 waiting allowed)", flood, error(200))

            for c in _fuzz.hand_written_cases():
                headers = {**c.headers, **b}

                async def send(c=c, headers=headers):
                    if c.raw:
                        return await asyncio.to_thread(_fuzz.send_raw, server.url, replace(c, headers=headers))
                    return await h.request(c.method, c.path, content=c.body, headers=headers)

                def ok(r, c=c):
                    try:
                        _fuzz.check_response(r, c.name, c.path)
                    except (AssertionError, ValueError):
                        return False
                    return (c.status is None or r.status_code == c.status) and (c.message is None or c.message in r.text)
                await case(f"fuzz: {c.name}", send, ok)
            r = await h.post("/v1/unload_lora_adapter", headers=admin, json={"lora_name": "hot"})
            assert r.status_code == 200, r.text
        rss_after = []
        for _ in range(passes):  # a second pass shows whether anything kept growing (a leak) or not
            done.clear()
            watcher = asyncio.create_task(watch())
            await hostile()
            done.set()
            await watcher
            deadline = time.monotonic() + 60
            while server.metric("vllm:num_requests_running") and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(3)  # quiet: the idle hook has given the peak's pages back
            rss_after.append(round(server.rss_mib(), 1))
        final = (await h.post("/v1/completions", json=greedy, headers=b)).json()["choices"][0]["text"] == reference
    failed = [c for c in cases if not c["handled"]]
    floods = [c["detail"] for c in cases if c["case"].startswith("tenant")]
    pages = [c["detail"][:120] for c in cases if c["case"].startswith("6000")]
    return {"cases": len(cases), "handled": len(cases) - len(failed), "failed": len(failed), "failures": failed,
            "slowest_case": max(cases, key=lambda c: c["s"]), "tenant_floods": floods, "big_pages": pages,
            "health_during": _p99(health),
            "slowest_health": [{"ms": round(1000 * d), "during": c} for d, _, c in sorted(health_at)[-3:]],
            "small_greedy_during": _p99(small), "small_wrong": small_wrong,
            "rss_before_mib": round(rss_before, 1), "rss_after_each_pass_mib": rss_after,
            "rss_ratio": round(rss_after[-1] / rss_before, 3), "greedy_unchanged_after": final}


ESCAPES = {  # name -> (program, contained(result)): each program is a wrong answer or tries to get out
    "sys.exit(0) after a wrong answer": ("assert 1 + 1 == 3 or True\nimport sys\nsys.exit(0)\nassert False", "fail"),
    "os._exit(0) before the checks": ("import os\nos._exit(0)\nassert False", "fail"),
    "raise SystemExit before the checks": ("raise SystemExit\nassert False", "fail"),
    "kill the parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nassert False", "fail"),
    "read the host /tmp": ("import os\nprint('ESCAPED' if any(n.startswith('glm5-probe-') for n in os.listdir('/tmp')) "
                           "else 'ok')", "out"),
    "connect to a host Unix socket": ("import socket, glob\nfor a in glob.glob('/tmp/glm5-probe-*.sock') + "
                                      "['/tmp/' + 'glm5-probe-%d.sock' % 0]:\n    s = socket.socket(socket.AF_UNIX)\n"
                                      "    try:\n        s.connect(a); print('ESCAPED')\n    except OSError:\n"
                                      "        pass", "out"),
    "network": ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); "
                "print('ESCAPED')\nexcept OSError:\n    pass", "out"),
    "write 12 x 15 MB": ("import os\nn = 0\ntry:\n    for i in range(12):\n"
                         "        with open(('.', '/tmp', '/dev/shm')[i % 3] + f'/f{i}', 'wb') as f:\n"
                         "            n += f.write(b'0' * (15 << 20))\nexcept OSError:\n    pass\n"
                         "print('ESCAPED' if n > 64 << 20 else 'ok')", "out"),
}


def sandbox_escapes() -> dict:
    """Each escape of `ESCAPES` against the eval sandbox, with a host /tmp marker, a world-writable Unix
    socket in the host's /tmp and a listening TCP port on loopback to reach for."""
    import socket

    from glm5.eval.sandbox import Limits, isolation, run_program
    marker = tempfile.NamedTemporaryFile(prefix="glm5-probe-", dir="/tmp")
    sock_path = f"/tmp/glm5-probe-{os.getpid()}.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(sock_path)
    os.chmod(sock_path, 0o777)
    unix.listen(1)
    tcp = socket.create_server(("127.0.0.1", 0))
    rows = []
    try:
        for name, (src, kind) in ESCAPES.items():
            r = run_program(src.replace("{port}", str(tcp.getsockname()[1])), Limits(cpu_s=5, wall_s=10))
            contained = r.status != "pass" if kind == "fail" else r.status == "pass" and "ESCAPED" not in r.stdout
            rows.append({"escape": name, "contained": contained, "status": r.status})
    finally:
        unix.close()
        os.unlink(sock_path)
        tcp.close()
        marker.close()
    return {"isolation": isolation(), "attempts": len(rows), "contained": sum(r["contained"] for r in rows),
            "rows": rows}


def fuzz(args) -> dict:
    from hypothesis import HealthCheck, given, settings

    from glm5.serve.config import ServerConfig
    from tests import _fuzz
    from tests._live import live_server
    rows: dict[str, list[int]] = {}  # kind -> [cases, 2xx, 4xx, 5xx, alive after]

    def record(kind: str, status: int, alive: bool) -> None:
        row = rows.setdefault(kind, [0, 0, 0, 0, 0])
        row[0] += 1
        row[1 if status < 400 else 2 if status < 500 else 3] += 1
        row[4] += alive

    with tempfile.TemporaryDirectory() as tmp, \
            live_server(Path(tmp), max_model_len=256, server=ServerConfig(default_max_tokens=4)) as live:
        c = httpx.Client(base_url=live["url"], timeout=120)

        def alive() -> bool:
            return c.get("/health").status_code == 200

        @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(_fuzz.requests())
        def run(req):
            path, body = req
            r = c.post(path, content=_fuzz.encode(body), headers={"content-type": "application/json"})
            _fuzz.check_response(r, f"{path} {_fuzz.encode(body)[:200]!r}")
            record(f"generated {path}", r.status_code, alive())
        run()
        for case in _fuzz.hand_written_cases():
            r = _fuzz.send_raw(live["url"], case) if case.raw else c.request(
                case.method, case.path, content=case.body, headers=case.headers)
            _fuzz.check_response(r, case.name)
            record("hand-written hostile", r.status_code, alive())
        good = c.post("/v1/completions", json={"prompt": _fuzz_prompt(), "max_tokens": 6, "temperature": 0})
        final_ok = good.status_code == 200 and good.json()["choices"][0]["text"] == live["expected"]
    table = {k: dict(zip(("cases", "2xx", "4xx", "5xx", "alive_after"), v)) for k, v in sorted(rows.items())}
    return {"table": table, "total": sum(v[0] for v in rows.values()), "good_request_after": final_ok}


def _fuzz_prompt() -> str:
    from tests._live import PROMPT as p
    return p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("disconnect")
    d.add_argument("--clients", type=int, default=64)
    d.add_argument("--duration-s", type=float, default=60.0)
    d.add_argument("--model")
    h = sub.add_parser("hugeprompt")
    h.add_argument("--prompt-mb", type=float, default=3.9)
    h.add_argument("--window-s", type=float, default=8.0)
    h.add_argument("--model")
    f = sub.add_parser("fuzz")
    f.add_argument("--cases", type=int, default=2000)
    pr = sub.add_parser("probe")
    pr.add_argument("--ocr", action="store_true", help="also serve the OCR agent and send it a 36 Mpx page")
    pr.add_argument("--passes", type=int, default=2, help="times the hostile set is sent (RSS after each)")
    args = p.parse_args()
    out = {"disconnect": disconnect, "hugeprompt": hugeprompt, "fuzz": fuzz, "probe": probe}[args.cmd](args)
    print(json.dumps({"run": args.cmd, "load_avg_1m": round(os.getloadavg()[0], 1), **out}, indent=2))


if __name__ == "__main__":
    main()
