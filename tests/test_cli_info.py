"""`elastic-local info`: what a checkpoint holds, as text and as JSON."""

import json

from tiny import make_checkpoint

from elastic_local.cli import main


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
    assert d["kernels"]["mamba_scan"] == "torch SSD reference"


def test_info_text_and_errors(tmp_path, capsys):
    make_checkpoint(tmp_path / "m", seed=8)
    assert main(["info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "pattern   M*E-ME" in out and "kernels" in out
    assert "precision F32 (unquantized); loads as bf16 (stored), fp8 (load-time quantization)" in out
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "config.json: not found" in capsys.readouterr().err
