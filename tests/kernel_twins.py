"""Pure-torch twins of the optional kernels, with the argument checks the kernels make.

Each `fake_*` has the signature of the kernel model/kernels.py calls and rejects what that kernel
rejects: shapes, dtypes, devices and strides, as read in the sources of mamba_ssm (main, 2.2.x:
`selective_state_update`, `mamba_chunk_scan_combined`), causal_conv1d (1.5: `causal_conv1d_fn`,
`causal_conv1d_update` and their C++ checks) and torch's `_scaled_mm`. It then computes the result
with a plain reference, the semantics of those packages' own reference functions
(`selective_state_update_ref`, `ssd_minimal_discrete`, `causal_conv1d_ref`, `causal_conv1d_update_ref`):
a token-by-token recurrence for the scan, a direct sum for the convolution. These twins are written
here rather than copied, so that the tests hold no third-party code; the checks cite what they mirror.

`FAKES` serves CPU tensors, so `kernels.use(FAKES)` drives the network's kernel path on any machine.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from elastic_local.model.kernels import KernelSet
from elastic_local.quant.nvfp4 import dequantize_nvfp4

calls: Counter[str] = Counter()  # kernel name -> times called, so a test can see its path was taken
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _one_device(*tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, found {sorted(map(str, devices))}")


def fake_selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                state_batch_indices=None):
    """mamba_ssm.ops.triton.selective_state_update.selective_state_update: state (b, h, p, N) updated in
    place; x, dt, z (b, h, p); A (h, p, N); B, C (b, g, N); D, dt_bias (h, p). 2-D/3-D forms get a head
    axis, as upstream does."""
    calls["selective_state_update"] += 1
    if state.dim() == 3:
        state = state.unsqueeze(1)
    has_heads = x.dim() == 3
    x, dt = (t if t.dim() == 3 else t.unsqueeze(1) for t in (x, dt))
    A = A if A.dim() == 3 else A.unsqueeze(0)
    B, C = (t if t.dim() == 3 else t.unsqueeze(1) for t in (B, C))
    D = D.unsqueeze(0) if D is not None and D.dim() == 1 else D
    dt_bias = dt_bias.unsqueeze(0) if dt_bias is not None and dt_bias.dim() == 1 else dt_bias
    _, h, p, N = state.shape
    b = x.shape[0]
    assert x.shape == (b, h, p) and dt.shape == x.shape and A.shape == (h, p, N)
    g = B.shape[1]
    assert h % g == 0, "nheads must be divisible by ngroups"
    assert B.shape == (b, g, N) and C.shape == B.shape
    assert D is None or D.shape == (h, p)
    assert dt_bias is None or dt_bias.shape == (h, p)
    _one_device(state, x, dt, A, B, C, D, z, dt_bias)
    # Before the launch upstream evaluates `A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0
    # and dt_bias.stride(-1) == 0` (tied head dim), then passes `*(dt_bias.stride(0), dt_bias.stride(1))
    # if dt_bias is not None else 0` and the same for D: unpacking 0 fails, so both must be given.
    if A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias is None:
        raise AttributeError("'NoneType' object has no attribute 'stride'")
    if dt_bias is None or D is None:
        raise TypeError("selective_state_update: argument after * must be an iterable, not int "
                        f"({'dt_bias' if dt_bias is None else 'D'} is None)")
    dt = dt.float() + (0 if dt_bias is None else dt_bias.float())
    dt = F.softplus(dt) if dt_softplus else dt
    Bh, Ch = (t.float().repeat_interleave(h // g, dim=1) for t in (B, C))  # head i reads group i // (h / g)
    new = state.float() * torch.exp(dt[..., None] * A.float()) + (dt * x.float())[..., None] * Bh[:, :, None]
    state.copy_(new)
    out = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        out = out + x.float() * D.float()
    if z is not None:
        out = out * F.silu(z.float())
    out = out.to(x.dtype)
    return out if has_heads else out.squeeze(1)


def fake_mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                   seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                   return_final_states=False, return_varlen_states=False, state_dtype=None):
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined: x (b, T, h, p), dt (b, T, h), A (h,),
    B, C (b, T, g, N), initial_states (b, h, p, N). Returns y (and the final state when asked)."""
    calls["mamba_chunk_scan_combined"] += 1
    b, T, h, p = x.shape
    g, N = B.shape[2], B.shape[3]
    assert h % g == 0
    assert B.shape == (b, T, g, N) and x.shape == (b, T, h, p) and dt.shape == (b, T, h)
    assert A.shape == (h,) and C.shape == B.shape
    assert z is None or z.shape == x.shape
    assert D is None or D.shape in ((h, p), (h,))
    assert initial_states is None or initial_states.shape == (b, h, p, N)
    _one_device(x, dt, A, B, C, D, z, dt_bias, initial_states)
    dt = dt.float() + (0 if dt_bias is None else dt_bias.float())
    dt = F.softplus(dt) if dt_softplus else dt
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(*dt_limit)
    Bh, Ch = (t.float().repeat_interleave(h // g, dim=2) for t in (B, C))
    state = torch.zeros(b, h, p, N) if initial_states is None else initial_states.float().clone()
    ys = []
    for t in range(T):  # the recurrence itself: h_t = exp(dt A) h_{t-1} + dt x_t B_t, y_t = h_t . C_t
        state = state * torch.exp(dt[:, t, :, None, None] * A.float()[:, None, None]) \
            + (dt[:, t, :, None] * x[:, t].float())[..., None] * Bh[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + x.float() * (D.float()[..., None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def _check_conv(x, weight, bias, device_tensors) -> None:
    """What causal_conv1d's C++ entry points check of x, weight and bias."""
    if x.dtype not in FLOATS or weight.dtype not in FLOATS:
        raise RuntimeError(f"causal_conv1d: x {x.dtype} / weight {weight.dtype} must be float32, float16 or bfloat16")
    _one_device(x, weight, bias, *device_tensors)
    dim, width = weight.shape
    assert x.shape[1] == dim, f"x must have shape (batch, {dim}, seqlen), got {tuple(x.shape)}"
    if not 2 <= width <= 4:
        raise RuntimeError("causal_conv1d only supports width between 2 and 4")
    if bias is not None and (bias.dtype != weight.dtype or bias.stride(-1) != 1 or bias.shape != (dim,)):
        raise RuntimeError("causal_conv1d: bias must be (dim,), contiguous, of the weight's dtype")


def _conv(x: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """(b, dim, K-1+T) window -> (b, dim, T): out_t = bias + sum_k weight[:, k] x_{t+k}, then silu."""
    width, T = weight.shape[1], x.shape[-1] - weight.shape[1] + 1
    out = sum(weight[:, k, None].float() * x[..., k:k + T].float() for k in range(width))
    if bias is not None:
        out = out + bias.float()[:, None]
    return F.silu(out) if activation in ("silu", "swish") else out


def fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                          final_states_out=None, activation=None):
    """causal_conv1d.causal_conv1d_fn: x (b, dim, T), weight (dim, width), initial_states (b, dim, width-1)."""
    calls["causal_conv1d_fn"] += 1
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    if x.stride(2) != 1 and x.stride(1) != 1:  # the Python wrapper copies such an x
        x = x.contiguous()
    _check_conv(x, weight, bias, [initial_states])
    b, dim, T = x.shape
    width = weight.shape[1]
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last and (dim % 8 or x.stride(2) % 8 or x.stride(0) % 8):
        raise RuntimeError("causal_conv1d with channel last layout requires dim and strides x.stride(0), "
                           "x.stride(2) to be multiples of 8")
    if initial_states is not None:
        if initial_states.stride(2) != 1 and initial_states.stride(1) != 1:  # the wrapper copies it
            initial_states = initial_states.contiguous()
        if not channel_last:
            raise RuntimeError("initial_states is only supported for channel last layout")
        if initial_states.dtype != x.dtype or initial_states.shape != (b, dim, width - 1) \
                or initial_states.stride(1) != 1:
            raise RuntimeError("initial_states must be (batch, dim, width - 1) in x's dtype, channels contiguous")
    if return_final_states and x.stride(1) != 1:
        raise AssertionError("Only channel-last layout support returning final_states_out")
    prev = x.new_zeros(b, dim, width - 1) if initial_states is None else initial_states
    window = torch.cat([prev, x], dim=-1)
    out = _conv(window, weight, bias, activation).to(x.dtype)
    return (out, window[..., -(width - 1):].to(x.dtype)) if return_final_states else out


def fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                              conv_state_indices=None):
    """causal_conv1d.causal_conv1d_update: x (b, dim) or (b, dim, T), conv_state (b, dim, state_len >=
    width - 1) shifted in place."""
    calls["causal_conv1d_update"] += 1
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    squeeze = x.dim() == 2
    x = x.unsqueeze(-1) if squeeze else x
    _check_conv(x, weight, bias, [conv_state])
    if conv_state.dtype != x.dtype:
        raise RuntimeError(f"causal_conv1d_update: conv_state is {conv_state.dtype}, x is {x.dtype}")
    b, dim, T = x.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    assert conv_state.shape == (b, dim, state_len) and state_len >= width - 1
    assert cache_seqlens is None and conv_state_indices is None, "not exercised by this runtime"
    window = torch.cat([conv_state, x], dim=-1)
    conv_state.copy_(window[..., -state_len:])
    out = _conv(window[..., -(width - 1 + T):], weight, bias, activation).to(x.dtype)
    return out.squeeze(-1) if squeeze else out


def blocked_offsets(rows: int, cols: int) -> torch.Tensor:
    """Where scale (r, c) sits in cuBLAS's block-scaling-factor layout: 512-byte tiles of 128 rows x 4
    columns, tiles in row-major order, and inside a tile offset (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4."""
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    tile = (r // 128) * ((cols + 3) // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def unblock(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] e4m3 block scales a swizzled, padded scale tensor holds."""
    return blocked.view(torch.uint8)[blocked_offsets(rows, cols)].view(torch.float8_e4m3fn)


def fake_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm's contract as CUDA enforces it: 2-D operands on one device, A row-major and B
    column-major; FP8 with fp32 per-tensor scales and dims multiple of 16; NVFP4 (float4_e2m1fn_x2) with
    e4m3 block scales in the 128x4 swizzled layout."""
    calls["scaled_mm"] += 1
    _one_device(a, b, scale_a, scale_b, bias, scale_result)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"_scaled_mm: a {tuple(a.shape)} and b {tuple(b.shape)} cannot be multiplied")
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise RuntimeError("_scaled_mm: a must be row-major and b column-major")
    m, n = a.shape[0], b.shape[1]
    if a.dtype == b.dtype == torch.float4_e2m1fn_x2:
        k = 2 * a.shape[1]
        if k % 32 or n % 16:
            raise RuntimeError(f"_scaled_mm nvfp4: K {k} must be a multiple of 32 and N {n} of 16")
        for s, rows in ((scale_a, m), (scale_b, n)):
            if s.dtype != torch.float8_e4m3fn or not s.is_contiguous() \
                    or s.numel() != 128 * -(-rows // 128) * 4 * -(-k // 64):
                raise RuntimeError("_scaled_mm nvfp4: block scales must be e4m3, swizzled and padded to 128x4 tiles")
        one = torch.tensor(1.0, device=a.device)
        A = dequantize_nvfp4(a.view(torch.uint8), unblock(scale_a, m, k // 16), one, torch.float32)
        B = dequantize_nvfp4(b.t().view(torch.uint8), unblock(scale_b, n, k // 16), one, torch.float32)
        out = A @ B.T
    else:
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        if a.dtype not in fp8 or b.dtype not in fp8 or a.dtype == b.dtype == torch.float8_e5m2:
            raise RuntimeError(f"_scaled_mm: unsupported operand dtypes {a.dtype}, {b.dtype}")
        if a.shape[1] % 16 or n % 16:
            raise RuntimeError("_scaled_mm fp8: K and N must be multiples of 16")
        if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32 or scale_a.numel() != 1 \
                or scale_b.numel() != 1:
            raise RuntimeError("_scaled_mm fp8: tensor-wise scales must be one float32 value each")
        out = (a.float() * scale_a) @ (b.float() * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or a.dtype)


FAKES = KernelSet(
    "fakes", device_type="cpu", chunk_scan=fake_mamba_chunk_scan_combined,
    state_update=fake_selective_state_update, conv=fake_causal_conv1d_fn, conv_update=fake_causal_conv1d_update,
    scaled_mm=fake_scaled_mm, capability=lambda device: (10, 0) if device.type == "cpu" else None,
)
