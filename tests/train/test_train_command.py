"""`elastic-local train` end to end on a tiny model: the exported table is the router's hard choice,
the file's budgets run as the training-mode hard masks did, an unseen budget is added from the router,
and a run killed with SIGKILL resumes to exactly where an uninterrupted one ends."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from train_util import make_parent, tensors, train_args

import elastic_local
from elastic_local.checkpoint.load import load_network
from elastic_local.cli import main
from elastic_local.elastic.table import read_budgets
from elastic_local.model import NemotronHConfig, count_params
from elastic_local.train.router import Router
from elastic_local.train.weights import make_trainable

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_parent(root)
    assert main(train_args(root, "out")) == 0
    return root


def test_output_loads_with_the_given_budgets_plus_full(trained, capsys):
    m = elastic_local.load(trained / "out")
    assert m.budgets == ["full", "big", "small"]
    assert main(["info", str(trained / "out"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [b["name"] for b in info["budgets"]] == ["full", "big", "small"]
    table = json.loads((trained / "out" / "config.json").read_text())["elastic"]
    assert set(table["training"]["heldout_kd"]) == {"full", "big", "small"}


def test_exported_table_is_the_routers_hard_configuration(trained):
    cfg = NemotronHConfig.from_dir(trained / "out")
    table = read_budgets(cfg)
    router = Router.load(trained / "out", cfg)
    assert [b for b in router.budgets()] == [table["big"].renamed("big"), table["small"].renamed("small")]
    # and the router saved with the checkpoint is the one training ended with
    from elastic_local.train.state import load_state

    state, _ = load_state(trained / "out.train" / "state")
    for k, v in router.state_dict().items():
        torch.testing.assert_close(v, state[f"router.{k}"], atol=0, rtol=0)


def test_exported_budget_forward_equals_training_forward_with_hard_masks(trained):
    cfg = NemotronHConfig.from_dir(trained / "out")
    table = read_budgets(cfg)
    router = Router.load(trained / "out", cfg)
    net = load_network(trained / "out")
    make_trainable(net)  # training mode: parameters, soft masks
    exported = elastic_local.load(trained / "out")
    for name in ("big", "small"):
        soft = router.soft_layers(router.weights_of(table[name]))
        with torch.no_grad():
            train_mode = net.forward(IDS, soft=soft)
        torch.testing.assert_close(exported.logits(IDS, budget=name), train_mode, atol=2e-5, rtol=1e-5)


def test_unseen_budget_is_added_between_its_neighbours(trained, tmp_path, capsys):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(trained / "out", d)
    assert main(["budget", str(d), "0.65", "--name", "mid"]) == 0
    cfg = NemotronHConfig.from_dir(d)
    table = read_budgets(cfg)
    assert set(table) == {"full", "big", "mid", "small"}
    assert table["small"].fits_in(table["mid"]) and table["mid"].fits_in(table["big"])
    params = {n: count_params(cfg, b)[0] for n, b in table.items()}
    assert params["small"] <= params["mid"] <= params["big"]
    assert elastic_local.load(d).logits(IDS, budget="mid").isfinite().all()
    assert main(["budget", str(d), "0.95"]) == 2  # outside what the router was trained on
    assert "outside the trained range" in capsys.readouterr().err


def test_router_interpolates_one_hots_between_trained_budgets(trained):
    router = Router.load(trained / "out", NemotronHConfig.from_dir(trained / "out"))
    assert router.one_hot(0.8).tolist() == [1.0, 0.0]
    x = router.one_hot(0.7)
    torch.testing.assert_close(x, torch.tensor([0.6, 0.4]))


def test_kill_9_then_the_same_command_ends_where_an_uninterrupted_run_ends(trained):
    root = trained
    # both runs in subprocesses on one thread: a parallel reduction's order may differ between processes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = subprocess.run([sys.executable, "-m", "elastic_local.cli", *train_args(root, "whole")],
                           capture_output=True, text=True, env=env)
    assert whole.returncode == 0, whole.stderr
    cmd = [sys.executable, "-m", "elastic_local.cli", *train_args(root, "killed")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    latest = root / "killed.train" / "state" / "latest"
    deadline = time.monotonic() + 600
    while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (root / "killed").exists()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stderr
    a, b = tensors(root / "whole"), tensors(root / "killed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_trained_budgets_meet_their_parameter_targets_loosely(trained):
    cfg = NemotronHConfig.from_dir(trained / "out")
    table = read_budgets(cfg)
    full = count_params(cfg, table["full"])[0]
    assert count_params(cfg, table["small"])[0] < count_params(cfg, table["big"])[0] < full


def test_the_report_gives_each_budget_s_distance_from_its_target_and_warns_outside_the_dead_zone(trained):
    from elastic_local.train.cli import trained_report
    from elastic_local.train.recipe import Recipe

    cfg = NemotronHConfig.from_dir(trained / "out")
    table = read_budgets(cfg)
    n = {name: count_params(cfg, b)[0] for name, b in table.items()}
    lines, warnings = trained_report(trained / "out", Recipe(dead_zone=1.0))
    assert not warnings
    off = n["small"] / (0.55 * n["full"]) - 1
    assert f"  small: {n['small']:,} parameters ({off:+.2%} from its target 0.55 = {round(0.55 * n['full']):,})" \
        in "\n".join(lines)
    assert lines[0].startswith(f"  full: {n['full']:,} parameters, held-out KD ")
    tight = abs(off) / 2
    _, warnings = trained_report(trained / "out", Recipe(dead_zone=tight))
    assert any(w.startswith(f"small landed {off:+.2%} from its target, outside the dead zone") for w in warnings)


def test_a_run_over_every_axis_exports_what_it_trained(trained):
    """Hidden width and expert count routed too (recipe router_axes): the exported table is the router's hard
    choice and each budget runs as the training-mode forward with its one-hot masks did."""
    from elastic_local.train.router import ROUTED_AXES

    recipe = trained / "all-axes.toml"
    recipe.write_text((trained / "recipe.toml").read_text() + f"router_axes = {json.dumps(list(ROUTED_AXES))}\n")
    args = train_args(trained, "all")
    args[args.index("--recipe") + 1] = str(recipe)
    assert main(args) == 0
    cfg = NemotronHConfig.from_dir(trained / "all")
    table = read_budgets(cfg)
    router = Router.load(trained / "all", cfg)
    assert set(router.axes) == set(ROUTED_AXES)
    assert router.budgets() == [table["big"].renamed("big"), table["small"].renamed("small")]
    net = load_network(trained / "all")
    make_trainable(net)
    exported = elastic_local.load(trained / "all")
    for name in ("big", "small"):
        w = router.weights_of(table[name])
        with torch.no_grad():
            train_mode = net.forward(IDS, soft=router.soft_layers(w), soft_hidden=router.soft_hidden(w))
        torch.testing.assert_close(exported.logits(IDS, budget=name), train_mode, atol=2e-5, rtol=1e-5)


def test_dtype_sets_the_recipes_autocast_and_bfloat16_runs_the_forwards_in_it(trained, monkeypatch):
    """--dtype bfloat16 on the CPU: the job records autocast bf16 and the loop's forwards run under an enabled
    bf16 autocast (float32 master weights); float32 turns it off; no flag leaves the recipe's (auto)."""
    import elastic_local.train.loop as loop
    from elastic_local.train.cli import AUTOCAST_OF_DTYPE

    entered = []
    real = torch.autocast

    def recording(device_type, dtype=None, enabled=True, **kw):
        entered.append((device_type, dtype, enabled))
        return real(device_type, dtype, enabled=enabled, **kw)

    monkeypatch.setattr(torch, "autocast", recording)
    assert main(train_args(trained, "bf16", 1, "--dtype", "bfloat16")) == 0
    assert json.loads((trained / "bf16.train" / "job.json").read_text())["recipe"]["autocast"] == "bf16"
    assert ("cpu", torch.bfloat16, True) in entered
    assert elastic_local.load(trained / "bf16").budgets == ["full", "big", "small"]

    seen = {}
    monkeypatch.setattr(loop, "train", lambda src, out, data, budgets, r, **_: seen.update(autocast=r.autocast))
    for flag, want in (("float32", "off"), ("auto", "auto"), (None, "auto")):
        seen.clear()
        assert main(train_args(trained, f"parse-{flag}", 1, *(("--dtype", flag) if flag else ()))) == 0
        assert seen["autocast"] == want == (AUTOCAST_OF_DTYPE[flag] if flag else "auto")


def test_the_progress_line_shows_each_budget_s_shipped_size_beside_its_loss(capsys):
    from elastic_local.train.loop import Progress

    prog = Progress(total=3, every=1)
    prog.update(0, "full", 0.05, 100)
    assert "size" not in capsys.readouterr().err  # the full model has no size to learn
    prog.update(1, "small", 0.4, 100, 0.4123)
    prog.update(2, "mid", 0.3, 100, 0.7751)
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("step 3/3 | kd full 0.0500 small 0.4000 mid 0.3000 | size small 41.2% mid 77.5% | ")
