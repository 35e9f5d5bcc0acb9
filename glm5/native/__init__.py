"""Native CPU kernels for serving: C source shipped in the package (`kernels.c`), compiled on first use
with the system C compiler and loaded through ctypes; every call site falls back to PyTorch when no
compiler is available (`load()` returns None after one warning).

Why not a C++ torch extension: a C file compiles in well under a second without torch's headers, needs no
Python.h and no ABI match with the torch build, and the kernels only need pointers, sizes and OpenMP
(libgomp, the runtime torch itself loads, so both share one thread pool).

The shared library is cached under `$GLM5_NATIVE_CACHE` (default `$XDG_CACHE_HOME/glm5/native`, i.e.
`~/.cache/glm5/native`) by a hash of the source, the compiler, its flags and this CPU's feature flags;
a different machine or compiler builds its own. The compiler is `$CC` or `cc`.

Kernels (each tested against its PyTorch reference in tests/test_native.py):
  * `NativeKernels.moe`: one routed-expert MoE layer (glm5.model.moe.grouped_experts),
  * `NativeKernels.latent_decode`: dense absorbed-MLA attention (glm5.model.latent_attention),
  * `NativeKernels.mla_decode`: the same from the un-absorbed query, W_uk and W_uv included (MLAttention's
    absorbed path: absorb_q, dense_latent_attention, latent_to_heads),
  * `NativeKernels.gqa_decode`: grouped-query attention of a decode-sized group over the paged [k | v] cache
    rows (GQAttention's `_attend_group`, glm5.model.gqa_attention),
  * `NativeKernels.linear`: a few rows through an [in, out]-stored linear layer (torch.nn.functional.linear),
  * `NativeKernels.rms_norm`: RMSNorm's fp32 forward (glm5.model.layers.RMSNorm),
  * `NativeKernels.rope`: the rotary embedding (glm5.model.layers.apply_rope), and `rope_heads_` the same
    in place on head rows (half-split, partial rotary: GQAttention's `_rotate`),
  * `NativeKernels.linear_int8`: the weight-only int8 product for a few rows (glm5.infer.quant.Int8Linear),
  * `NativeKernels.swiglu`: a SwiGLU MLP / shared expert for a few rows (glm5.model.layers.SwiGLU),
  * `NativeKernels.route`: the MoE router (glm5.model.moe.Router),
  * `NativeKernels.decode_layer`: a whole decoder layer for decode steps, built from the kernels above
    (glm5.model.model.DecoderLayer over a paged step; glm5.infer.kernels.NativeLayerKernel).

`glm5.native.ops` declares each of them (but `decode_layer`) as a typed PyTorch operator,
`torch.ops.glm5_native.<name>`, which is how the engine's modules call them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = "kernels.c"
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])  # first that builds wins
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {  # kernels.c's entry points: (argument types, result type)
    "glm5_moe": ([_P, _L, _I, _P, _P, _I, _I, _I, _P, _L, _P, _L, _P, _I], _I),
    "glm5_latent_decode": ([_P, _L, _L, _I, _I, _P, _L, _P, _L, _P, _P, _I, _F, _P, _I], _I),
    "glm5_mla_decode": ([_P, _L, _L, _P, _P, _I, _I, _I, _L, _L, _I, _P, _L, _P, _L, _P, _P, _I, _F, _P, _I], _I),
    "glm5_gqa_decode": ([_P, _L, _L, _I, _I, _I, _P, _L, _P, _L, _P, _P, _F, _P, _I], _I),
    "glm5_gqa_prefill": ([_P, _L, _L, _I, _I, _I, _P, _L, _P, _F, _P, _I], _I),
    "glm5_linear": ([_P, _L, _I, _I, _P, _L, _I, _P, _P], None),
    "glm5_rope": ([_P, _L, _P, _P, _P, _L, _I, _I, _I], None),
    "glm5_rope_heads": ([_P, _L, _L, _P, _P, _L, _I, _I], None),
    "glm5_rms_norm": ([_P, _L, _P, _P, _L, _I, _F], None),
    "glm5_linear_int8": ([_P, _L, _I, _I, _P, _P, _I, _P, _P], None),
    "glm5_swiglu": ([_P, _L, _I, _I, _I, _P, _P, _P, _P, _I], _I),
    "glm5_route": ([_P, _L, _L, _I, _P, _P, _I, _I, _F, _I, _I, _I, _I, _F, _P, _P, _P, _P, _I], _I),
    "glm5_layer_layout": ([_P, _P, _L, _P, _P], ctypes.c_char_p),
    "glm5_gemm_width": ([], _I),
    "glm5_decode_layer": ([_P, _P, _L, _P, _P, _P, _P, _L, _P, _L, _L, _P, _L, _P, _P, _P, _P, _L, _I, _P, _P, _P, _P,
                           _I], _I),
}


class LayerSpec(ctypes.Structure):
    """kernels.c's `layer_t`: one decoder layer's sizes, options and weight pointers for
    `NativeKernels.decode_layer` (filled by glm5.infer.kernels.NativeLayerKernel)."""

    _fields_ = ([(n, _I) for n in ("D", "QR", "H", "E", "P", "V", "R", "ID", "IP", "rope_interleave",
                                   "index_interleave", "FI", "NE", "A", "EI", "SI", "n_group", "topk_group",
                                   "softmax_scores", "norm_topk")]
                + [(n, _F) for n in ("eps_in", "eps_q", "eps_kv", "eps_post", "eps_ik", "temperature", "scaling",
                                     "scale")]
                + [(n, _P) for n in ("ln_in", "wqa", "bqa", "ln_q", "wqb", "wkva", "bkva", "ln_kv", "kvb", "wo", "bo",
                                     "wk", "ik_w", "ik_b", "ln_post", "wg", "wu", "wd", "wr", "rbias", "gu", "dn")]
                + [("gu_es", _L), ("dn_es", _L), ("NI", _I), ("wqi", _P), ("wwp", _P)]
                + [(n, _P) for n in ("s_qa", "s_qb", "s_kva", "s_o", "s_g", "s_u", "s_d", "s_gu", "s_dn")])


def check_layout(lib: ctypes.CDLL, spec: type[ctypes.Structure]) -> None:
    """The ctypes mirror `spec` must lay out kernels.c's `layer_t` byte for byte (the C side reports each
    field's name, offset and size, and the struct's size): NativeError naming the first difference."""
    cap = 256
    offs, sizes = (ctypes.c_long * cap)(), (ctypes.c_long * cap)()
    count, total = ctypes.c_long(), ctypes.c_long()
    names = lib.glm5_layer_layout(offs, sizes, cap, ctypes.byref(count), ctypes.byref(total)).decode().split()
    c_fields = {n: (offs[i], sizes[i]) for i, n in enumerate(names[: count.value])}
    py_fields = {name: (getattr(spec, name).offset, getattr(spec, name).size) for name, _ in spec._fields_}
    for name in sorted(c_fields.keys() | py_fields.keys(), key=lambda n: c_fields.get(n, py_fields.get(n))):
        c, py = c_fields.get(name), py_fields.get(name)
        if c != py:
            raise NativeError(f"{spec.__name__} does not match kernels.c's layer_t at field {name!r}: C (offset, "
                              f"size) {c}, ctypes {py}")
    if ctypes.sizeof(spec) != total.value:
        raise NativeError(f"{spec.__name__} is {ctypes.sizeof(spec)} bytes, kernels.c's layer_t {total.value} "
                          "(a field of layer_t is missing from its LAYER_FIELDS list or from the mirror)")


class NativeError(RuntimeError):
    """A kernel refused its inputs (the message says which) or ran out of memory."""


def cache_dir() -> Path:
    if os.environ.get("GLM5_NATIVE_CACHE"):
        return Path(os.environ["GLM5_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "glm5" / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def build(source: bytes, out_dir: Path | None = None) -> Path:
    """Compile `source` into a shared library (cached) -> its path. Raises NativeError with the compiler's
    message when no flag set builds it."""
    cc = _compiler()
    if cc is None:
        raise NativeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not on PATH; set CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeError(f"{cc} --version failed: {e}") from e
    out_dir = out_dir or cache_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        out_dir = Path(tempfile.mkdtemp(prefix="glm5-native-"))
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(),
                                         _cpu_flags().encode()])).hexdigest()[:16]
        lib = out_dir / f"glm5_kernels_{key}.so"
        if lib.exists():
            return lib
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = Path(tmp) / SOURCE
            src.write_bytes(source)
            so = Path(tmp) / "k.so"
            try:
                r = subprocess.run([cc, *flags, "-shared", "-fPIC", str(src), "-o", str(so), "-lm"],
                                   capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{' '.join(flags)}: {e}")
                continue
            if r.returncode == 0:
                os.replace(so, lib)  # atomic: concurrent builders each write their own temporary file
                return lib
            errors.append(f"{' '.join(flags)}: {r.stderr.strip()[-500:]}")
    raise NativeError(f"compiling {SOURCE} with {cc} failed: " + " | ".join(errors))


class NativeKernels:
    """Typed wrappers around the compiled kernels. Inputs are checked (dtype, device, layout) and a
    refusal raises ValueError; the kernels never see a tensor they would misread."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, result
        check_layout(self.lib, LayerSpec)
        # columns per register tile of the kernels' GEMM as compiled for this CPU: 32 with AVX-512, else 16
        self.gemm_width: int = self.lib.glm5_gemm_width()

    # The modules that call the kernels hold this object, and models get copied (`copy.deepcopy`) and pickled
    # (`torch.save`): a copy shares the loaded library (it has no state of its own), a pickle keeps its path.
    def __deepcopy__(self, memo) -> "NativeKernels":
        return self

    def __reduce__(self):
        return (NativeKernels, (self.path,))

    def moe(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """Routed experts for x [N, H] fp32, idx [N, A] expert ids, weights [N, A] (0 = dropped): gate_up
        [E, H, 2I] (gate columns first) and down [E, I, H], each expert's matrix row-major ([in, out], i.e.
        the transposed storage of glm5/infer/layout.py) -> [N, H]. Same sums as `grouped_experts`."""
        N, H = x.shape
        E, _, I2 = gate_up.shape
        inter = I2 // 2
        _check(x, "x", (N, H))
        _check(gate_up, "gate_up", (E, H, 2 * inter), inner=True)
        _check(down, "down", (E, inter, H), inner=True)
        idx = idx.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        A = idx.shape[1]
        if idx.shape != (N, A) or weights.shape != (N, A):
            raise ValueError(f"idx {list(idx.shape)} and weights {list(weights.shape)} must both be [{N}, A]")
        out = torch.empty_like(x)
        rc = self.lib.glm5_moe(x.data_ptr(), N, H, idx.data_ptr(), weights.data_ptr(), A, E, inter,
                               gate_up.data_ptr(), gate_up.stride(0), down.data_ptr(), down.stride(0),
                               out.data_ptr(), threads or torch.get_num_threads())
        _raise(rc, f"expert ids outside [0, {E})", f"more than 64 experts per token ({A})")
        return out

    def latent_decode(self, qq: torch.Tensor, latent: torch.Tensor, key_slots: torch.Tensor, bias: torch.Tensor,
                      kv_rank: int, scale: float, key_lens: list[int] | None = None,
                      threads: int | None = None) -> torch.Tensor:
        """`dense_latent_attention`'s contract: qq [B, T, H, W], latent [rows, W], key_slots [B, S] row of
        each key, bias [B, T, S] additive mask (-inf: not allowed; those rows are not read), key_lens keys
        of each sequence (None: S) -> [B, T, H, R]. One pass over each key row for the scores, one for the
        output, per query row; a query row with no allowed key gets zeros."""
        B, T, H, W = qq.shape
        S = key_slots.shape[1]
        qq, bias = qq.contiguous(), bias.contiguous()
        _check(qq, "qq", (B, T, H, W))
        _check(latent, "latent", (latent.shape[0], W))
        _check(bias, "bias", (B, T, S))
        if not 0 < kv_rank <= W:
            raise ValueError(f"kv_rank {kv_rank} must be in (0, {W}]")
        slots, lens = key_table(key_slots, key_lens, B)
        out = qq.new_empty(B, T, H, kv_rank)
        rc = self.lib.glm5_latent_decode(qq.data_ptr(), B, T, H, W, latent.data_ptr(), latent.shape[0],
                                         slots.data_ptr(), S, bias.data_ptr(), lens.data_ptr(), kv_rank, scale,
                                         out.data_ptr(), threads or torch.get_num_threads())
        _raise(rc, _KEYS_REFUSED.format(rows=latent.shape[0], S=S))
        return out

    def mla_decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_b: torch.Tensor, latent: torch.Tensor,
                   key_slots: torch.Tensor, bias: torch.Tensor, scale: float, key_lens: list[int] | None = None,
                   threads: int | None = None) -> torch.Tensor:
        """Absorbed MLA from the un-absorbed query: q_nope [B, T, H, E], q_rope [B, T, H, P] (rotated), kv_b
        the kv_b_proj weight [H*(E+V), R] (per head: W_uk's E rows, then W_uv's V rows), latent [rows, R+P]
        and the rest as `latent_decode` -> [B, T, H, V], i.e. `latent_to_heads(dense_latent_attention(
        cat(absorb_q(q_nope), q_rope), ...))` in one call per group."""
        B, T, H, E = q_nope.shape
        P, R = q_rope.shape[-1], kv_b.shape[-1]
        V = kv_b.shape[0] // H - E
        S = key_slots.shape[1]
        _check(kv_b, "kv_b", (H * (E + V), R))
        _check(latent, "latent", (latent.shape[0], R + P))
        q_rope, bias = q_rope.contiguous(), bias.contiguous()
        _check(q_rope, "q_rope", (B, T, H, P))
        _check(bias, "bias", (B, T, S))
        if q_nope.dtype != torch.float32 or q_nope.device.type != "cpu":
            raise ValueError(f"q_nope: native kernels take float32 CPU tensors, got {q_nope.dtype} on {q_nope.device}")
        qn = q_nope.reshape(B * T, H, E)  # a view when the rows are evenly spaced
        if qn.stride(-1) != 1:
            qn = qn.contiguous()
        slots, lens = key_table(key_slots, key_lens, B)
        out = q_rope.new_empty(B, T, H, V)
        rc = self.lib.glm5_mla_decode(qn.data_ptr(), qn.stride(0), qn.stride(1), q_rope.data_ptr(), kv_b.data_ptr(),
                                      E, V, P, B, T, H, latent.data_ptr(), latent.shape[0], slots.data_ptr(), S,
                                      bias.data_ptr(), lens.data_ptr(), R, scale, out.data_ptr(),
                                      threads or torch.get_num_threads())
        _raise(rc, _KEYS_REFUSED.format(rows=latent.shape[0], S=S))
        return out

    def gqa_decode(self, q: torch.Tensor, cache: torch.Tensor, num_kv_heads: int, key_slots: torch.Tensor,
                   bias: torch.Tensor, scale: float, key_lens: list[int] | None = None,
                   threads: int | None = None) -> torch.Tensor:
        """GQAttention's attention of one group: q [B, T, H, D] (head h reads key/value head h // (H / G)),
        cache [rows, 2 * G * D] (per row G key heads, then G value heads), key_slots / bias / key_lens as
        `latent_decode` -> [B, T, H, D] = softmax(q k^T * scale + bias) v per head; keys with bias -inf are
        not read, a query row with no allowed key gets zeros."""
        B, T, H, D = q.shape
        G, S = num_kv_heads, key_slots.shape[1]
        if G <= 0 or H % G:
            raise ValueError(f"{H} query heads are not a multiple of {G} key/value heads")
        q, bias = q.contiguous(), bias.contiguous()
        _check(q, "q", (B, T, H, D))
        _check(cache, "cache", (cache.shape[0], 2 * G * D))
        _check(bias, "bias", (B, T, S))
        slots, lens = key_table(key_slots, key_lens, B)
        out = q.new_empty(B, T, H, D)
        rc = self.lib.glm5_gqa_decode(q.data_ptr(), B, T, H, G, D, cache.data_ptr(), cache.shape[0], slots.data_ptr(),
                                      S, bias.data_ptr(), lens.data_ptr(), scale, out.data_ptr(),
                                      threads or torch.get_num_threads())
        _raise(rc, _KEYS_REFUSED.format(rows=cache.shape[0], S=S), f"{H} query heads over {G} key/value heads")
        return out

    def gqa_prefill(self, q: torch.Tensor, cache: torch.Tensor, num_kv_heads: int, key_slots: torch.Tensor,
                    scale: float, threads: int | None = None) -> torch.Tensor:
        """GQAttention's attention of a sequence's first chunk: q [T, H, D] (rows evenly spaced, each row's
        heads contiguous) of queries 0..T-1 over the keys 0..T-1 in cache rows key_slots [T] (cache as
        `gqa_decode`), query t seeing keys 0..t -> [T, H, D] = softmax(q k^T * scale) v per head."""
        T, H, D = q.shape
        G = num_kv_heads
        if G <= 0 or H % G:
            raise ValueError(f"{H} query heads are not a multiple of {G} key/value heads")
        if T and not q[0].is_contiguous():  # each query row's heads must be contiguous; rows may be apart
            q = q.contiguous()
        _check(q, "q", (T, H, D), inner=True)
        _check(cache, "cache", (cache.shape[0], 2 * G * D))
        slots = key_slots.to(torch.int64).contiguous()
        if slots.shape != (T,):
            raise ValueError(f"key_slots {list(slots.shape)} must be [{T}]: one key per query")
        out = q.new_empty(T, H, D)
        rc = self.lib.glm5_gqa_prefill(q.data_ptr(), q.stride(0), T, H, G, D, cache.data_ptr(), cache.shape[0],
                                       slots.data_ptr(), scale, out.data_ptr(), threads or torch.get_num_threads())
        _raise(rc, f"key slots outside [0, {cache.shape[0]})", f"{H} query heads over {G} key/value heads")
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               ld: int | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for fp32 CPU x [..., in] with evenly spaced rows (`ld` apart: given by
        a caller that already has `rows_stride(x)`) and a weight [out, in] stored [in, out] row-major (the
        engine's CPU layout) -> a contiguous [..., out]. Meant for a few rows (decode); the caller
        (`NativeLinear`) checked dtype and device."""
        N, K = weight.shape
        ld = ld if ld is not None else rows_stride(x)
        if x.shape[-1] != K or ld is None or weight.stride() != (1, N):
            raise ValueError(f"linear: x {list(x.shape)} / weight {list(weight.shape)} {weight.stride()} not supported")
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
        self.lib.glm5_linear(x.data_ptr(), ld, x.numel() // K, K, weight.data_ptr(), N, N,
                     None if bias is None else bias.data_ptr(), out.data_ptr())
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
        """`apply_rope` (glm5.model.layers) for an fp32 CPU x [..., T, P] or [..., T, H, P] with evenly spaced
        rows (e.g. the rope slice of a projection) and contiguous cos / sin holding one [P/2] row per token
        (broadcast over heads) -> a contiguous tensor of x's shape."""
        P = x.shape[-1]
        N = cos.numel() // max(P // 2, 1)
        ld = rows_stride(x)
        if not (x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu" and P % 2 == 0
                and cos.shape[-1] == P // 2 and sin.shape == cos.shape and cos.is_contiguous() and sin.is_contiguous()
                and N > 0 and x.numel() % (N * P) == 0 and ld is not None):
            raise ValueError(f"rope: unsupported x {list(x.shape)} {x.dtype} / cos {list(cos.shape)} {cos.dtype}")
        out = torch.empty(x.shape, dtype=x.dtype)
        self.lib.glm5_rope(x.data_ptr(), ld, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), N, x.numel() // (N * P), P,
                   int(interleave))
        return out

    def rope_heads_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """In place: the first `rotary_dim` values of each head of an fp32 CPU x [B, T, H, D] (any token and
        head strides, last dim contiguous) rotated as `apply_rope(x[..., :rotary_dim], cos, sin, False)`
        (half-split pairs), the rest left as they are; cos / sin contiguous [B, T, rotary_dim / 2]. Returns x."""
        B, T, H, D = x.shape
        half = rotary_dim // 2
        ok = (x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu" and rotary_dim % 2 == 0
              and 0 < rotary_dim <= D and x.stride(-1) == 1 and (B == 1 or x.stride(0) == T * x.stride(1))
              and tuple(cos.shape) == (B, T, half) and sin.shape == cos.shape and cos.is_contiguous()
              and sin.is_contiguous())
        if not ok:
            raise ValueError(f"rope_heads_: unsupported x {list(x.shape)} {x.stride()} {x.dtype} / cos {list(cos.shape)}")
        self.lib.glm5_rope_heads(x.data_ptr(), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(), B * T, H,
                                 rotary_dim)
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, ld: int | None = None) -> torch.Tensor:
        """RMSNorm over the last dim of an fp32 CPU x whose rows are evenly spaced (contiguous, or a column
        slice of a wider tensor; `ld` apart when the caller already has `rows_stride(x)`) with an fp32
        weight [D] (`RMSNorm`'s fp32 forward) -> a contiguous tensor. Lean on purpose: called ~30 times per
        decode token; the caller (`NativeRMSNorm`) checked dtype and device."""
        D = weight.shape[0]
        if x.shape[-1] != D:
            raise ValueError(f"x's last dim {x.shape[-1]} != weight's {D}")
        ld = ld if ld is not None else rows_stride(x)
        if ld is None:
            raise ValueError("x: rows must be evenly spaced with a contiguous last dim")
        out = torch.empty(x.shape, dtype=x.dtype)
        self.lib.glm5_rms_norm(x.data_ptr(), ld, weight.data_ptr(), out.data_ptr(), x.numel() // D, D, eps)
        return out

    def linear_int8(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """`Int8Linear`'s product for fp32 CPU x [..., in] with evenly spaced rows: weight int8 [out, in]
        row-major, scale fp32 [out], bias fp32 [out] or None -> a contiguous [..., out] = (x @ weight^T) *
        scale + bias. Reads each weight row once per input row: meant for a few rows (decode)."""
        N, K = weight.shape
        ld = rows_stride(x)
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != K or ld is None
                or weight.dtype != torch.int8 or not weight.is_contiguous() or scale.dtype != torch.float32
                or tuple(scale.shape) != (N,) or not scale.is_contiguous()
                or (bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (N,)
                                          or not bias.is_contiguous()))):
            raise ValueError(f"linear_int8: x {list(x.shape)} {x.dtype} / weight {list(weight.shape)} {weight.dtype} "
                             "not supported")
        out = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
        self.lib.glm5_linear_int8(x.data_ptr(), ld, x.numel() // K, K, weight.data_ptr(), scale.data_ptr(), N,
                                  None if bias is None else bias.data_ptr(), out.data_ptr())
        return out

    def swiglu(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               threads: int | None = None) -> torch.Tensor:
        """`SwiGLU` (down(silu(gate(x)) * up(x))) for fp32 CPU x [..., D] with evenly spaced rows and the
        three nn.Linear weights gate / up [F, D], down [D, F], each stored [in, out] row-major (the engine's
        CPU layout) -> a contiguous [..., D]."""
        F_, D = gate.shape
        ld = rows_stride(x)
        ok = (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == D and ld is not None
              and tuple(up.shape) == (F_, D) and tuple(down.shape) == (D, F_)
              and all(w.dtype == torch.float32 and w.device.type == "cpu" and w.stride() == (1, w.shape[0])
                      for w in (gate, up, down)))
        if not ok:
            raise ValueError(f"swiglu: x {list(x.shape)} {x.dtype} / gate {list(gate.shape)} {gate.stride()} "
                             "not supported")
        out = torch.empty(*x.shape[:-1], D, dtype=torch.float32)
        rc = self.lib.glm5_swiglu(x.data_ptr(), ld, x.numel() // D, D, F_, gate.data_ptr(), up.data_ptr(),
                                  down.data_ptr(), out.data_ptr(), threads or torch.get_num_threads())
        _raise(rc)
        return out

    def route(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, temperature: float,
              softmax: bool, n_group: int, topk_group: int, norm_topk: bool, scaling: float,
              threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`Router.forward` for fp32 CPU x [N, D] with evenly spaced rows, router weight [E, D] and correction
        bias [E] (fp32, contiguous) -> (logits [N, E], scores [N, E], weights [N, A], idx [N, A] int64; the
        chosen experts best first)."""
        N, D = x.shape
        E = weight.shape[0]
        ld = rows_stride(x)
        if ld is None or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"route: x {list(x.shape)} {x.dtype} not supported")
        _check(weight, "weight", (E, D))
        _check(bias, "bias", (E,))
        logits, scores = x.new_empty(N, E), x.new_empty(N, E)
        weights, idx = x.new_empty(N, top_k), torch.empty(N, top_k, dtype=torch.int64)
        rc = self.lib.glm5_route(x.data_ptr(), ld, N, D, weight.data_ptr(), bias.data_ptr(), E, top_k, temperature,
                                 int(softmax), n_group, topk_group, int(norm_topk), scaling, logits.data_ptr(),
                                 scores.data_ptr(), idx.data_ptr(), weights.data_ptr(),
                                 threads or torch.get_num_threads())
        _raise(rc, f"{n_group} expert groups of {E} experts keeping {topk_group} cannot choose {top_k}",
               f"more than 1024 experts or top_k {top_k} > {E}")
        return logits, scores, weights, idx

    def decode_layer(self, spec: LayerSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slot_mapping: torch.Tensor, latent: torch.Tensor, index_k: torch.Tensor | None,
                     key_slots: torch.Tensor, bias: torch.Tensor, lens: torch.Tensor, T: int, topk: int = 0,
                     sel_in: torch.Tensor | None = None, attn_only: bool = False, threads: int | None = None):
        """A whole decoder layer (`DecoderLayer.forward` over a paged step) for the N rows of x [N, D] (items
        b * T + t of B = N / T sequences): cos / sin [N, P/2] the rows' RoPE angles; this step's cache rows
        written to latent [rows, R+P] (and index_k [rows, ID] when the spec has an indexer key) at
        slot_mapping [N]; attention over key_slots [B, S] / bias [B, T, S] / lens [B] (int64; see
        `latent_decode`), restricted when topk > 0 to a top-k selection of keys per row: `sel_in` [N, topk]
        (key indices, -1 = none; a "shared" indexer layer) or the layer's own (DSA indexer). attn_only: out is
        x + attention (the MLP left to the caller; no router outputs). The caller
        (NativeLayerKernel) built `spec` from the layer and checked dtypes, layouts and shapes; the kernel
        checks the slots and selections. -> (out [N, D], stats [N, 2, NE] router logits / scores, idx [N, A],
        counts [NE], sel [N, topk]); the MoE entries are None for a dense layer, sel None without topk."""
        N = x.shape[0]
        S = key_slots.shape[1]
        out = torch.empty_like(x)
        moe = spec.NE > 0 and not attn_only
        stats = torch.empty(N, 2, spec.NE) if moe else None
        idx = torch.empty(N, spec.A, dtype=torch.int64) if moe else None
        counts = torch.zeros(spec.NE, dtype=torch.int64) if moe else None
        sel_out = torch.empty(N, topk, dtype=torch.int64) if topk and sel_in is None else None
        if sel_in is not None and (sel_in.shape != (N, topk) or sel_in.dtype != torch.int64 or not sel_in.is_contiguous()):
            raise ValueError(f"sel_in must be a contiguous int64 [{N}, {topk}], got {list(sel_in.shape)} {sel_in.dtype}")
        rc = self.lib.glm5_decode_layer(ctypes.byref(spec), x.data_ptr(), N, cos.data_ptr(), sin.data_ptr(),
                                        slot_mapping.data_ptr(), latent.data_ptr(), latent.shape[0],
                                        None if index_k is None else index_k.data_ptr(), N // T, T,
                                        key_slots.data_ptr(), S, bias.data_ptr(), lens.data_ptr(),
                                        None if sel_in is None else sel_in.data_ptr(),
                                        None if sel_out is None else sel_out.data_ptr(), topk, int(attn_only),
                                        out.data_ptr(),
                                        None if stats is None else stats.data_ptr(),
                                        None if idx is None else idx.data_ptr(),
                                        None if counts is None else counts.data_ptr(), threads or torch.get_num_threads())
        if rc:
            _raise(rc, _KEYS_REFUSED.format(rows=latent.shape[0], S=S) + ", or a selection outside the keys",
                   "more than 1024 experts or 64 per token")
        return out, stats, idx, counts, sel_in if sel_in is not None else sel_out


def rows_stride(x: torch.Tensor) -> int | None:
    """The distance between consecutive rows of x [..., D] viewed as [rows, D] without a copy, or None."""
    if x.dim() > 0 and x.is_contiguous():
        return x.shape[-1]
    if x.dim() == 0 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return None
    lead = [(n, st) for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n > 1]  # size-1 dims do not matter
    if not lead:
        return x.shape[-1]  # one row
    for (_, outer), (n, inner) in zip(lead, lead[1:]):
        if outer != inner * n:
            return None
    ld = lead[-1][1]
    return ld if ld >= x.shape[-1] else None


_KEYS_REFUSED = "a key slot outside [0, {rows}) or a key length outside [0, {S}]"


def key_table(key_slots: torch.Tensor, key_lens: list[int] | None, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernels' key tables (`latent_decode`, `mla_decode`, `gqa_decode`, `decode_layer`): slots [B, S] int64 contiguous, lens [B] int64 (None: S each)."""
    S = key_slots.shape[1]
    slots = key_slots.to(torch.int64).contiguous()
    lens = torch.tensor(key_lens if key_lens is not None else [S] * B, dtype=torch.int64)
    if slots.shape != (B, S) or lens.shape != (B,):
        raise ValueError(f"key_slots {list(slots.shape)} / key_lens {list(lens.shape)} do not match {B} sequences")
    return slots, lens


def _check(t: torch.Tensor, name: str, shape: tuple, inner: bool = False) -> None:
    """fp32 CPU tensor of `shape`; contiguous (inner=True: each [i] matrix contiguous, stride(0) free)."""
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: native kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {list(t.shape)} != {list(shape)}")
    ok = t[0].is_contiguous() if inner and t.shape[0] else t.is_contiguous()
    if not ok:
        raise ValueError(f"{name}: must be {'row-major per matrix' if inner else 'contiguous'}")


def _raise(rc: int, *why: str) -> None:
    if rc == 1:
        raise MemoryError("native kernel: out of memory")
    if rc >= 2:
        raise NativeError(f"native kernel refused its inputs: {why[rc - 2]}")


@functools.cache
def load() -> NativeKernels | None:
    """The compiled kernels, built on first call; None (and one warning) when they cannot be built here."""
    try:
        source = resources.files(__package__).joinpath(SOURCE).read_bytes()
        return NativeKernels(build(source))
    except (NativeError, OSError) as e:
        log.warning("native CPU kernels unavailable, using PyTorch kernels: %s", e)
        return None
