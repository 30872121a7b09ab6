"""The from-scratch trainer: gradients reach every weight of our network, the exported checkpoint is the
trained network, and a resumed run continues exactly where the saved one stopped."""

from __future__ import annotations

import pytest
import torch

from elastic_local.checkpoint.load import load_network
from elastic_local.model.config import NemotronHConfig
from elastic_local.train import pretrain

CONFIG = dict(model_type="nemotron_h", vocab_size=64, hidden_size=32, hybrid_override_pattern="M*E-",
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=32, mamba_num_heads=4,
              mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8, n_routed_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
              routed_scaling_factor=2.5, eos_token_id=2, time_step_limit=[0.0, None])


def examples(n: int = 24) -> list[pretrain.Example]:
    g = torch.Generator().manual_seed(0)
    return [pretrain.Example(torch.randint(3, 64, (int(torch.randint(6, 14, (1,), generator=g)),),
                                           generator=g).tolist(), 3) for _ in range(n)]


def init(tmp_path):
    cfg = NemotronHConfig.from_dict(CONFIG)
    return pretrain.write_checkpoint(tmp_path / "init", CONFIG, pretrain.init_tensors(cfg, 0), None)


def test_every_weight_gets_a_gradient(tmp_path):
    net = load_network(init(tmp_path), dtype=torch.float32)
    params = pretrain.trainable(net)
    ids, tgt = next(pretrain.batches(examples(), 8, seed=0))
    pretrain.loss_of(net, ids, tgt).backward()
    missing = [n for n, t in params.items() if t.grad is None or not t.grad.abs().sum() > 0]
    assert not missing


def test_loss_targets_only_the_completion():
    ex = [pretrain.Example([5, 6, 7, 8, 9], 3), pretrain.Example([5, 6, 7], 2)]
    ids, tgt = next(pretrain.batches(ex, 2, seed=0))
    rows = {tuple(r[r != 0].tolist()): t for r, t in zip(ids, tgt)}
    assert rows[(5, 6, 7, 8, 9)].tolist() == [-100, -100, 8, 9, -100]
    assert rows[(5, 6, 7)].tolist() == [-100, 7, -100, -100, -100]


def test_exported_checkpoint_is_the_trained_network(tmp_path):
    net = load_network(init(tmp_path), dtype=torch.float32)
    params = pretrain.trainable(net)
    with torch.no_grad():  # move every weight off its initial value, A_log included
        for t in params.values():
            t.add_(0.05 * torch.randn_like(t))
    pretrain.refresh(net, params)
    out = pretrain.write_checkpoint(tmp_path / "out", CONFIG, pretrain.hub_tensors(net, params), None)
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():  # trained weights take F.linear, loaded ones may take oneDNN: last-bit differences
        torch.testing.assert_close(net.forward(ids), load_network(out, dtype=torch.float32).forward(ids),
                                   rtol=1e-5, atol=1e-5)


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    src, ex = init(tmp_path), examples()
    tc = pretrain.TrainConfig(steps=4, batch_size=8, lr=1e-2, warmup=1, save_every=2, threads=1)
    straight, p1 = pretrain.train(src, ex, tmp_path / "a", tc, log=lambda _m: None)
    save = pretrain.save_state

    def save_then_die(*args, **kwargs):  # killed right after the save at step 2
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain, "save_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        pretrain.train(src, ex, tmp_path / "b", tc, log=lambda _m: None)
    monkeypatch.undo()
    lines: list[str] = []
    resumed, p2 = pretrain.train(src, ex, tmp_path / "b", tc, log=lines.append)
    assert any("resuming at step 2" in line for line in lines)
    for name in p1:
        assert torch.allclose(p1[name], p2[name], atol=1e-6), name
    assert not list((tmp_path / "b").glob(".state.partial-*"))


def test_resuming_with_another_schedule_is_refused_and_keeps_the_saved_state(tmp_path):
    """A changed learning rate (or steps, seed, batch) would go on from weights trained under the old one;
    the saved run names what changed and stays as it was."""
    src, ex = init(tmp_path), examples()
    tc = pretrain.TrainConfig(steps=2, batch_size=8, lr=1e-2, warmup=1, save_every=2, threads=1)
    pretrain.train(src, ex, tmp_path / "w", tc, log=lambda _m: None)
    saved = (tmp_path / "w" / "state" / "state.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"steps 2 -> 4; lr 0.01 -> 0.005") as err:
        pretrain.train(src, ex, tmp_path / "w", pretrain.TrainConfig(**{**tc.__dict__, "lr": 5e-3, "steps": 4}),
                       log=lambda _m: None)
    assert str(tmp_path / "w" / "state") in str(err.value)
    assert (tmp_path / "w" / "state" / "state.safetensors").read_bytes() == saved
    lines: list[str] = []  # what does not change the result may change: the thread count, the save interval
    pretrain.train(src, ex, tmp_path / "w", pretrain.TrainConfig(**{**tc.__dict__, "threads": 2, "save_every": 1}),
                   log=lines.append)
    assert any("resuming at step 2" in line for line in lines)
