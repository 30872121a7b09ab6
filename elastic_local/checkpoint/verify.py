"""Whether a checkpoint directory's weight files match its config.json (names, shapes, dtypes), from the
safetensors headers alone: every load checks this before any work, and `fit --profile` plans from it without torch."""

from __future__ import annotations

from pathlib import Path

from ..model.budget import Budget
from ..model.config import NemotronHConfig
from ..model.schema import expected_shapes, stored_budget
from ..quant.scheme import read_quant_config, stored_tensors
from .files import CheckpointError, TensorInfo, checkpoint_tensors


def stored_layout(cfg: NemotronHConfig, stored: Budget, precision: str, kept: list[str]) -> dict:
    """Name -> (safetensors dtype, shape) of every tensor the file holds, quantized Linears expanded into
    weight and scales (an unquantized tensor's dtype is a default: any float dtype loads)."""
    out = {}
    for name, shape in expected_shapes(cfg, stored).items():
        out.update(stored_tensors(name, shape, "bf16" if precision == "bf16" else precision, kept))
    return out


FLOAT_DTYPES = ("BF16", "F16", "F32")  # an unquantized tensor in any of these is cast while loading
# config.json fields that fix tensor shapes: when one is absent its default is used, which is often why a
# file and its config disagree
SIZE_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
               "conv_kernel", "n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size")


def _hub(info: TensorInfo | None, name: str) -> str:
    return info.key if info is not None else name if name.startswith("lm_head") else f"backbone.{name}"


def check_tensors(path: Path, tensors: dict[str, TensorInfo], expected: dict[str, tuple],
                  raw_config: dict | None = None) -> None:
    """The files hold exactly the tensors config.json implies, each of its shape and of a dtype that loads.
    `expected` maps name -> shape, or -> (dtype, shape) to check dtypes too."""
    found = {k for k in tensors if not k.startswith("mtp.")}
    missing = sorted(set(expected) - found)
    extra = sorted(found - set(expected))
    defaulted = [k for k in SIZE_FIELDS if raw_config is not None and k not in raw_config]
    hint = f" (config.json does not set {', '.join(defaulted)}, so the defaults apply)" if defaulted else ""
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {_hub(None, missing[0])!r}{more} that config.json requires "
                              f"(in no weight file){hint}; the checkpoint is incomplete or does not match its config")
    if extra:
        info = tensors[extra[0]]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{path}: unexpected tensor {info.key!r} in {info.file.name}{more} that config.json "
                              f"does not describe{hint}; the checkpoint does not match its config")
    for name, want in expected.items():
        dtype, shape = want if len(want) == 2 and isinstance(want[0], str) else (None, want)
        info = tensors[name]
        if info.shape != tuple(shape):
            raise CheckpointError(f"{info.file}: tensor {info.key!r} has shape {list(info.shape)}, config.json "
                                  f"implies {list(shape)}{hint}; the file does not match its config")
        ok = FLOAT_DTYPES if dtype in FLOAT_DTYPES else (dtype,)
        if dtype is not None and info.dtype not in ok:
            raise CheckpointError(f"{info.file}: tensor {info.key!r} is stored as {info.dtype}, expected "
                                  f"{' or '.join(ok)}; re-export the checkpoint")


def verify_tensors(path: str | Path, cfg: NemotronHConfig, tensors: dict[str, TensorInfo] | None = None
                   ) -> dict[str, TensorInfo]:
    """Check that the weight files of `path` match its config (names, shapes, dtypes) before any work;
    returns the tensors (one entry per expert)."""
    path = Path(path)
    tensors = checkpoint_tensors(path) if tensors is None else tensors
    precision, kept = read_quant_config(path)
    check_tensors(path, tensors, stored_layout(cfg, stored_budget(cfg), precision, kept), cfg.raw)
    return tensors
