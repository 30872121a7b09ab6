"""Loading: hub and transformers layouts, shards, dtypes, and clear errors for bad checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import hf_logits, make_checkpoint

import elastic_local
from elastic_local.checkpoint import CheckpointError
from elastic_local.model import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = make_checkpoint(path, seed=7)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    return path, hf_logits(hf, ids), ids


def rewrite(src, dst, edit):
    """Copy a checkpoint, passing its tensors through `edit(dict) -> dict`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_transformers_renamed_layout_with_stacked_experts_loads(tiny, tmp_path):
    path, ref, ids = tiny

    def to_transformers(sd):
        out = {}
        for k, v in sd.items():
            k = k.replace("backbone.", "model.")
            if ".experts." in k:
                stem, rest = k.split(".experts.")
                j, proj = int(rest.split(".")[0]), rest.split(".")[1]
                out.setdefault(f"{stem}.experts.{proj}", {})[j] = v
            else:
                out[k] = v
        return {k: torch.stack([v[j] for j in sorted(v)]) if isinstance(v, dict) else v for k, v in out.items()}

    dst = rewrite(path, tmp_path / "renamed", to_transformers)
    torch.testing.assert_close(elastic_local.load(dst).logits(ids), ref, atol=1e-4, rtol=0)


def test_sharded_checkpoint_with_index_loads(tiny, tmp_path):
    from transformers import NemotronHForCausalLM

    path, ref, ids = tiny
    NemotronHForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    torch.testing.assert_close(elastic_local.load(tmp_path / "sharded").logits(ids), ref, atol=1e-4, rtol=0)


def test_bf16_file_loads_into_the_requested_dtype(tiny, tmp_path):
    path, ref, ids = tiny
    dst = rewrite(path, tmp_path / "bf16", lambda sd: {k: v.to(torch.bfloat16) for k, v in sd.items()})
    m = elastic_local.load(dst, dtype=torch.float32)
    assert m.net.embed.dtype == torch.float32
    assert m.net.layers[0].mixer.A.dtype == torch.float32  # SSM parameters stay float32
    assert (m.logits(ids) - ref).abs().max() < 0.5  # bf16 rounding of the weights only


def test_missing_tensor_is_named(tiny, tmp_path):
    path = tiny[0]
    dst = rewrite(path, tmp_path / "missing",
                  lambda sd: {k: v for k, v in sd.items() if "layers.1.mixer.k_proj" not in k})
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.1\.mixer\.k_proj\.weight"):
        elastic_local.load(dst)


def test_extra_tensor_is_named_with_its_file(tiny, tmp_path):
    path = tiny[0]
    dst = rewrite(path, tmp_path / "extra", lambda sd: {**sd, "backbone.layers.0.mixer.bogus": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor '.*mixer\.bogus' in model\.safetensors"):
        elastic_local.load(dst)


def test_mtp_tensors_are_ignored(tiny, tmp_path):
    path, ref, ids = tiny
    dst = rewrite(path, tmp_path / "mtp", lambda sd: {**sd, "mtp.layers.0.norm.weight": torch.ones(32)})
    torch.testing.assert_close(elastic_local.load(dst).logits(ids), ref, atol=1e-4, rtol=0)


def test_misshapen_tensor_reports_expected_and_found(tiny, tmp_path):
    path = tiny[0]

    def shrink(sd):
        sd["backbone.layers.2.mixer.experts.3.up_proj.weight"] = torch.zeros(15, 32)
        return sd

    dst = rewrite(path, tmp_path / "shape", shrink)
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.weight' has shape \[15, 32\], config"):
        elastic_local.load(dst)


def test_truncated_file_is_reported(tiny, tmp_path):
    path = tiny[0]
    dst = rewrite(path, tmp_path / "cut", lambda sd: sd)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated.*re-download"):
        elastic_local.load(dst)


def test_missing_shard_is_reported(tiny, tmp_path):
    from transformers import NemotronHForCausalLM

    path = tiny[0]
    NemotronHForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "s", max_shard_size="20KB")
    shard = sorted((tmp_path / "s").glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        elastic_local.load(tmp_path / "s")


def test_unknown_block_letter_is_reported(tiny, tmp_path):
    path = tiny[0]
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("layers_block_type")
    cfg["hybrid_override_pattern"] = "M*X-ME"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json: hybrid_override_pattern has unknown block letter.*'X'"):
        elastic_local.load(tmp_path)


def test_unknown_budget_is_reported(tiny):
    with pytest.raises(KeyError, match=r"unknown budget '30B'.*\['full'\]"):
        elastic_local.load(tiny[0], budget="30B")


def test_directory_without_weights_is_reported(tiny, tmp_path):
    (tmp_path / "config.json").write_text((tiny[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model\\*.safetensors weights"):
        elastic_local.load(tmp_path)


def test_listing_the_weights_keeps_none_of_them_alive(tiny):
    """`net.tensors()` (the load's memory accounting) must not hold what it lists: a weight replaced
    afterwards (the CPU layout replaces every Linear) is freed at once, not when the cyclic collector
    runs. Its recursive closure once made such a cycle: bench_memory's model held 430 MiB more after
    loading."""
    import gc
    import weakref

    from elastic_local.model.linear import Panels

    net = elastic_local.load(tiny[0]).net
    mixer = next(layer.mixer for layer in net.layers if hasattr(layer.mixer, "out_proj"))
    w = mixer.out_proj
    ref = weakref.ref(w.p if isinstance(w, Panels) else w)
    del w
    gc.disable()
    try:
        listed = net.tensors()
        assert any(t is ref() for t in listed)
        del listed
        mixer.out_proj = None
        assert ref() is None
    finally:
        gc.enable()
