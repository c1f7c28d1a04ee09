"""Test support (not a test module): NumPy references of the vision tower's kernels (templates/kernels/vis_*.cu.j2,
thorgen/vision.cuh), float64 rounded where the kernels store, and their stand-ins for the fake CUDA driver
(`VisionKernels`, mixed into tests/emulated_kernels.KernelEmulator). Tolerances against the CUDA kernels sit next
to each reference."""

from __future__ import annotations

import numpy as np

import reference_kernels as RK
from matmul_reference import gelu_tanh
from thorgen.model_spec.nvfp4 import bf16_to_f32
from thorgen.runtime.backend import PIXEL_UNIT

F64 = np.float64

# fp32 row math against float64, then an f16 / bf16 store: one rounding of the stored type, plus fp32 sums.
TOL_VIS_ROWS = 2e-3  # relative (norm_err) for f16 / bf16 outputs; the residual x: 1e-5
TOL_VIS_RESID = 1e-5
TOL_VIS_ROPE = 8e-3  # bf16 q / k / v (8 mantissa bits) after fp32 norm and double-precision angles


def _pad(y: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros(y.shape[:-1] + (width,), F64)
    out[..., : y.shape[-1]] = y
    return out


def patch_prep_ref(p: np.ndarray) -> np.ndarray:
    """2 * (v / 255 - 0.5) as f16 for uint8 pixels v (v / 255 as the processor's float32 [0, 1] pixel)."""
    return RK.store(2.0 * (PIXEL_UNIT[np.asarray(p, np.uint8)] - np.float32(0.5)), "f16")


def embed_norm_ref(
    x: np.ndarray, table_bf16: np.ndarray, pos: np.ndarray, w_bf16: np.ndarray, eps: float, hp: int
) -> tuple[np.ndarray, np.ndarray]:
    """(x + table[0][pos x] + table[1][pos y] as f32, rmsnorm(that) * w padded to hp as f16)."""
    t = bf16_to_f32(table_bf16).astype(F64)
    s = RK.store(np.asarray(x, F64) + (t[0][pos[:, 0]] + t[1][pos[:, 1]]), "f32")
    return s, RK.store(_pad(RK.rms(s, bf16_to_f32(w_bf16), eps), hp), "f16")


def sandwich_ref(
    x: np.ndarray, y: np.ndarray, w_post_bf16: np.ndarray, w_next_bf16: np.ndarray | None, eps: float, hp: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """(x + rmsnorm(y) * w_post as f32, rmsnorm(x') * w_next padded as f16, or None without w_next)."""
    s = RK.store(np.asarray(x, F64) + RK.rms(y, bf16_to_f32(w_post_bf16), eps), "f32")
    if w_next_bf16 is None:
        return s, None
    return s, RK.store(_pad(RK.rms(s, bf16_to_f32(w_next_bf16), eps), hp), "f16")


def rope2d(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """[T, heads, D]: channels [0, D/2) rotate by pos x, [D/2, D) by pos y; rotate_half pairs (i, i + D/4) of each
    half at inv_freq_j = theta^(-2j / (D/2)), float64 angles, float32 cos/sin (as the kernel)."""
    D = x.shape[-1]
    q4 = D // 4
    inv = 1.0 / theta ** (2 * np.arange(q4) / (D // 2))
    out = np.empty_like(np.asarray(x, F64))
    for half in range(2):
        ang = pos[:, half].astype(F64)[:, None] * inv[None, :]
        c = np.cos(ang).astype(np.float32).astype(F64)[:, None, :]
        s = np.sin(ang).astype(np.float32).astype(F64)[:, None, :]
        a = x[..., half * 2 * q4 : half * 2 * q4 + q4]
        b = x[..., half * 2 * q4 + q4 : (half + 1) * 2 * q4]
        out[..., half * 2 * q4 : half * 2 * q4 + q4] = a * c - b * s
        out[..., half * 2 * q4 + q4 : (half + 1) * 2 * q4] = b * c + a * s
    return out


def qkv_rope_ref(
    qkv: np.ndarray,
    qw_bf16: np.ndarray,
    kw_bf16: np.ndarray,
    pos: np.ndarray,
    heads: int,
    d: int,
    dp: int,
    theta: float,
    eps: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q|k|v f32 [T, 3 * heads * d] -> q, k, v bf16 bits [T, heads, dp] (zero channels past d)."""
    T = qkv.shape[0]
    q, k, v = (np.asarray(qkv, F64).reshape(T, 3, heads, d)[:, i] for i in range(3))
    q = rope2d(RK.rms(q, bf16_to_f32(qw_bf16), eps), pos, theta)
    k = rope2d(RK.rms(k, bf16_to_f32(kw_bf16), eps), pos, theta)
    v = RK.rms(v, None, eps)
    return tuple(RK.store(_pad(t, dp), "bf16") for t in (q, k, v))


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Every query attends every key, scale 1 (float32 values of q / k / v [L, heads, D]) -> f16 [L, heads, D]."""
    qf, kf, vf = (np.asarray(t, F64).transpose(1, 0, 2) for t in (q, k, v))
    s = qf @ kf.transpose(0, 2, 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ vf
    return RK.store(o.transpose(1, 0, 2), "f16")


TOL_VIS_ATTN = 1e-2  # bf16 probabilities into the P V product (as the target's prefill attention)


def pool_ref(
    x: np.ndarray, pos: np.ndarray, std_bias: np.ndarray, std_scale: np.ndarray, pool: int, eps: float, hp: int
) -> np.ndarray:
    """x f32 [L, H] over a row-major patch grid -> f16 [L / pool^2, hp]: mean of each pool x pool cell (row-major
    over the pooled grid), x sqrt(H), (s - std_bias) * std_scale, weightless RMSNorm (float64)."""
    L, H = x.shape
    gw = int(pos[-1, 0]) + 1
    gh = L // gw
    cells = np.asarray(x, F64).reshape(gh // pool, pool, gw // pool, pool, H).mean(axis=(1, 3)).reshape(-1, H)
    s = (cells * np.sqrt(np.float32(H)).astype(F64) - std_bias) * std_scale
    return RK.store(_pad(RK.rms(s, None, eps), hp), "f16")


def half_gemm_ref(x: np.ndarray, w: np.ndarray, epi: str) -> np.ndarray:
    """x f16 [m, K] . w [N, K] (float64 values): f32, or gelu_tanh(gate) * up (8-row interleaved) as f16."""
    y = np.asarray(x, F64) @ np.asarray(w, F64).T
    if epi == "store":
        return RK.store(y, "f32")
    n = y.shape[1]
    t = y.reshape(y.shape[0], n // 16, 2, 8)
    g, u = t[:, :, 0].reshape(y.shape[0], -1), t[:, :, 1].reshape(y.shape[0], -1)
    act = gelu_tanh(g) * u if epi == "gelu_mul" else g / (1.0 + np.exp(-g)) * u
    return RK.store(act, "f16")


class VisionKernels:
    """The vision kernels' stand-ins (KernelEmulator's `v` reads and writes the fake device memory)."""

    def k_vis_patch_prep(self, p, a, n):
        T, PD = a["T"], p["PD"]
        self.v(a["out"], np.float16, (T, PD), "out")[:] = patch_prep_ref(self.v(a["p"], np.uint8, (T, PD), "p"))

    def k_vis_embed_norm(self, p, a, n):
        T, H, HP = a["T"], p["H"], p["HP"]
        pos = self.v(a["pos"], np.int32, (T, 2), "pos")
        if (pos < 0).any() or (pos >= p["P"]).any():
            from emulated_kernels import EmuError

            raise EmuError(f"patch positions outside the {p['P']}-entry table")
        x = self.v(a["x"], np.float32, (T, H), "x")
        x[:], act = embed_norm_ref(
            x,
            self.v(a["table"], np.uint16, (2, p["P"], H), "table"),
            pos,
            self.v(a["w"], np.uint16, H, "w"),
            p["EPS"],
            HP,
        )
        self.v(a["a"], np.float16, (T, HP), "a")[:] = act

    def k_vis_sandwich(self, p, a, n):
        T, H, HP = a["T"], p["H"], p["HP"]
        x = self.v(a["x"], np.float32, (T, H), "x")
        w_next = self.v(a["w_next"], np.uint16, H, "w_next") if a["w_next"] else None
        x[:], act = sandwich_ref(
            x,
            self.v(a["y"], np.float32, (T, H), "y"),
            self.v(a["w_post"], np.uint16, H, "w_post"),
            w_next,
            p["EPS"],
            HP,
        )
        if act is not None:
            self.v(a["a"], np.float16, (T, HP), "a")[:] = act

    def k_vis_qkv_rope(self, p, a, n):
        T, NH, D, DP = a["T"], p["NH"], p["D"], p["DP"]
        outs = qkv_rope_ref(
            self.v(a["qkv"], np.float32, (T, 3 * NH * D), "qkv"),
            self.v(a["q_norm_w"], np.uint16, D, "q_norm_w"),
            self.v(a["k_norm_w"], np.uint16, D, "k_norm_w"),
            self.v(a["pos"], np.int32, (T, 2), "pos"),
            NH,
            D,
            DP,
            p["THETA"],
            p["EPS"],
        )
        for name, val in zip("qkv", outs):
            self.v(a[name], np.uint16, (T, NH, DP), name)[:] = val

    def k_vis_attn(self, p, a, n):
        T, B, NH, DP, DC = a["T"], a["B"], p["NH"], p["DP"], p["DC"]
        q, k, v = (bf16_to_f32(self.v(a[name], np.uint16, (B * T, NH, DP), name)) for name in "qkv")
        if any((t[..., DC:] != 0).any() for t in (q, k)):
            from emulated_kernels import EmuError

            raise EmuError(f"q / k channels past the computed {DC} are not zero")
        out = np.zeros((B * T, NH, DP), np.float16)
        for i in range(0, B * T, T):  # each image's patches attend only each other
            out[i : i + T, :, :DC] = attention_ref(q[i : i + T, :, :DC], k[i : i + T, :, :DC], v[i : i + T, :, :DC])
        self.v(a["out"], np.float16, (B * T, NH, DP), "out")[:] = out

    def k_vis_pool(self, p, a, n):
        T, TI, H, HP, P = a["T"], a["TI"], p["H"], p["HP"], p["POOL"]
        L = TI * P * P  # an image's patches; the images' go back to back
        if T % TI:
            from emulated_kernels import EmuError

            raise EmuError(f"{T} pooled rows are no whole number of images of {TI}")
        pos = self.v(a["pos"], np.int32, (T * P * P, 2), "pos")
        x = self.v(a["x"], np.float32, (T * P * P, H), "x")
        out = self.v(a["out"], np.float16, (T, HP), "out")
        gw = int(pos[L - 1, 0]) + 1  # the kernel takes the first image's grid for all
        for b in range(T // TI):
            at = pos[b * L : (b + 1) * L]
            if gw % P or L % gw or (L // gw) % P or int(at[-1, 0]) + 1 != gw:
                from emulated_kernels import EmuError

                raise EmuError(f"{L} patches are no row-major grid of whole {P}x{P} cells (width {gw}) an image")
            out[b * TI : (b + 1) * TI] = pool_ref(
                x[b * L : (b + 1) * L],
                at,
                self.v(a["std_bias"], np.float32, H, "std_bias"),
                self.v(a["std_scale"], np.float32, H, "std_scale"),
                P,
                p["EPS"],
                HP,
            )
