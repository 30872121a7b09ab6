"""Soft prefix masks on the one network: one-hot weights are the runtime's prefix views, mixes are
differentiable, and gradients reach both the router and the shared weights."""

from dataclasses import replace

import pytest
import torch
from tiny import ALIGNED, make_checkpoint

from elastic_local.checkpoint.load import load_network
from elastic_local.model import Budget, count_params
from elastic_local.model.soft import SoftSize
from elastic_local.train.loop import Student
from elastic_local.train.router import ROUTED_AXES, Router
from elastic_local.train.weights import make_trainable

IDS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3))
CUTS = {"mamba_heads": 4, "attention_heads": 2, "experts": 4, "expert_channels": 16, "shared_channels": 32,
        "mlp_channels": 48}


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    path = tmp_path_factory.mktemp("soft") / "p"
    make_checkpoint(path, seed=5, **ALIGNED)
    return load_network(path)


@pytest.mark.parametrize("axis", sorted(CUTS))
def test_one_hot_soft_size_equals_the_prefix_view(net, axis):
    full = Budget.full(net.cfg)
    size = CUTS[axis]
    layers = [replace(s, **{axis: size}) if getattr(s, axis) else s for s in full.layers]
    sliced = replace(full, name="cut", layers=tuple(layers))
    full_size = next(getattr(s, axis) for s in full.layers if getattr(s, axis))
    sizes = torch.tensor(sorted({size, full_size // 2, full_size}))
    onehot = (sizes == size).float()
    soft = [{axis: SoftSize(sizes, onehot)} if getattr(s, axis) else None for s in full.layers]
    with torch.no_grad():
        ref = net.forward(IDS, budget=sliced)
        got = net.forward(IDS, soft=soft)
        unmasked = net.forward(IDS)
    assert not torch.allclose(ref, unmasked, atol=1e-3)  # the cut matters
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_a_mix_of_sizes_lies_between_its_candidates(net):
    """Per unit the soft mask is the probability that the unit is kept: weights 0.25/0.75 over an MLP's
    48 and 64 channels are exactly 0.25 x (48-channel output) + 0.75 x (full output)."""
    full = Budget.full(net.cfg)
    i = next(k for k, s in enumerate(full.layers) if s.kind == "-")
    sizes = torch.tensor([48, 64])
    soft = [None] * len(full.layers)
    soft[i] = {"mlp_channels": SoftSize(sizes, torch.tensor([0.25, 0.75]))}
    from elastic_local.model.moe import mlp

    w = net.layers[i].mixer
    x = torch.randn(1, 3, 64)
    mixed = mlp(x, w.up, w.down, 64, soft[i]["mlp_channels"].keep(64))
    torch.testing.assert_close(mixed, 0.25 * mlp(x, w.up, w.down, 48) + 0.75 * mlp(x, w.up, w.down, 64))


def test_gradients_reach_the_router_and_the_shared_weights(tmp_path):
    make_checkpoint(tmp_path / "p", seed=6, **ALIGNED)
    net = load_network(tmp_path / "p")
    teacher = load_network(tmp_path / "p")
    params = make_trainable(net)
    router = Router(net.cfg, {"half": 0.5, "big": 0.8}, ROUTED_AXES)  # every axis the router can size
    student = Student(net, params, router)
    with torch.no_grad():
        tlogp = torch.log_softmax(teacher.forward(IDS), -1)
    full = float(sum(p.numel() for p in params.values()))
    loss, kd, cost = student(IDS, torch.ones(IDS.shape), tlogp, 0.5, 0.5 * full, 1.0, 1.0,
                             torch.Generator().manual_seed(0), float(IDS.numel()), 1.0, 0.05)
    loss.backward()
    assert kd > 0 and cost is not None
    assert set(router.mlps) == {"hidden", "mamba_heads", "attention_heads", "experts", "expert_channels",
                                "shared_channels", "mlp_channels"}
    for a, m in router.mlps.items():
        assert m[0].weight.grad is not None and m[0].weight.grad.abs().sum() > 0, a
    shared = ["embeddings.weight", "layers.0.mixer.in_proj", "layers.1.mixer.qkv", "layers.2.mixer.up",
              "layers.4.mixer.up", "lm_head.weight"]
    for name in shared:
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name


def test_a_bf16_autocast_step_matches_the_float32_step(tmp_path):
    """The GPU recipe (bf16 autocast around the forwards, float32 master weights), run on the CPU: the loss
    is the float32 one within bf16 rounding and every gradient is finite."""
    from elastic_local.train.recipe import Recipe

    assert Recipe(autocast="auto").autocast_on("cuda:0") and not Recipe(autocast="auto").autocast_on("cpu")
    make_checkpoint(tmp_path / "p", seed=6, **ALIGNED)
    teacher = load_network(tmp_path / "p")
    with torch.no_grad():
        tlogp = torch.log_softmax(teacher.forward(IDS), -1)
    losses = []
    for bf16 in (False, True):
        net = load_network(tmp_path / "p")
        params = make_trainable(net)
        torch.manual_seed(0)
        student = Student(net, params, Router(net.cfg, {"half": 0.5, "big": 0.8}))
        full = float(sum(p.numel() for p in params.values()))
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss, kd, _ = student(IDS, torch.ones(IDS.shape), tlogp, 0.5, 0.5 * full, 1.0, 1.0,
                                  torch.Generator().manual_seed(0), float(IDS.numel()), 1.0, 0.05)
        loss.backward()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in params.values() if p.grad is not None)
        losses.append(float(kd))
    assert losses[1] != losses[0] and abs(losses[1] - losses[0]) <= 0.05 * losses[0]  # bf16 ran, close


def test_one_hot_soft_hidden_width_equals_the_prefix_view(net):
    """The hidden width: embeddings, every norm (over the kept channels) and every block's output."""
    full = Budget.full(net.cfg)
    sizes = torch.tensor([32, 48, 64])
    with torch.no_grad():
        ref = net.forward(IDS, budget=replace(full, name="cut", hidden=48))
        got = net.forward(IDS, soft_hidden=SoftSize(sizes, torch.tensor([0.0, 1.0, 0.0])))
        mixed = net.forward(IDS, soft_hidden=SoftSize(sizes, torch.tensor([0.0, 0.5, 0.5])))
    assert not torch.allclose(ref, net.forward(IDS), atol=1e-3)  # the cut matters
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    assert mixed.isfinite().all() and not torch.allclose(mixed, ref, atol=1e-3)


def test_every_axis_hard_configuration_runs_as_its_budget_view(net):
    """A router over every axis it can size (hidden width, heads, experts, channels): each hard configuration
    it exports is nested in the larger one, and the training-mode forward with its one-hot masks equals the
    runtime's prefix views of that budget."""
    torch.manual_seed(1)
    router = Router(net.cfg, {"big": 0.8, "small": 0.45}, ROUTED_AXES)
    big, small = router.budgets()
    assert small.fits_in(big)
    for b in (big, small):
        w = router.weights_of(b)
        assert router.soft_hidden(w) is not None
        with torch.no_grad():
            train_mode = net.forward(IDS, soft=router.soft_layers(w), soft_hidden=router.soft_hidden(w))
            torch.testing.assert_close(train_mode, net.forward(IDS, budget=b), atol=2e-5, rtol=1e-5)
        assert abs(float(router.expected_params(w)) - count_params(net.cfg, b)[0]) < 1  # exact for one-hot


def test_the_size_penalty_still_moves_a_router_whose_samples_have_saturated(tmp_path):
    """At the end of the anneal (temperature 0.05, logit scale 10) a router sure of the full sizes samples
    exact one-hots, which pass no gradient; the penalty prices the argmax configuration (what ships) through
    the router's plain softmax, so it still brings that configuration to its target."""
    make_checkpoint(tmp_path / "p", seed=6, **ALIGNED)
    net = load_network(tmp_path / "p")
    params = make_trainable(net)
    torch.manual_seed(2)
    router = Router(net.cfg, {"half": 0.5, "big": 0.8})
    with torch.no_grad():  # every row's logits favour the full size by 3
        for a, m in router.mlps.items():
            bias = m[2].bias.view(-1, len(router.choices[a]))
            bias.zero_()
            bias[:, -1] = 3.0
    student = Student(net, params, router)
    full = float(count_params(net.cfg, Budget.full(net.cfg))[0])
    target, dead_zone = 0.5 * full, 0.1

    def shipped() -> float:
        return float(router.expected_params(router.hard(0.5)))

    samples = router.sample(0.5, 0.05, 10.0, torch.Generator().manual_seed(0))
    assert all(bool(((w == 0) | (w == 1)).all()) for w in samples.values())  # saturated: exact one-hots
    assert shipped() / target - 1 > 0.5
    with torch.no_grad():
        tlogp = torch.log_softmax(net.forward(IDS), -1)
    opt = torch.optim.Adam(router.parameters(), lr=0.05)
    for step in range(60):
        loss, _, _ = student(IDS, torch.ones(IDS.shape), tlogp, 0.5, target, 0.05, 10.0,
                             torch.Generator().manual_seed(step), float(IDS.numel()), 100.0, dead_zone)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(shipped() / target - 1) <= dead_zone
