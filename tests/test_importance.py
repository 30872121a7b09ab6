"""Importance is not decorative: units made useless on purpose are ranked last and cut first, and an
importance-ordered budget stays closer to its parent than the same sizes cut from the unordered model."""

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import ALIGNED, make_checkpoint

import elastic_local
from elastic_local.elastic.nest import nest

DEAD_HIDDEN = torch.arange(3, 64, 4)  # 16 channels, one NVFP4 block's worth
DEAD_EXPERT = 5


def cripple(path) -> None:
    """Zero some channels, heads and an expert so that they cannot matter."""
    f = path / "model.safetensors"
    sd = load_file(f)
    for k, v in sd.items():
        if k.endswith(("norm.weight", "norm_f.weight")) and "mixer" not in k:
            v[DEAD_HIDDEN] = 0  # every block input and the final norm ignore these channels
        elif k == "backbone.layers.0.mixer.norm.weight":
            v[8:16] = 0  # head 1 of group 0 (heads 0-3 form group 0, 8 channels each)
            v[48:56] = 0  # head 6 = head 2 of group 1
        elif k == "backbone.layers.1.mixer.q_proj.weight":
            v[16:32] = 0  # query head 1 (KV group 0)
        elif k == "backbone.layers.1.mixer.o_proj.weight":
            v[:, 16:32] = 0
        elif k == f"backbone.layers.2.mixer.experts.{DEAD_EXPERT}.down_proj.weight":
            v.zero_()
        elif k == "backbone.layers.2.mixer.shared_experts.up_proj.weight":
            v[:16] = 0
        elif k == "backbone.layers.4.mixer.up_proj.weight":
            v[32:48] = 0
    save_file(sd, f, metadata={"format": "pt"})


def test_useless_units_are_ranked_last_and_cut_first(tmp_path):
    make_checkpoint(tmp_path / "p", seed=31, **ALIGNED)
    cripple(tmp_path / "p")
    nest(tmp_path / "p", tmp_path / "n", {"small": 0.6})
    sd = load_file(tmp_path / "n" / "model.safetensors")
    # hidden: the 16 dead channels are the last 16 of the nested order
    norm = sd["backbone.layers.0.norm.weight"]
    assert torch.all(norm[-16:] == 0) and torch.all(norm[:-16] != 0)
    # Mamba: the dead head is last inside each group (4 heads of 8 channels per group)
    mn = sd["backbone.layers.0.mixer.norm.weight"].view(2, 4, 8)
    assert torch.all(mn[:, 3] == 0) and torch.all(mn[:, :3] != 0)
    # attention: the dead query head is last within its KV group
    q = sd["backbone.layers.1.mixer.q_proj.weight"].view(2, 2, 16, 64)
    assert torch.all(q[0, 1] == 0) and torch.all(q[0, 0] != 0)
    # experts: the dead expert is last
    assert torch.all(sd["backbone.layers.2.mixer.experts.7.down_proj.weight"] == 0)
    assert torch.all(sd["backbone.layers.2.mixer.shared_experts.up_proj.weight"][-16:] == 0)
    assert torch.all(sd["backbone.layers.4.mixer.up_proj.weight"][-16:] == 0)

    small = elastic_local.load(tmp_path / "n").budget("small")
    assert small.hidden == 48  # the first hidden cut removed exactly the dead block
    E = small.layers[2]
    assert E.experts < 8 or E.expert_channels < 32 or E.shared_channels < 48  # the search cut MoE width too


def _kl(parent: torch.Tensor, child: torch.Tensor) -> float:
    return float(F.kl_div(child.log_softmax(-1), parent.log_softmax(-1), log_target=True, reduction="batchmean"))


def test_importance_ordered_budget_is_closer_to_the_parent_than_an_unordered_cut(tmp_path):
    make_checkpoint(tmp_path / "p", seed=32, **ALIGNED)
    cripple(tmp_path / "p")
    nest(tmp_path / "p", tmp_path / "n", {"small": 0.6})
    nested = elastic_local.load(tmp_path / "n")
    plain = elastic_local.load(tmp_path / "p")
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(3))
    parent = plain.logits(ids).flatten(0, 1)
    b = nested.budget("small")
    ordered = nested.logits(ids, budget="small").flatten(0, 1)
    unordered = plain.net.forward(ids, b).flatten(0, 1)  # the same sizes, cut from the unpermuted file
    assert _kl(parent, ordered) < 0.5 * _kl(parent, unordered)


def test_depth_order_removes_a_layer_that_does_nothing_first(tmp_path):
    from elastic_local.elastic.importance import depth_order

    make_checkpoint(tmp_path / "p", seed=33, **ALIGNED)
    f = tmp_path / "p" / "model.safetensors"
    sd = load_file(f)
    sd["backbone.layers.4.mixer.down_proj.weight"].zero_()  # the dense MLP adds nothing to the residual
    sd["backbone.layers.1.mixer.o_proj.weight"].mul_(0.01)  # attention adds almost nothing
    save_file(sd, f, metadata={"format": "pt"})
    net = elastic_local.load(tmp_path / "p").net
    seqs = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4)).tolist()
    order, nmse = depth_order(net, seqs)
    assert order[:2] == [4, 1] and sorted(order) == list(range(7))
    # the NMSE each removal leaves: none without the zeroed MLP, little without the muted attention, then more
    assert len(nmse) == 6 and nmse[0] < 1e-10 and nmse[1] < 0.01 < nmse[2] < nmse[-1]


def test_the_search_charges_a_depth_cut_what_its_removal_measured():
    from elastic_local.elastic.search import _depth_loss
    from elastic_local.model import Budget, LayerSizes

    layers = tuple(LayerSizes("-", enabled=i != 2, mlp_channels=16) for i in range(4))
    b = Budget("b", 16, layers)  # one layer already removed
    assert _depth_loss(b, [0.0, 0.3, 1.0]) == 0.3  # the second removal adds 0.3 of the whole
    assert _depth_loss(b, None) == 0.25  # nothing measured: every layer alike
