"""FP8 / NVFP4 nested checkpoints: quantize, load, slice, and load-time quantization."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import ALIGNED, make_checkpoint

import elastic_local
from elastic_local.checkpoint import CheckpointError
from elastic_local.elastic.nest import nest
from elastic_local.elastic.slice import slice_budget
from elastic_local.ptq.quantize import quantize_checkpoint
from elastic_local.quant import FP8Weight

CFG = {**ALIGNED, "mamba_head_dim": 16}  # heads of 16 channels: whole NVFP4 blocks, reorderable at load
IDS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(12))


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    make_checkpoint(root / "parent", seed=41, **CFG)
    nest(root / "parent", root / "bf16", {"half": 0.5})
    for p in ("fp8", "nvfp4"):
        quantize_checkpoint(root / "bf16", root / p, p)
    return root


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_stored_file_equals_load_time_quantization(nested, precision):
    stored = elastic_local.load(nested / precision)
    assert stored.budgets == ["full", "half"]
    on_the_fly = elastic_local.load(nested / "bf16", precision=precision)
    for b in stored.budgets:
        torch.testing.assert_close(stored.logits(IDS, budget=b), on_the_fly.logits(IDS, budget=b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_slicing_the_quantized_file_equals_quantized_slices(nested, precision, tmp_path):
    """dequant(slice(q)) == slice(dequant(q)): the sliced file, dequantized, runs the same numbers as the
    nested file's budget run on its own dequantized weights."""
    out, _ = slice_budget(nested / precision, tmp_path / "half", "half")
    sliced = elastic_local.load(out, precision="bf16")
    whole = elastic_local.load(nested / precision, precision="bf16")
    torch.testing.assert_close(sliced.logits(IDS), whole.logits(IDS, budget="half"), atol=1e-5, rtol=0)
    # tensor by tensor: every packed byte and scale of the slice is the parent's sub-block
    parent = load_file(nested / precision / "model.safetensors")
    child = load_file(out / "model.safetensors")
    name = "backbone.layers.2.mixer.experts.0.down_proj"
    w, pw = child[name + ".weight"], parent[name + ".weight"]
    assert torch.equal(w.view(torch.uint8), pw[: w.shape[0], : w.shape[1]].view(torch.uint8))
    s, ps = child[name + ".weight_scale"], parent[name + ".weight_scale"]
    if precision == "fp8":  # one scale for the tensor, shared by every budget
        assert s.dim() == 0 and torch.equal(s, ps)
    else:
        assert torch.equal(s.view(torch.uint8), ps[: s.shape[0], : s.shape[1]].view(torch.uint8))


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantized_exports_carry_what_vllm_requires(nested, precision, tmp_path):
    out, _ = slice_budget(nested / precision, tmp_path / "half", "half")
    for d in (nested / precision, out):
        q = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
        assert q["quant_algo"] == precision.upper()
        for key in ("group_size", "kv_cache_quant_algo", "exclude_modules"):
            assert key in q
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == "modelopt"
        with safe_open(d / "model.safetensors", "pt") as f:
            names = list(f.keys())
        # every excluded module exists, and none of them is stored quantized
        for module in q["exclude_modules"]:
            assert any(n.startswith(module + ".") for n in names), module
            assert not any(n.startswith(module + ".") and n.endswith("weight_scale") for n in names), module
        assert "backbone.layers.2.mixer.gate" in q["exclude_modules"] and "lm_head" in q["exclude_modules"]
        with safe_open(d / "model.safetensors", "pt") as f:
            assert f.get_tensor("backbone.layers.2.mixer.gate.weight").dtype == torch.float32


def test_keep_preset_leaves_attention_and_its_feeding_mamba_in_bf16(nested, tmp_path):
    out = quantize_checkpoint(nested / "bf16", tmp_path / "nano", "nvfp4", preset="nano")
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    # pattern M*EM-ME: attention is layer 1, the Mamba feeding it layer 0; layer 3's Mamba is quantized
    assert "backbone.layers.1.mixer.q_proj.weight_scale" not in names
    assert "backbone.layers.0.mixer.in_proj.weight_scale" not in names
    assert "backbone.layers.3.mixer.in_proj.weight_scale" in names
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert "backbone.layers.1.mixer.q_proj" in q["exclude_modules"]
    elastic_local.load(out).logits(IDS)


def test_quantized_weights_stay_packed_in_memory(nested):
    m = elastic_local.load(nested / "nvfp4")
    w = m.net.layers[0].mixer.in_proj
    assert w.weight.dtype == torch.uint8 and w.shape[1] == 64 and w.weight.shape[1] == 32
    assert type(m.net.layers[2].mixer.up[0]).__name__ == "NVFP4Weight"


def test_nan_in_a_weight_is_named(nested, tmp_path):
    import shutil

    shutil.copytree(nested / "bf16", tmp_path / "bad")
    f = tmp_path / "bad" / "model.safetensors"
    sd = load_file(f)
    sd["backbone.layers.3.mixer.out_proj.weight"][0, 0] = float("nan")
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.3\.mixer\.out_proj\.weight: cannot quantize a tensor holding 1 NaN"):
        quantize_checkpoint(tmp_path / "bad", tmp_path / "out", "fp8")
    assert not (tmp_path / "out").exists()


def test_precision_that_the_file_cannot_give_is_refused(nested):
    with pytest.raises(CheckpointError, match="stores NVFP4 weights; load it as 'nvfp4' or as 'bf16'"):
        elastic_local.load(nested / "nvfp4", precision="fp8")
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        elastic_local.load(nested / "bf16", precision="int4")


def test_auto_takes_the_fit_planners_pick(nested, monkeypatch):
    import elastic_local.hardware.fit as fit

    asked = {}

    def choose(path, device=None, **kw):
        asked["path"], asked["device"] = path, device
        return "half", "fp8", asked.get("float32", False)

    monkeypatch.setattr(fit, "choose", choose)
    m = elastic_local.load(nested / "bf16", budget="auto", precision="auto")
    assert asked == {"path": nested / "bf16", "device": "cpu"}
    assert m.budgets == ["half"] and isinstance(m.net.layers[0].mixer.in_proj, FP8Weight)  # FP8Panels on a CPU
    assert m.dtype == torch.bfloat16  # the plan's compute dtype, where float32 would not fit
    asked["float32"] = True
    assert elastic_local.load(nested / "bf16", budget="auto", precision="auto").dtype == torch.float32


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_info_json_lists_budgets_and_the_stored_precision(nested, precision, capsys):
    from elastic_local.cli import main

    assert main(["info", str(nested / precision), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["precision"] == precision
    assert [b["name"] for b in d["budgets"]] == ["full", "half"]
    for b in d["budgets"]:
        assert b["params"] > b["active_params"] > 0
        if precision == "bf16":  # a BF16 file loads as any precision; a quantized one as its own only
            assert b["bytes"]["bf16"] > b["bytes"]["fp8"] > b["bytes"]["nvfp4"]
        else:
            assert b["bytes"]["bf16"] is None is b["bytes"]["fp8"] and b["bytes"]["nvfp4"] > 0
    assert d["budgets"][1]["params"] < d["budgets"][0]["params"]
    assert d["kernels"]["linear"].startswith("dense" if precision == "bf16" else "dequantize")
