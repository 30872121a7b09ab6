"""A budget run as prefix views of the resident weights equals a physically smaller model.

The smaller model is built here by slicing the hub-layout tensors by hand (per-group prefixes for Mamba
and attention heads) and is run by transformers, so the oracle shares no code with the runtime."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import hf_logits, make_checkpoint

import elastic_local
from elastic_local.model import Budget, LayerSizes

PATTERN = "M*E-ME*M"
SIZES = dict(hidden=16, mamba_per_group=2, q_per_kv=1, experts=5, expert_channels=8, shared_channels=16,
             mlp_channels=32)


def group_prefix(t: torch.Tensor, groups: int, keep: int, dim: int = 0) -> torch.Tensor:
    """The first `keep` rows of each of `groups` equal groups along `dim`."""
    parts = t.chunk(groups, dim=dim)
    return torch.cat([p.narrow(dim, 0, keep) for p in parts], dim=dim)


def slice_checkpoint(src, dst, drop_layer: int | None) -> None:
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    d = SIZES["hidden"]
    G, p, N = cfg["n_groups"], cfg["mamba_head_dim"], cfg["ssm_state_size"]
    hm, kv, hd = cfg["mamba_num_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    km = SIZES["mamba_per_group"] * G
    out = {}
    for name, t in sd.items():
        t = t.clone()
        if name in ("backbone.embeddings.weight", "lm_head.weight"):
            t = t[:, :d]
        elif name.endswith(("norm.weight", "norm_f.weight")) and "mixer" not in name:
            t = t[:d]
        elif ".mixer.in_proj" in name:
            z, x, bc, dt = t.split([hm * p, hm * p, 2 * G * N, hm])
            keep = SIZES["mamba_per_group"] * p
            t = torch.cat([group_prefix(z, G, keep), group_prefix(x, G, keep), bc,
                           group_prefix(dt, G, SIZES["mamba_per_group"])])[:, :d]
        elif ".mixer.conv1d" in name:
            x, bc = t[: hm * p], t[hm * p:]
            t = torch.cat([group_prefix(x, G, SIZES["mamba_per_group"] * p), bc])
        elif name.endswith(("mixer.dt_bias", "mixer.A_log", "mixer.D")):
            t = group_prefix(t, G, SIZES["mamba_per_group"])
        elif name.endswith("mixer.norm.weight"):
            t = group_prefix(t, G, SIZES["mamba_per_group"] * p)
        elif name.endswith("mixer.out_proj.weight"):
            t = group_prefix(t, G, SIZES["mamba_per_group"] * p, dim=1)[:d]
        elif name.endswith("q_proj.weight"):
            t = group_prefix(t, kv, SIZES["q_per_kv"] * hd)[:, :d]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            t = t[:, :d]
        elif name.endswith("o_proj.weight"):
            t = group_prefix(t, kv, SIZES["q_per_kv"] * hd, dim=1)[:d]
        elif ".experts." in name:
            if int(name.split(".experts.")[1].split(".")[0]) >= SIZES["experts"]:
                continue
            i = SIZES["expert_channels"]
            t = t[:i, :d] if "up_proj" in name else t[:d, :i]
        elif name.endswith("gate.weight"):
            t = t[: SIZES["experts"], :d]
        elif name.endswith("e_score_correction_bias"):
            t = t[: SIZES["experts"]]
        elif "shared_experts" in name:
            s = SIZES["shared_channels"]
            t = t[:s, :d] if "up_proj" in name else t[:d, :s]
        elif name.endswith(("mixer.up_proj.weight", "mixer.down_proj.weight")):
            s = SIZES["mlp_channels"]
            t = t[:s, :d] if "up_proj" in name else t[:d, :s]
        out[name] = t.contiguous()
    pattern = list(PATTERN)
    if drop_layer is not None:  # a layer switched off is a layer that is not there
        pattern.pop(drop_layer)
        renum = {}
        for name, t in out.items():
            if name.startswith("backbone.layers."):
                i = int(name.split(".")[2])
                if i == drop_layer:
                    continue
                j = i - (i > drop_layer)
                name = name.replace(f"layers.{i}.", f"layers.{j}.", 1)
            renum[name] = t
        out = renum
    types = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
    cfg.update(hidden_size=d, mamba_num_heads=km, num_attention_heads=SIZES["q_per_kv"] * kv,
               n_routed_experts=SIZES["experts"], moe_intermediate_size=SIZES["expert_channels"],
               moe_shared_expert_intermediate_size=SIZES["shared_channels"],
               intermediate_size=SIZES["mlp_channels"], layers_block_type=[types[c] for c in pattern])
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})


def budget_for(cfg, drop_layer: int | None) -> Budget:
    layers = []
    for i, kind in enumerate(PATTERN):
        layers.append(LayerSizes(
            kind, enabled=i != drop_layer,
            mamba_heads=SIZES["mamba_per_group"] * cfg.n_groups if kind == "M" else 0,
            attention_heads=SIZES["q_per_kv"] * cfg.num_key_value_heads if kind == "*" else 0,
            experts=SIZES["experts"] if kind == "E" else 0,
            expert_channels=SIZES["expert_channels"] if kind == "E" else 0,
            shared_channels=SIZES["shared_channels"] if kind == "E" else 0,
            mlp_channels=SIZES["mlp_channels"] if kind == "-" else 0))
    return Budget("small", SIZES["hidden"], tuple(layers))


def _check(tmp_path, drop_layer):
    from transformers import NemotronHForCausalLM

    big = tmp_path / "big"
    make_checkpoint(big, seed=5, hybrid_override_pattern=PATTERN, n_groups=2, mamba_num_heads=8,
                    num_attention_heads=4, num_key_value_heads=2)
    small = tmp_path / "small"
    slice_checkpoint(big, small, drop_layer)
    oracle = NemotronHForCausalLM.from_pretrained(small, dtype=torch.float32).eval()
    m = elastic_local.load(big)
    budget = budget_for(m.config, drop_layer)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(4))
    ours = m.net.forward(ids, budget)
    ref = hf_logits(oracle, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # and the same budget is far from the full model (the views really cut something)
    assert (m.logits(ids) - ours).abs().max() > 0.1
    # decoding at reduced sizes with a cache of that budget continues exactly
    cache = m.net.new_cache(2, budget)
    steps = [m.net.forward(ids[:, :7], budget, cache)] + [m.net.forward(ids[:, t:t + 1], budget, cache)
                                                          for t in range(7, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["transposed", "rows"])
def test_reduced_sizes_equal_a_physically_sliced_checkpoint(tmp_path, monkeypatch, layout):
    """Both CPU weight layouts (the default [in, out] one and ELASTIC_LOCAL_CPU_LAYOUT=rows, whose decode
    steps run on the CPU decode kernels)."""
    from elastic_local.engine.load import LAYOUT_ENV

    monkeypatch.setenv(LAYOUT_ENV, layout)
    _check(tmp_path, drop_layer=None)


def test_cpu_layout_keeps_budgets_as_views_whose_panels_are_contiguous(tmp_path):
    from elastic_local.model.linear import Panels, block

    make_checkpoint(tmp_path, seed=5, hybrid_override_pattern=PATTERN, n_groups=2, mamba_num_heads=8,
                    num_attention_heads=4, num_key_value_heads=2)
    m = elastic_local.load(tmp_path)
    before = sum(t.nbytes for t in m.net.tensors())
    layer = next(layer for layer in m.net.layers if layer.kind == "-")
    up, down = layer.mixer.up, layer.mixer.down
    assert isinstance(up, Panels) and isinstance(down, Panels) and down.shape == (32, 48)
    for cut in (block(down, 0, 32, 16), block(up, 0, 16, 24)):  # an input cut; an output and an input cut
        # no copy, and every panel's rows one contiguous run
        assert cut.p.untyped_storage().data_ptr() == up.p.untyped_storage().data_ptr() or cut.p.untyped_storage(
        ).data_ptr() == down.p.untyped_storage().data_ptr()
        assert cut.p.stride(-1) == 1 and cut.p.stride(-2) == cut.p.shape[-1]
    x = torch.randn(3, 16)
    # the kernels sum in another order
    torch.testing.assert_close(block(down, 0, 32, 16).linear(x), x @ down.dense()[:16], atol=1e-6, rtol=1e-5)
    m.net.forward(torch.tensor([[1, 2, 3]]), budget_for(m.config, None))
    assert sum(t.nbytes for t in m.net.tensors()) == before  # running a budget copied nothing


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_silencing_a_token_pins_its_logit_at_zero_in_the_panel_layout(tmp_path, stored):
    """The LM head in panels: the token's column is found inside its panel (tokens 0, 23, 24 and the last
    straddle panel edges), in a BF16 file's bf16 panels too, whose rows hold their first 16 columns reordered
    (1 and 8 move there; 17 and 23 keep their places)."""
    from elastic_local.model.gemv import library
    from elastic_local.model.linear import Panels

    make_checkpoint(tmp_path, seed=2).to(stored).save_pretrained(tmp_path)
    m = elastic_local.load(tmp_path)
    assert isinstance(m.net.lm_head, Panels)
    assert m.net.lm_head.p.dtype == (stored if library() is not None else torch.float32)
    vocab = m.config.vocab_size
    tokens = [0, 1, 8, 17, 23, 24, vocab - 1]
    for t in tokens:
        m.net.silence(t)
    with torch.inference_mode():
        logits = m.net.forward(torch.tensor([[1, 2, 3]]))[0, -1]
    assert torch.all(logits[tokens] == 0)
    assert torch.count_nonzero(logits) == vocab - len(tokens)


def test_a_switched_off_layer_equals_a_checkpoint_without_it(tmp_path):
    _check(tmp_path, drop_layer=3)


def test_a_budget_pickled_into_another_process_hashes_as_that_process_computes_it():
    """Budgets key per-budget state and cache their hash; str hashes are salted per process, so a budget
    sent to a worker (DDP, multiprocessing) must not carry its sender's hash."""
    import os
    import pickle
    import subprocess
    import sys

    b = Budget("half", 64, (LayerSizes("M", mamba_heads=4), LayerSizes("E", experts=4, expert_channels=32)))
    hash(b)  # computed and cached here
    code = ("import pickle, sys; from elastic_local.model import Budget, LayerSizes; "
            "b = pickle.loads(sys.stdin.buffer.read()); "
            "fresh = Budget('half', 64, (LayerSizes('M', mamba_heads=4), "
            "LayerSizes('E', experts=4, expert_channels=32))); "
            "print(b == fresh and hash(b) == hash(fresh) and b in {fresh})")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(b), capture_output=True,
                         env={**os.environ, "PYTHONHASHSEED": "random"}, check=True)
    assert out.stdout.decode().strip() == "True"
