"""`elastic-local info`: what a checkpoint holds, as text and as JSON."""

import json

from tiny import make_checkpoint

from elastic_local.cli import main
from elastic_local.model import gemv


def test_info_json_counts_match_the_tensors_in_the_file(tmp_path, capsys):
    make_checkpoint(tmp_path, seed=8, hybrid_override_pattern="M*E-ME")
    assert main(["info", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["pattern"] == "M*E-ME"
    assert d["params"] == d["weights"]["params_in_files"]  # the formula agrees with the headers
    assert d["budgets"][0]["name"] == "full"
    # active = total minus the routed experts a token does not use (2 MoE layers, 8 experts, top-2)
    per_expert = 2 * 32 * 16
    assert d["params"] - d["active_params"] == 2 * (8 - 2) * per_expert
    assert d["weights"]["bytes_on_disk"] >= 4 * d["params"]
    # x86 with a C compiler: prompts' scan and products, and decode steps, in C
    assert d["kernels"]["mamba_scan"].startswith("C (model/step.c")
    assert "column panels" in d["kernels"]["linear"]
    assert ("bf16 dot products" in d["kernels"]["linear"]) == gemv.bf16_dot()  # what this CPU has
    assert d["kernels"]["decode_step"].startswith("in C (model/step.c): one call per token")
    assert d["kernels"]["weights"].startswith("4 KiB pages")  # a tiny model stays in the CPU's caches


def test_info_names_cuda_graphs_as_the_decode_step_on_a_gpu(tmp_path, capsys, monkeypatch):
    import torch

    from elastic_local.model import kernels

    make_checkpoint(tmp_path, seed=8)
    monkeypatch.setattr(kernels, "_active", None)  # the kernel choice made under the patch is undone after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert main(["info", str(tmp_path)]) == 0
    assert "decode step: CUDA graphs, one per budget and cache" in capsys.readouterr().out


def test_info_text_and_errors(tmp_path, capsys):
    make_checkpoint(tmp_path / "m", seed=8)
    assert main(["info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "pattern   M*E-ME" in out and "kernels" in out
    assert "precision F32 (unquantized); loads as bf16 (stored), fp8 (load-time quantization)" in out
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "config.json: not found" in capsys.readouterr().err
