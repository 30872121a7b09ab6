"""Which implementation runs the Mamba2 scan and convolution.

On CUDA tensors, when `mamba_ssm` and `causal_conv1d` import, their kernels run; everywhere else the
pure-torch reference in ssd.py does. The choice is made per call from the tensor's device and is
reported by `describe()` (and `elastic-local info`), so a GPU user sees when the kernels are missing.
"""

from __future__ import annotations

import importlib.util
import logging
from functools import cache

import torch

from . import ssd

log = logging.getLogger(__name__)


@cache
def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@cache
def _ssm_ops():
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    log.info("Mamba2 scan: mamba_ssm CUDA kernels")
    return mamba_chunk_scan_combined, selective_state_update


@cache
def _conv_ops():
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

    log.info("Mamba2 convolution: causal_conv1d CUDA kernels")
    return causal_conv1d_fn, causal_conv1d_update


def describe(device: str | torch.device) -> dict[str, str]:
    """The implementation each Mamba2 op takes on `device`, and why."""
    cuda = torch.device(device).type == "cuda"
    scan = "mamba_ssm (CUDA kernels)" if cuda and _have("mamba_ssm") else "torch SSD reference"
    conv = "causal_conv1d (CUDA kernel)" if cuda and _have("causal_conv1d") else "torch conv1d"
    out = {"mamba_scan": scan, "mamba_conv": conv}
    if cuda and not (_have("mamba_ssm") and _have("causal_conv1d")):
        out["note"] = "install the CUDA kernels: pip install --no-build-isolation 'elastic-local[cuda]'"
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None) -> torch.Tensor:
    """silu(causal depthwise conv) of x [b, T, C]; continues from and updates `state` [b, C, K]."""
    if x.is_cuda and _have("causal_conv1d"):
        conv_fn, conv_update = _conv_ops()
        if state is None:
            return conv_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
        if x.shape[1] == 1:
            return conv_update(x[:, 0], state, weight, bias, activation="silu")[:, None]
    return ssd.causal_conv1d(x, weight, bias, state)


def ssd_scan(x, dt, A, B, C, chunk: int, initial_state: torch.Tensor | None):
    """Chunked scan; shapes as ssd.ssd_chunked (group-major heads)."""
    if x.is_cuda and _have("mamba_ssm"):
        scan, _ = _ssm_ops()
        b, T, G, r, p = x.shape
        init = None if initial_state is None else initial_state.reshape(b, G * r, p, -1)
        y, final = scan(x.reshape(b, T, G * r, p), dt.reshape(b, T, G * r), A.reshape(-1), B, C,
                        chunk_size=chunk, initial_states=init, return_final_states=True)
        return y.view(b, T, G, r, p), final.view(b, G, r, p, -1)
    return ssd.ssd_chunked(x, dt, A, B, C, chunk, initial_state)


def ssm_step(ssm: torch.Tensor, x, dt, A, B, C) -> torch.Tensor:
    """One decode step; updates `ssm` [b, G, r, p, N] in place and returns y [b, G, r, p]."""
    if x.is_cuda and _have("mamba_ssm"):
        _, step = _ssm_ops()
        b, G, r, p = x.shape
        N = ssm.shape[-1]
        y = step(ssm.view(b, G * r, p, N), x.reshape(b, G * r, p),
                 dt.reshape(b, G * r, 1).expand(b, G * r, p), A.reshape(-1, 1, 1).expand(G * r, p, N), B, C)
        return y.view(b, G, r, p)
    return ssd.ssm_step(ssm, x, dt, A, B, C)
