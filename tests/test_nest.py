"""Nested elastic checkpoints: importance order, function preservation, budgets, zero-shot slicing."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from tiny import ALIGNED, hf_logits, make_checkpoint

import elastic_local
from elastic_local.elastic.nest import nest
from elastic_local.elastic.slice import slice_budget
from elastic_local.elastic.table import BudgetTableError
from elastic_local.model import count_params

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(11))
FRACTIONS = {"half": 0.5, "quarter": 0.3}


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    root = tmp_path_factory.mktemp("nest")
    hf = make_checkpoint(root / "parent", seed=21, **ALIGNED)
    nest(root / "parent", root / "nested", FRACTIONS)
    return root, hf


def test_full_budget_of_the_nested_file_is_the_parent(nested):
    from transformers import NemotronHForCausalLM

    root, hf = nested
    ref = hf_logits(hf, IDS)
    m = elastic_local.load(root / "nested")
    assert m.budgets == ["full", "half", "quarter"]
    torch.testing.assert_close(m.logits(IDS), ref, atol=1e-4, rtol=0)
    # and any Nemotron-H loader reads the nested file unchanged
    other = NemotronHForCausalLM.from_pretrained(root / "nested", dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(other, IDS), ref, atol=1e-4, rtol=0)


def test_budgets_nest_and_meet_their_targets(nested):
    root, _ = nested
    m = elastic_local.load(root / "nested")
    parent = count_params(m.config, m.budget("full"))[0]
    table = json.loads((root / "nested" / "config.json").read_text())["elastic"]["budgets"]
    assert [b["name"] for b in table] == ["full", "half", "quarter"]
    for name, frac in FRACTIONS.items():
        b = m.budget(name)
        assert abs(count_params(m.config, b)[0] / (frac * parent) - 1) <= 0.02
        assert table[[t["name"] for t in table].index(name)]["params"] == count_params(m.config, b)[0]
    assert m.budget("quarter").fits_in(m.budget("half")) and m.budget("half").fits_in(m.budget("full"))
    assert (root / "nested" / "importance.safetensors").is_file()


@pytest.mark.parametrize("name", ["half", "quarter"])
def test_sliced_export_loaded_by_transformers_equals_the_budget(nested, name, tmp_path):
    from transformers import NemotronHForCausalLM

    root, _ = nested
    out, portable = slice_budget(root / "nested", tmp_path / name, name)
    assert portable
    oracle = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = elastic_local.load(root / "nested").logits(IDS, budget=name)
    torch.testing.assert_close(ours, hf_logits(oracle, IDS), atol=1e-4, rtol=0)
    # the export is itself elastic: its smaller budgets survive and it loads here too
    small = elastic_local.load(out)
    assert small.budgets[0] == name
    torch.testing.assert_close(small.logits(IDS), ours, atol=1e-4, rtol=0)


def test_loading_one_budget_reads_only_its_slices(nested):
    root, _ = nested
    full = elastic_local.load(root / "nested")
    m = elastic_local.load(root / "nested", budget="half")
    assert m.budgets == ["half", "quarter"]
    b = m.budget("half")
    assert m.net.embed.shape == (96, b.hidden)
    E = next(s for s in b.layers if s.kind == "E")
    assert m.net.layers[2].mixer.up.shape == (E.experts, E.expert_channels, b.hidden)
    for name in ("half", "quarter"):
        torch.testing.assert_close(m.logits(IDS, budget=name), full.logits(IDS, budget=name), atol=1e-5, rtol=0)
    with pytest.raises(KeyError, match=r"budget 'full' is not resident: this load holds \['half', 'quarter'\] "
                                       r"\(budget 'half'\); load with budget 'full', or none"):
        m.logits(IDS, budget="full")


def test_heterogeneous_budgets_slice_to_per_layer_configs(tmp_path):
    make_checkpoint(tmp_path / "p", seed=22, **ALIGNED)
    nest(tmp_path / "p", tmp_path / "n", {"small": 0.4}, heterogeneous=True)
    m = elastic_local.load(tmp_path / "n")
    out, portable = slice_budget(tmp_path / "n", tmp_path / "s", "small")
    cfg = json.loads((out / "config.json").read_text())
    s = m.budget("small")
    if not portable:
        assert len(cfg["block_configs"]) == sum(x.enabled for x in s.layers)
    torch.testing.assert_close(elastic_local.load(out).logits(IDS), m.logits(IDS, budget="small"), atol=1e-4, rtol=0)


def test_unknown_budget_is_an_error(nested, tmp_path):
    root, _ = nested
    with pytest.raises(KeyError, match=r"unknown budget '12B'.*\['full', 'half', 'quarter'\]"):
        slice_budget(root / "nested", tmp_path / "x", "12B")
    with pytest.raises(KeyError, match="unknown budget"):
        elastic_local.load(root / "nested", budget="12B")


def _edit_table(root, tmp_path, edit):
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(root / "nested", dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["elastic"]["budgets"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_budget_table_that_does_not_match_the_tensors_is_an_error(nested, tmp_path):
    root, _ = nested
    dst = _edit_table(root, tmp_path, lambda b: b[1]["sizes"].update(experts=99))
    with pytest.raises(BudgetTableError, match=r"budget 'half': layer 2 sizes .* exceed"):
        elastic_local.load(dst)


def test_a_cut_off_the_16_grid_is_an_error(nested, tmp_path):
    root, _ = nested
    dst = _edit_table(root, tmp_path, lambda b: b[1]["sizes"].update(expert_channels=24))
    with pytest.raises(BudgetTableError, match=r"cuts expert_channels to 24, not a multiple of 16"):
        elastic_local.load(dst)


def test_a_failed_write_leaves_no_checkpoint_behind(nested, tmp_path):
    root, _ = nested

    def boom(done, total, what):
        if done > 5:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        slice_budget(root / "nested", tmp_path / "out", "half", progress=boom)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_nest_refuses_bad_fractions_and_axes(tmp_path):
    make_checkpoint(tmp_path / "p", seed=23, **ALIGNED)
    with pytest.raises(ValueError, match=r"big=1.5: a fraction .* must be in \(0, 1\)"):
        nest(tmp_path / "p", tmp_path / "n", {"big": 1.5})
    with pytest.raises(ValueError, match=r"unknown axes \['width'\]"):
        nest(tmp_path / "p", tmp_path / "n", {"half": 0.5}, axes=("width",))
    with pytest.raises(ValueError, match="is the full model's name"):
        nest(tmp_path / "p", tmp_path / "n", {"full": 0.5})
    assert not (tmp_path / "n").exists()


# head widths whose cuts are off the 16-grid one head at a time: Mamba head_dim x groups = 12 (cut 4 ranks),
# 24 with 3 groups (cut 2 ranks), attention head_dim x KV = 24 (cut 2 ranks); budgets must still land on it
OFF_GRID = {
    "mamba_12": dict(ALIGNED, mamba_head_dim=6, mamba_num_heads=16),
    "mamba_24_three_groups": dict(ALIGNED, mamba_num_heads=12, n_groups=3, mamba_head_dim=8),
    "attention_24": dict(ALIGNED, num_attention_heads=8, num_key_value_heads=2, head_dim=12),
}


@pytest.mark.parametrize("name", sorted(OFF_GRID))
def test_nest_cuts_heads_on_the_16_grid_for_any_head_width(tmp_path, name):
    from transformers import NemotronHForCausalLM

    make_checkpoint(tmp_path / "parent", seed=4, **OFF_GRID[name])
    nest(tmp_path / "parent", tmp_path / "nested", {"half": 0.5},
         axes=("hidden", "mamba_heads", "attention_heads", "expert_channels", "mlp_channels"))
    m = elastic_local.load(tmp_path / "nested")  # the table is checked on the 16-grid while loading
    out, portable = slice_budget(tmp_path / "nested", tmp_path / "half", "half")
    oracle = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(m.logits(IDS, budget="half"), hf_logits(oracle, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(OFF_GRID))
def test_every_head_cut_the_search_offers_is_on_the_16_grid(name):
    from tiny import hf_config

    from elastic_local.elastic.search import _candidates
    from elastic_local.elastic.table import check_alignment
    from elastic_local.model import Budget
    from elastic_local.model.config import NemotronHConfig

    cfg = NemotronHConfig.from_dict(hf_config(**OFF_GRID[name]).to_dict())
    b, cuts = Budget.full(cfg), 0
    scores = {(i, a): torch.ones(64) for i in range(len(cfg.pattern)) for a in ("mamba_heads", "attention_heads")}
    while True:  # keep cutting the head axes as far as they go
        cands = [c for _, c in _candidates(cfg, b, scores, ("mamba_heads", "attention_heads"), False, None)]
        if not cands:
            break
        for c in cands:
            check_alignment(cfg, c)
        b, cuts = cands[0], cuts + 1
    assert cuts >= 1


def test_nest_slice_and_quantize_commands_write_checkpoints_that_load(tmp_path, capsys):
    from elastic_local.cli import main

    make_checkpoint(tmp_path / "parent", seed=21, **ALIGNED)
    nested, half, q = tmp_path / "nested", tmp_path / "half", tmp_path / "nvfp4"
    assert main(["nest", str(tmp_path / "parent"), str(nested), "--budget", "half=0.5"]) == 0
    assert "half" in capsys.readouterr().out  # nest ends with `info` of what it wrote
    assert main(["slice", str(nested), str(half), "--budget", "half"]) == 0
    assert main(["quantize", str(nested), str(q), "--precision", "nvfp4"]) == 0
    m = elastic_local.load(nested)
    torch.testing.assert_close(elastic_local.load(half).logits(IDS), m.logits(IDS, budget="half"), atol=1e-5, rtol=0)
    assert elastic_local.load(q).budgets == ["full", "half"]
    assert main(["slice", str(nested), str(half), "--budget", "half"]) == 2  # exists: refused without --overwrite
    assert "--overwrite" in capsys.readouterr().err


def test_nest_given_its_importance_writes_what_scoring_writes(nested, tmp_path):
    from elastic_local.checkpoint.load import load_network
    from elastic_local.elastic.importance import calibration_ids, score
    from elastic_local.model.config import NemotronHConfig

    root, _ = nested
    parent = root / "parent"
    ids, source = calibration_ids(None, parent, NemotronHConfig.from_dir(parent).vocab_size, 16384)
    imp = score(load_network(parent, dtype=torch.float32), ids)
    imp.source = source
    out = nest(parent, tmp_path / "given", FRACTIONS, importance=imp)
    assert (out / "model.safetensors").read_bytes() == (root / "nested" / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((root / "nested" / "config.json").read_text())
    # and the scores given are the ones used: every Mamba layer's heads ranked the other way round puts
    # other heads first (a different file), the full budget still the parent
    flipped = replace(imp, layers={i: {a: (-t if a == "mamba_heads" else t) for a, t in axes.items()}
                                   for i, axes in imp.layers.items()})
    other = nest(parent, tmp_path / "flipped", FRACTIONS, importance=flipped)
    assert (other / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()
    torch.testing.assert_close(elastic_local.load(other).logits(IDS), elastic_local.load(out).logits(IDS),
                               atol=1e-4, rtol=0)


def demo_build():
    """packaging/demo/build.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    file = Path(__file__).resolve().parents[1] / "packaging" / "demo" / "build.py"
    spec = importlib.util.spec_from_file_location("demo_build", file)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def test_the_demo_build_s_naive_baseline_slices_the_parent_unpermuted(nested):
    """packaging/demo/build.py --naive: the same budgets, nothing permuted (the parent's tensors byte for
    byte), where nest's importance order permutes them."""
    from safetensors.torch import load_file

    build = demo_build()
    root, _ = nested
    naive = build.naive({"nest": FRACTIONS}, root)

    def tensors(d):
        return load_file(next(d.glob("model*.safetensors")))

    parent, sliced, permuted = tensors(root / "parent"), tensors(naive), tensors(root / "nested")
    assert parent.keys() == sliced.keys() and all(torch.equal(parent[k], sliced[k]) for k in parent)
    assert not all(torch.equal(parent[k], permuted[k]) for k in parent)
    assert elastic_local.load(naive).budgets == ["full", "half", "quarter"]


def test_the_demo_build_refuses_to_resume_its_folder_under_another_recipe(tmp_path):
    """Every stage skips an output that exists: a changed learning rate must not silently reuse the parent
    the old one trained. Settings that change nothing computed (threads) may change."""
    build = demo_build()
    recipe = {"seed": 0, "train": {"lr": 2e-3, "steps": 3600, "threads": 1}, "nest": {"mid": 0.77}}
    build.check_recipe(recipe, tmp_path / "out")
    build.check_recipe({**recipe, "train": {**recipe["train"], "threads": 2}}, tmp_path / "out")
    with pytest.raises(SystemExit, match=r"out was built from another recipe \(train.lr 0.002 -> 0.001; "
                                         r"train.steps 3600 -> None\)"):
        build.check_recipe({**recipe, "train": {"lr": 1e-3, "threads": 1}}, tmp_path / "out")


def test_the_same_calibration_in_two_folders_nests_byte_identical_files(nested, tmp_path):
    """The calibration is recorded by its file's name: a build folder's path in the shipped files made the
    same build in two folders differ."""
    root, _ = nested
    ids = torch.randint(0, 96, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        calib = tmp_path / where / "calib.json"
        calib.write_text(json.dumps(ids))
        outs.append(nest(root / "parent", tmp_path / where / "nested", FRACTIONS, calib=calib))
    # the scores' metadata too: safetensors writes several entries in an order that changes from call to call
    for name in ("config.json", "model.safetensors", "importance.safetensors"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    assert json.loads((outs[0] / "config.json").read_text())["elastic"]["calibration"]["source"] == "calib.json"
    meta = json.loads(safe_open(outs[0] / "importance.safetensors", "pt").metadata()["importance"])
    assert meta["source"] == "calib.json" and meta["tokens"] == 600
