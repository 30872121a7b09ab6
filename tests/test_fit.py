"""`elastic-local fit`: the planner fed from a checkpoint directory (weights or config only) and a profile.

Byte counts are checked against independent oracles: the safetensors headers of each budget exported as
its own file (slice_budget), and the tensors the loader actually makes resident."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import ALIGNED, make_checkpoint

import elastic_local
from elastic_local.checkpoint.files import checkpoint_tensors, index_tensors
from elastic_local.checkpoint.offers import offers
from elastic_local.cli import main
from elastic_local.elastic.nest import nest
from elastic_local.elastic.slice import slice_budget
from elastic_local.elastic.table import read_budgets
from elastic_local.hardware import fit
from elastic_local.hardware.planner import Workload
from elastic_local.hardware.profiles import GIB, list_profiles
from elastic_local.model import gemv
from elastic_local.model.config import NemotronHConfig
from elastic_local.model.linear import Panels, RowConcat
from elastic_local.model.nemotron_h import NemotronH
from elastic_local.paths import STAR_ELASTIC
from elastic_local.quant.fp8 import FP8Panels
from elastic_local.quant.scheme import is_quantized, nano_keep, weight_bytes

CFG = {**ALIGNED, "mamba_head_dim": 16}  # heads of 16 channels: whole NVFP4 blocks
FP32 = ("gate.weight", "e_score_correction_bias", "A_log", ".D", "dt_bias")  # what the runtime keeps in fp32
PROFILES = ("rtx5080", "rtx5090", "rtx4090", "rtx4080", "rtx3090", "rtx3060-12gb", "jetson-agx-orin-64gb",
            "h100-80gb", "cpu")


@pytest.fixture
def no_user_profiles(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))
    return tmp_path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- the shipped Star Elastic description

@pytest.mark.parametrize("name", PROFILES)
def test_fit_json_contract_on_every_shipped_profile(no_user_profiles, capsys, name):
    assert set(PROFILES) <= set(list_profiles())
    rc, out, _ = run_cli(capsys, "fit", "--profile", name, "--json")
    assert rc == 0
    d = json.loads(out)
    prof = list_profiles()[name]
    assert d["available_bytes"] == prof.available_bytes == prof.memory_bytes - prof.reserved_bytes
    cands = d["candidates"]
    assert {c["budget"] for c in cands} == {"30B", "23B", "12B"}
    assert {c["precision"] for c in cands} == {"bf16", "fp8", "nvfp4"} and len(cands) == 9
    for c in cands:
        assert {"budget", "precision", "total_bytes", "fits", "source"} <= set(c)
        assert isinstance(c["total_bytes"], int) and c["total_bytes"] > 2**30  # bytes, not GiB
        assert c["fits"] == (c["total_bytes"] <= d["available_bytes"])
        assert c["source"] == "stored"  # release.json: NVIDIA publishes BF16, FP8 and NVFP4
    pick = d["pick"]
    assert set(pick) == {"budget", "precision", "total_bytes"}
    chosen = next(c for c in cands if (c["budget"], c["precision"]) == (pick["budget"], pick["precision"]))
    assert chosen["fits"] and chosen["total_bytes"] == pick["total_bytes"]
    # the largest budget that fits, then the best precision for it
    order = ["30B", "23B", "12B"]
    assert not any(c["fits"] for c in cands if order.index(c["budget"]) < order.index(pick["budget"]))
    better = ["bf16", "fp8", "nvfp4"][: ["bf16", "fp8", "nvfp4"].index(pick["precision"])]
    assert not any(c["fits"] for c in cands if c["budget"] == pick["budget"] and c["precision"] in better)


def test_picks_are_sane(no_user_profiles):
    """RTX 5080 (16 GiB, 1 GiB reserved for the desktop): 12B NVFP4 is 7.5 GiB, 12B FP8 12.4 GiB and with two
    32K caches, workspace, CUDA context and the 1 GiB margin it still fits (14.5 of 15.0 GiB); 23B NVFP4 (13.7
    GiB of weights, 15.9 in all) does not. So 12B in FP8, still at 64K; at 96K, the extra KV pushes it to NVFP4."""
    def pick(profile, context=32768):
        p = fit.plan_checkpoint(STAR_ELASTIC, elastic_local.hardware.get_profile(profile), context=context)
        return p.pick.budget, p.pick.precision

    assert pick("rtx5080") == ("12B", "fp8")
    assert pick("rtx5080", 65536) == ("12B", "fp8")
    assert pick("rtx5080", 98304) == ("12B", "nvfp4")
    assert pick("rtx5090") == ("30B", "nvfp4")
    assert pick("h100-80gb") == ("30B", "bf16")
    assert pick("rtx3060-12gb") == ("12B", "nvfp4")


def test_human_output_leads_with_the_pick(no_user_profiles, capsys):
    rc, out, _ = run_cli(capsys, "fit", "--profile", "rtx5080")
    assert rc == 0
    first, *rest = out.splitlines()
    assert first.startswith("Profile rtx5080") and "runs 12B in FP8 at 32768 tokens" in first
    assert any(line.startswith("* 12B") and "fp8" in line for line in rest)
    rc, out, _ = run_cli(capsys, "fit", "--profile", "rtx3060-12gb", "--context", "1000000")
    assert rc == 0 and "runs nothing" in out and "with --context" in out


def test_fit_on_this_machine_builds_the_cpu_kernels_once(no_user_profiles, capsys, monkeypatch):
    """The README's first command leaves the CPU decode kernels built, so the first chat after an install
    does not wait for them; said on stderr, so `--json` prints JSON alone; the next `fit` builds nothing."""
    from elastic_local.model import gemv

    if not gemv.runs_here():
        pytest.skip("the kernels are for x86 CPUs with AVX2 and a C compiler")
    monkeypatch.setattr(gemv, "_library", False)  # as in a fresh process
    assert not gemv.library_path().exists()
    rc, out, err = run_cli(capsys, "fit", "--json")
    assert rc == 0 and json.loads(out)["profile"]["kind"] == "cpu"
    assert "building the CPU decode kernels" in err and "built in" in err
    assert gemv.library_path().is_file() and gemv.library() is not None
    monkeypatch.setattr(gemv, "_library", False)
    rc, out, err = run_cli(capsys, "fit")
    assert rc == 0 and out.startswith("This machine") and "building" not in err


def test_shipped_description_is_a_valid_nested_table():
    cfg = NemotronHConfig.from_dir(STAR_ELASTIC)
    budgets = read_budgets(cfg)  # 16-aligned cuts, nested, largest first
    assert list(budgets) == ["30B", "23B", "12B"]
    table = cfg.raw["elastic"]
    assert "NOT published by NVIDIA" in table["note"] and "search" in table["note"]
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_layers, cfg.pattern.count("*")) == (2688, 131072, 52, 6)
    for b, frac in (("23B", 23 / 30), ("12B", 12 / 30)):
        params = next(e["params"] for e in table["budgets"] if e["name"] == b)
        assert abs(params / (frac * table["budgets"][0]["params"]) - 1) <= 0.02
    assert not list(STAR_ELASTIC.glob("*.safetensors"))  # config only


def test_generator_reproduces_the_shipped_files():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packaging"))
    import make_star_elastic_config as gen

    config, _, _ = gen.build()
    assert gen.render(config) == (STAR_ELASTIC / "config.json").read_text()


def test_cache_and_state_bytes_of_the_parent():
    """KV: 6 attention layers x 2 KV heads x 128 x (K and V) x bf16 per token; Mamba: 23 layers of a bf16
    conv window (4 x 6144) and an fp32 SSM state (64 heads x 64 x 128)."""
    cfg = NemotronHConfig.from_dir(STAR_ELASTIC)
    p = fit.plan_checkpoint(STAR_ELASTIC, elastic_local.hardware.get_profile("h100-80gb"), context=32768)
    c = next(c for c in p.candidates if c.budget == "30B")
    assert c.kv_bytes == 2 * (6 * 2 * 128 * 2 * 2) * 32768  # two caches
    assert c.state_bytes == 2 * 23 * (4 * 6144 * 2 + 64 * 64 * 128 * 4)
    assert c.weights_bytes == weight_bytes(cfg, read_budgets(cfg)["30B"], "bf16")


def test_prefill_chunk_is_the_engine_default():
    default = inspect.signature(NemotronH.__init__).parameters["prefill_chunk"].default
    assert fit.PREFILL_CHUNK == default
    w = fit.runtime_workload()
    assert (w.prefill_chunk, w.logits_tokens, w.kv_dtype_bytes, w.conv_dtype_bytes) == (default, 1, 2, 2)
    assert isinstance(w, Workload)


def test_absent_and_malformed_profiles_are_clear_errors(no_user_profiles, capsys, tmp_path):
    rc, out, err = run_cli(capsys, "fit", "--profile", "nope")
    assert rc == 2 and not out and "no hardware profile named 'nope'" in err and "rtx5080" in err
    bad = tmp_path / "mine.toml"
    bad.write_text('description = "x"\nkind = "cuda"\nmemory_gib = -4\ncompute_capability = "8.9"\n'
                   "memory_bandwidth_gbps = 700\n")
    rc, out, err = run_cli(capsys, "fit", "--profile", str(bad))
    assert rc == 2 and str(bad) in err and "'memory_gib'" in err and "Traceback" not in err
    rc, _, err = run_cli(capsys, "fit", str(tmp_path / "nowhere"), "--profile", "rtx5080")
    assert rc == 2 and "config.json" in err


def test_profiles_and_paths_commands(no_user_profiles, capsys):
    rc, out, _ = run_cli(capsys, "profiles")
    assert rc == 0 and all(n in out for n in PROFILES) and "sm_120" in out and "960" in out
    rc, out, _ = run_cli(capsys, "profiles", "--json")
    assert json.loads(out)["rtx5080"]["memory_bytes"] == 16 * GIB
    rc, out, _ = run_cli(capsys, "paths")
    assert rc == 0 and str(no_user_profiles) in out and "ELASTIC_LOCAL_HOME" in out


# ---------------------------------------------------------------- a tiny nested checkpoint, in three precisions

def to_bf16(src: Path, dst: Path) -> Path:
    """The nested file as a BF16 release stores it: bf16 tensors, the router, A_log, D and dt_bias in fp32."""
    shutil.copytree(src, dst)
    for f in dst.glob("model*.safetensors"):
        t = load_file(f)
        save_file({k: v if k.endswith(FP32) else v.to(torch.bfloat16) for k, v in t.items()}, f,
                  metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from elastic_local.ptq.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("fit")
    make_checkpoint(root / "parent", seed=5, **CFG)
    nest(root / "parent", root / "nested", {"half": 0.5, "quarter": 0.3})
    to_bf16(root / "nested", root / "bf16")
    quantize_checkpoint(root / "bf16", root / "fp8", "fp8")
    quantize_checkpoint(root / "bf16", root / "nvfp4", "nvfp4", preset="nano")  # some layers stay BF16
    return root


def file_bytes(path: Path) -> int:
    """Every tensor the directory's safetensors headers hold."""
    return sum(t.nbytes for name, t in index_tensors(path).items() if not name.startswith("mtp."))


def resident_bytes(m) -> int:
    """Bytes of every distinct tensor the loaded network holds."""
    return sum(t.nbytes for t in m.net.tensors())


def weights_of(p, budget: str, precision: str):
    return next(c for c in p.candidates if (c.budget, c.precision) == (budget, precision))


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
def test_weight_bytes_equal_the_tensors_in_the_headers(tiny, precision, tmp_path):
    """For every budget, the planned weight bytes = that budget's slices summed from the nested file's
    headers = every tensor of the budget exported as its own checkpoint."""
    path = tiny / precision
    cfg = NemotronHConfig.from_dir(path)
    p = fit.plan_checkpoint(path, elastic_local.hardware.get_profile("h100-80gb"))
    tensors = checkpoint_tensors(path)
    for name, b in read_budgets(cfg).items():
        planned = weights_of(p, name, precision).weights_bytes
        assert planned == fit.header_bytes(tensors, cfg, b)
        exported = path if name == "full" else slice_budget(path, tmp_path / name, name)[0]
        assert planned == file_bytes(exported), name


def panel_padding(m) -> int:
    """Bytes of the zero columns that pad each column-panel weight's outputs to a multiple of 24: float
    weights' Panels and FP8's (a float32 load's, quant.fp8.FP8Panels), a MoE layer's experts one by one."""
    weights = [w for layer in m.net.layers for w in vars(layer.mixer).values()] + [m.net.lm_head]
    weights = [part for w in weights for part in (w.parts if isinstance(w, RowConcat) else w if isinstance(w, list)
                                                  else [w])]
    return (sum(w.p.nbytes - w.p.element_size() * math.prod(w.shape) for w in weights if isinstance(w, Panels))
            + sum(w.weight.nbytes - math.prod(w.shape) for w in weights if isinstance(w, FP8Panels)))


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
def test_weight_bytes_equal_what_loading_makes_resident(tiny, precision, monkeypatch):
    """The nvfp4 file keeps attention and the Mamba layers feeding it in BF16 (preset nano): they stay so.
    On a CPU with the kernels a bf16 load keeps its BF16 Linear weights in column panels: the same bytes
    but the zero outputs that pad each to a multiple of 24 (which the plan does not count, as for float32)."""
    from elastic_local.engine.load import LAYOUT_ENV

    path = tiny / precision
    cfg = NemotronHConfig.from_dir(path)
    p = fit.plan_checkpoint(path, elastic_local.hardware.get_profile("h100-80gb"))
    for name in read_budgets(cfg):
        planned = weights_of(p, name, precision).weights_bytes
        with monkeypatch.context() as m:
            m.setenv(LAYOUT_ENV, "rows")
            assert planned == resident_bytes(elastic_local.load(path, budget=name, dtype=torch.bfloat16)), name
        panels = elastic_local.load(path, budget=name, dtype=torch.bfloat16)
        if precision == "bf16":  # in panels where the kernels run
            assert (panel_padding(panels) > 0) == (gemv.library() is not None)
        assert resident_bytes(panels) == planned + panel_padding(panels), name


@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
def test_float32_plan_weight_bytes_equal_what_a_float32_load_makes_resident(tiny, precision, monkeypatch):
    """A float32 load keeps the BF16 tensors in float32 and packed ones as they are (the `rows` layout, or a
    machine without the C kernels: the h100 profile's plan). On a CPU with the kernels (the `cpu` profile)
    the default load keeps BF16 Linear weights and the LM head in bf16 column panels, which the plan counts
    at 2 bytes; the panels pad each weight's outputs to a multiple of 24, which the plan does not count
    (0.07-2.5% of the benchmark models' weights, README; more on this tiny one): the margin covers it."""
    from elastic_local.engine.load import LAYOUT_ENV

    path = tiny / precision
    cfg = NemotronHConfig.from_dir(path)
    prof = elastic_local.hardware.get_profile("h100-80gb")
    p, p32 = fit.plan_checkpoint(path, prof), fit.plan_checkpoint(path, prof, float32=True)
    cpu = fit.plan_checkpoint(path, elastic_local.hardware.get_profile("cpu"), float32=True)
    for name in read_budgets(cfg):
        planned = weights_of(p32, name, precision).weights_bytes
        assert planned > weights_of(p, name, precision).weights_bytes
        with monkeypatch.context() as m:
            m.setenv(LAYOUT_ENV, "rows")
            assert planned == resident_bytes(elastic_local.load(path, budget=name, dtype=torch.float32)), name
        m = elastic_local.load(path, budget=name, dtype=torch.float32)
        panels, padding = resident_bytes(m), panel_padding(m)
        assert (padding > 0) == (gemv.library() is not None)
        planned_cpu = weights_of(cpu, name, precision).weights_bytes
        assert planned_cpu <= panels - padding < planned, name
    assert p32.workload.kv_dtype_bytes == 2 * p.workload.kv_dtype_bytes == 4


def test_a_float32_files_cpu_plan_counts_its_linear_weights_at_4_bytes(tiny, monkeypatch):
    """bf16 panels only where the file stores BF16: a float32 file's weights stay float32, and the float32
    plan on the `cpu` profile (the kernels run) counts them so, exactly as the `rows` layout keeps them and
    below what the panels keep (their padding on top). Had it counted 2 bytes, the chat would take float32
    on a machine where it does not fit."""
    from elastic_local.engine.load import LAYOUT_ENV

    path = tiny / "nested"  # nest() of a float32 parent: float32 tensors
    assert not fit.stores_bf16_linears(path)
    assert all(fit.stores_bf16_linears(tiny / p) for p in ("bf16", "fp8", "nvfp4"))
    cpu = fit.plan_checkpoint(path, elastic_local.hardware.get_profile("cpu"), float32=True)
    for name in read_budgets(NemotronHConfig.from_dir(path)):
        planned = weights_of(cpu, name, "bf16").weights_bytes
        with monkeypatch.context() as m:
            m.setenv(LAYOUT_ENV, "rows")
            assert planned == resident_bytes(elastic_local.load(path, budget=name, dtype=torch.float32)), name
        assert planned <= resident_bytes(elastic_local.load(path, budget=name, dtype=torch.float32)), name


def test_stored_and_load_time_sources(tiny):
    prof = elastic_local.hardware.get_profile("rtx5080")
    p = fit.plan_checkpoint(tiny / "bf16", prof)
    src = {(c.budget, c.precision): c.source for c in p.candidates}
    assert {s for (_, prec), s in src.items() if prec == "bf16"} == {"stored"}
    assert {s for (_, prec), s in src.items() if prec != "bf16"} == {"load-time quantization"}
    assert [c.budget for c in p.candidates][::3] == ["full", "half", "quarter"]
    # a quantized file offers its own precision only: no bf16 back, no other format
    for q in ("fp8", "nvfp4"):
        cands = fit.plan_checkpoint(tiny / q, prof).candidates
        assert {(c.precision, c.source) for c in cands} == {(q, "stored")} and len(cands) == 3
    # the modules a quantized file keeps in BF16 come from its headers
    cfg = NemotronHConfig.from_dir(tiny / "nvfp4")
    kept = offers(tiny / "nvfp4")[0].keep
    expected = {f"backbone.layers.{i}.mixer.{w}" for i, k in enumerate(cfg.pattern) for w in
                ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj")
                if any(f"backbone.layers.{i}.mixer.*" == k for k in nano_keep(cfg))
                and is_quantized(f"layers.{i}.mixer.{w}.weight")
                and f"layers.{i}.mixer.{w}.weight" in checkpoint_tensors(tiny / "nvfp4")}
    assert set(kept) == expected and kept


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_load_time_quantization_bytes(tiny, precision):
    """Quantizing the BF16 file while loading makes resident what the planner counts, less the one fp32
    input_scale per Linear that only a calibrated file holds (and beside the panels' padding, which the plan
    does not count: panel_padding)."""
    path = tiny / "bf16"
    cfg = NemotronHConfig.from_dir(path)
    p = fit.plan_checkpoint(path, elastic_local.hardware.get_profile("h100-80gb"))
    for name, b in read_budgets(cfg).items():
        planned = weights_of(p, name, precision).weights_bytes
        linears = sum(is_quantized(n) for n in fit.expected_shapes(cfg, b))
        m = elastic_local.load(path, budget=name, precision=precision, dtype=torch.bfloat16)
        got = resident_bytes(m) - panel_padding(m)
        assert 0 <= planned - got <= 4 * linears, (name, planned, got)


def test_config_only_directory_plans_like_the_weights(tiny, tmp_path):
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(tiny / "bf16" / "config.json", only / "config.json")
    prof = elastic_local.hardware.get_profile("cpu")
    a, b = fit.plan_checkpoint(only, prof), fit.plan_checkpoint(tiny / "bf16", prof)
    assert [dataclasses.astuple(c) for c in a.candidates] == [dataclasses.astuple(c) for c in b.candidates]
    # with a release.json, published precisions are downloads ("stored") with their own kept modules
    (only / "release.json").write_text(json.dumps({"precisions": {"nvfp4": {"exclude_modules": ["lm_head"]}}}))
    c = {(c.budget, c.precision): c.source for c in fit.plan_checkpoint(only, prof).candidates}
    assert c["full", "nvfp4"] == "stored" and c["full", "fp8"] == "load-time quantization"


def least_memory_for(path, profile):
    """`profile` with the least memory (to 64 KiB) in which the plan picks full in bf16."""
    lo, hi = 0, 4 * GIB
    while hi - lo > 2**16:
        mid = (lo + hi) // 2
        c = fit.plan_checkpoint(path, dataclasses.replace(profile, memory_bytes=mid, reserved_bytes=0)).pick
        lo, hi = (lo, mid) if c is not None and (c.budget, c.precision) == ("full", "bf16") else (mid, hi)
    return dataclasses.replace(profile, memory_bytes=hi, reserved_bytes=0)


def test_choose_returns_the_pick_or_says_what_is_missing(tiny, no_user_profiles):
    prof = elastic_local.hardware.get_profile("rtx5080")
    assert fit.choose(tiny / "bf16", profile=prof) == ("full", "bf16", False)  # a GPU computes in bf16
    ram = dataclasses.replace(prof, kind="cpu", compute_capability=None)
    assert fit.choose(tiny / "bf16", profile=ram) == ("full", "bf16", True)  # a CPU in float32 where it fits
    tight = least_memory_for(tiny / "bf16", ram)  # the full bf16 pick just fits: float32 cannot
    assert fit.choose(tiny / "bf16", profile=tight) == ("full", "bf16", False)
    tiny_gpu = dataclasses.replace(prof, memory_bytes=GIB + 2**20, reserved_bytes=0)
    with pytest.raises(ValueError, match="runs nothing"):
        fit.choose(STAR_ELASTIC, profile=tiny_gpu)


def test_fit_on_a_cpu_says_which_dtype_the_chat_computes_in(tiny, no_user_profiles, capsys):
    """`fit` plans bf16; on a CPU profile its elastic-chat line says the chat computes in float32 where that
    fits (with the float32 total), else in bf16 (what `in_float32` decides for the chat and load("auto"))."""
    rc, out, _ = run_cli(capsys, "fit", str(tiny / "bf16"), "--profile", "cpu")
    assert rc == 0 and "--precision bf16    # chat with full in bf16, float32 compute" in out
    p = fit.plan_checkpoint(tiny / "bf16", least_memory_for(tiny / "bf16", elastic_local.hardware.get_profile("cpu")))
    assert fit.next_steps(tiny / "bf16", p)[0].endswith("bf16 compute (float32, exact, does not fit)")


def test_unsupported_quantization_is_a_clear_error(tiny, capsys, tmp_path):
    bad = tmp_path / "w4a16"
    shutil.copytree(tiny / "bf16", bad)
    (bad / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A16_AWQ"}}))
    rc, out, err = run_cli(capsys, "fit", str(bad), "--profile", "rtx5080")
    assert rc == 2 and "W4A16_AWQ" in err and "not supported" in err


def test_info_and_fit_count_the_same_bytes(tiny, no_user_profiles, capsys):
    """`info` and `fit` read one byte count (checkpoint.offers): a stored quantized file, a BF16 file and
    the Star Elastic description give the same numbers in both, precision by precision."""
    prof = elastic_local.hardware.get_profile("h100-80gb")
    for path in (tiny / "nvfp4", tiny / "bf16", STAR_ELASTIC):
        rc, out, _ = run_cli(capsys, "info", str(path), "--json")
        assert rc == 0
        info = {(b["name"], p): n for b in json.loads(out)["budgets"] for p, n in b["bytes"].items()}
        planned = {(c.budget, c.precision): c.weights_bytes for c in fit.plan_checkpoint(path, prof).candidates}
        assert planned and {k: info[k] for k in planned} == planned, path
        assert all(n is None for k, n in info.items() if k not in planned)  # what cannot be loaded


def test_fit_ends_with_the_command_to_run_next(tiny, no_user_profiles, capsys):
    # a directory with weights: the pick as an elastic-chat command
    rc, out, _ = run_cli(capsys, "fit", str(tiny / "bf16"), "--profile", "rtx5080")
    assert rc == 0 and f"elastic-chat {tiny / 'bf16'} --budget full --precision bf16 --device cuda" in out
    # the description holds no weights: where the picked file is published, then the command on it
    rc, out, _ = run_cli(capsys, "fit", "--profile", "rtx5080", "--json")
    steps = json.loads(out)["next"]
    repo = "nvidia/NVIDIA-Nemotron-Labs-3-Elastic-30B-A3B-FP8"  # 12B FP8 is the 5080's pick
    assert f"hf download {repo} --local-dir ~/models/{repo.split('/')[1]}" in steps
    assert any(s.startswith("elastic-chat ~/models/") and "--budget 12B --precision fp8" in s for s in steps)
    assert any(s.startswith("elastic-chat    #") for s in steps)  # the embedded model, meanwhile
    # nothing fits: no command to run
    rc, out, _ = run_cli(capsys, "fit", "--profile", "rtx5080", "--context", "100000000", "--json")
    assert json.loads(out)["next"] == []
