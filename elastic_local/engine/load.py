"""`elastic_local.load`: a checkpoint directory in, an ElasticModel out."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint.load import load_network
from ..elastic.table import read_budgets
from ..model import gemv, pages
from ..model.config import NemotronHConfig
from ..model.nemotron_h import NemotronH
from ..model.schema import stored_budget
from ..paths import default_model
from ..progress import Progress
from ..quant.nvfp4 import NVFP4Weight
from .chat import ChatTemplate
from .elastic_model import ElasticModel
from .tokenizer import Tokenizer

LAYOUT_ENV = "ELASTIC_LOCAL_CPU_LAYOUT"  # "rows": keep CPU float32 weights [out, in] (cpu_layout says why)


def cpu_layout() -> str:
    """How CPU float32 weights are kept: "transposed" ([in, out], model/linear.Transposed) by default, or
    "rows" ([out, in], as stored; in a float32 load a BF16 file's Linear weights and LM head then widen to
    float32, where the default keeps them in bf16 panels, and FP8 codes stay rows). Decode steps run on the
    CPU decode kernels (model/gemv.py) in both; [in, out] keeps a hidden-size cut contiguous (the hidden
    size is the input of the largest weights), where [out, in] leaves every row partly read and its small
    budgets lose (docs/decode-speed.md, "CPU decode kernels")."""
    return "rows" if os.environ.get(LAYOUT_ENV) == "rows" else "transposed"


def load(path: str | Path | None = None, budget: str | None = None, precision: str | None = None,
         device: str = "cpu", dtype: torch.dtype | None = None, progress: Progress | None = None,
         keep: tuple[str, ...] = (), compile: bool = False, cuda_graphs: bool | None = None,
         activations: str = "float") -> ElasticModel:
    """Load a Nemotron-H (or nested elastic) checkpoint directory; without a path, the embedded demo model.
    `budget` makes only that budget resident and reads only its slices from disk; every budget up to it
    then runs as views. "auto" for
    `budget` and/or `precision` asks the fit planner what this machine holds. `dtype` (compute and
    high-precision weights) defaults to bfloat16 on CUDA, float32 on a CPU; with "auto" on a CPU, float32
    where the pick fits in it too (the planner plans bf16; float32 computes exactly, and prefills faster
    where the CPU has no bf16 dot products), else bfloat16. On a CPU with the C kernels, both keep BF16
    Linear weights in bf16 column panels and decode in the C step (model/step.py).
    `precision`: None keeps what the file stores; "fp8" / "nvfp4" from a BF16 file quantize while loading
    (`keep`: module patterns left in high precision); "bf16" from a quantized file dequantizes.
    `compile`: one-token decode steps run through torch.compile, one graph per budget compiled on its first
    step (`NemotronH.compile_decode`; seconds to a minute once per budget and process, then faster).
    `cuda_graphs` (CUDA only): one-token decode steps replay from a CUDA graph per budget and cache
    (`NemotronH.capture_decode`); taken before `compile` where both are set. None (the default): graphs on
    CUDA unless `compile` is set (a decode step there is hundreds of launches; replayed, one: 8-18x on an
    H200, docs/decode-speed.md), none elsewhere.
    `activations`: "float" (the default) multiplies NVFP4 weights by the inputs as they are (W4A16: exact);
    "nvfp4" rounds each input row to NVFP4 first (W4A4), as Blackwell's NVFP4 kernel does, on every path:
    on a CPU the products are then small integers, faster than the exact ones (README, issue #15)."""
    if activations not in ("float", "nvfp4"):
        raise ValueError(f"activations must be 'float' or 'nvfp4', got {activations!r}")
    if cuda_graphs and torch.device(device).type != "cuda":  # before any weight is read
        raise ValueError(f"CUDA graphs record GPU kernels; the device is {device}: load on a CUDA device "
                         "(--device cuda), or leave CUDA graphs off")
    path = Path(path) if path is not None else default_model()
    tokenizer = Tokenizer.from_dir(path) if (path / "config.json").is_file() else None
    if tokenizer is not None and tokenizer.chat_template is not None:  # broken: an error now, not at a prompt
        try:
            ChatTemplate(tokenizer.chat_template)
        except ValueError as e:
            raise ValueError(f"{tokenizer.template_file}: {e}") from None
    auto = budget == "auto" or precision == "auto"
    float32 = torch.device(device).type != "cuda"  # plain CPU runs: float32, exact
    if auto:  # the fit planner's pick for this machine: bf16 compute, or on a CPU float32 where that fits too
        from ..hardware.fit import choose

        picked_budget, picked_precision, float32 = choose(path, device=device)
        budget = picked_budget if budget == "auto" else budget
        precision = picked_precision if precision == "auto" else precision
    if dtype is None:
        dtype = torch.float32 if float32 else torch.bfloat16
    cfg = NemotronHConfig.from_dir(path)
    budgets = read_budgets(cfg, where=str(path / "config.json"))
    if budget is not None and budget not in budgets:
        raise KeyError(f"unknown budget {budget!r}; {path} has {list(budgets)}")
    resident = budgets[budget] if budget is not None else next(iter(budgets.values()))
    if torch.device(device).type == "cpu":
        gemv.prebuild()  # the CPU decode kernels, built while the weights load (first run after an install)
    panels = torch.device(device).type == "cpu" and cpu_layout() == "transposed" and (
        dtype == torch.float32 or dtype == torch.bfloat16 and gemv.library() is not None)
    # BF16 Linear weights stay bf16 for the panels (half of float32's memory and bytes per token; the
    # kernels widen them exactly); where the kernels turn out not to run they are widened below. A bf16
    # load takes panels only where the kernels run (else [out, in] rows, torch's faster bf16 layout): as
    # rows, a smaller budget's strided views read 1.25-3.7x slower than contiguous ones (scratch), and the C
    # step ran gen16 at 3.0 ms a token full and 3.6 small, against 2.5 and 1.9 in panels (docs/decode-speed.md)
    net = load_network(path, resident=resident, stored=stored_budget(cfg), dtype=dtype, device=device,
                       progress=progress, precision=precision, keep=keep,
                       linear_dtype=torch.bfloat16 if panels else None)
    if activations == "nvfp4":
        round_nvfp4_inputs(net, path)
    # an arena (huge pages) for a CPU load only: a GPU load's weights are not walked
    cpu_bytes = sum(t.nbytes for t in net.tensors()) if net.device.type == "cpu" else 0
    with pages.arena(cpu_bytes) as arena:
        if panels:
            # panels where the kernels run (a float32 load without them: linear.Transposed), so the first run
            # after an install waits here for the build `prebuild` started (about 2 s)
            if progress is not None and gemv.building():
                progress(0, 1, "building the CPU kernels (once per install)")
            net.transpose_weights(panels=gemv.library() is not None)
        # what decode streams and the panels did not take (FP8 / NVFP4 codes) into huge pages too; not an
        # embedding of which a token reads one row
        if arena is not None:
            pages.settle([t for t in net.tensors() if t is not net.embed or net.lm_head is net.embed])
    if compile:
        net.compile_decode()
    if cuda_graphs or (cuda_graphs is None and not compile and net.device.type == "cuda"):
        net.capture_decode()
    gemv.release_threads()  # the loading thread's OpenMP workers: generation may run on another thread
    return ElasticModel(net, {k: b for k, b in budgets.items() if b.fits_in(resident)}, path, tokenizer,
                        not_resident=[k for k, b in budgets.items() if not b.fits_in(resident)])


def round_nvfp4_inputs(net: NemotronH, path: Path) -> None:
    """Every NVFP4 weight of `net` rounds its inputs to NVFP4 (W4A4); an error where there are none."""
    weights = [w for w in net.objects(into_dicts=True) if isinstance(w, NVFP4Weight)]
    if not weights:
        raise ValueError(f"activations='nvfp4' rounds the inputs of NVFP4 weights, and {path} loaded none: "
                         "add --precision nvfp4")
    for w in weights:
        w.quantize_inputs = True

