"""Broken copies of a good checkpoint directory: one function per way a file goes wrong on a user's disk
(a cut-off download, a corrupt header, a tensor of the wrong dtype or shape or missing, a missing shard,
an index that points at nothing, a config that contradicts the tensors). Each takes a directory written
by `tiny.make_checkpoint` (one model.safetensors) and breaks it in place; it returns the text the error
must name (a file name or a tensor name)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VICTIM = "backbone.layers.0.mixer.in_proj.weight"  # the tensor a corruption picks on


def _rewrite(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    f = d / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _header(f: Path) -> tuple[int, dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def truncated(d: Path) -> str:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])
    return "model.safetensors"


def truncated_in_header(d: Path) -> str:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:40])
    return "model.safetensors"


def empty_file(d: Path) -> str:
    (d / "model.safetensors").write_bytes(b"")
    return "model.safetensors"


def corrupt_header(d: Path) -> str:
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:24] = b"#" * 16  # the JSON's first bytes
    f.write_bytes(bytes(raw))
    return "model.safetensors"


def header_not_tensors(d: Path) -> str:
    """Valid JSON, but not a safetensors header (a tensor entry without dtype / offsets)."""
    f = d / "model.safetensors"
    n, header, data = _header(f)
    header[VICTIM] = {"shape": [1]}
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return VICTIM


def offsets_past_the_end(d: Path) -> str:
    f = d / "model.safetensors"
    n, header, data = _header(f)
    start, end = header[VICTIM]["data_offsets"]
    header[VICTIM]["data_offsets"] = [start, end + 10**9]
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return "model.safetensors"


def wrong_dtype(d: Path) -> str:
    _rewrite(d, lambda t: t.__setitem__(VICTIM, t[VICTIM].to(torch.int32)))
    return VICTIM


def wrong_shape(d: Path) -> str:
    _rewrite(d, lambda t: t.__setitem__(VICTIM, t[VICTIM][:-3]))
    return VICTIM


def transposed(d: Path) -> str:
    _rewrite(d, lambda t: t.__setitem__(VICTIM, t[VICTIM].T.contiguous()))
    return VICTIM


def missing_tensor(d: Path) -> str:
    _rewrite(d, lambda t: t.pop(VICTIM))
    return VICTIM


def extra_tensor(d: Path) -> str:
    _rewrite(d, lambda t: t.__setitem__("backbone.layers.0.mixer.bogus.weight", torch.zeros(2)))
    return "bogus"


def _shard(d: Path) -> dict:
    """Split model.safetensors into two shards with an index (as large checkpoints ship)."""
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, d / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def sharded_ok(d: Path) -> str:
    """Not a corruption: the sharded layout the index-based cases start from."""
    _shard(d)
    return ""


def missing_shard(d: Path) -> str:
    _shard(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    return "model-00002-of-00002.safetensors"


def index_points_at_a_missing_tensor(d: Path) -> str:
    index = _shard(d)
    index["weight_map"]["backbone.layers.9.mixer.ghost.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return "backbone.layers.9.mixer.ghost.weight"


def index_names_the_wrong_shard(d: Path) -> str:
    index = _shard(d)
    index["weight_map"][VICTIM] = ("model-00002-of-00002.safetensors" if index["weight_map"][VICTIM].startswith(
        "model-00001") else "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return VICTIM


def index_empty(d: Path) -> str:
    _shard(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    return "model.safetensors.index.json"


def index_corrupt(d: Path) -> str:
    _shard(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {')
    return "model.safetensors.index.json"


def index_without_weight_map(d: Path) -> str:
    _shard(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    return "model.safetensors.index.json"


def _config(d: Path, edit: Callable[[dict], None]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def config_contradicts_tensors(d: Path) -> str:
    _config(d, lambda c: c.__setitem__("mamba_num_heads", c["mamba_num_heads"] * 2))
    return VICTIM


def config_field_falls_back_to_default(d: Path) -> str:
    """A field left out takes its default (here larger than the file's tensors): the tensors must win, not
    a parameter count from the default."""
    _config(d, lambda c: c.pop("moe_shared_expert_intermediate_size"))
    return "shared_experts"


def config_fewer_layers(d: Path) -> str:
    def edit(c: dict) -> None:
        c["layers_block_type"] = c["layers_block_type"][:-1]
        c.pop("hybrid_override_pattern", None)
        c["num_hidden_layers"] = len(c["layers_block_type"])
    _config(d, edit)
    return "unexpected tensor"


def config_corrupt(d: Path) -> str:
    (d / "config.json").write_text('{"hidden_size": 32,')
    return "config.json"


def config_wrong_type(d: Path) -> str:
    _config(d, lambda c: c.__setitem__("hidden_size", "thirty-two"))
    return "hidden_size"


def config_missing(d: Path) -> str:
    (d / "config.json").unlink()
    return "config.json"


CORRUPTIONS: dict[str, Callable[[Path], str]] = {f.__name__: f for f in (
    truncated, truncated_in_header, empty_file, corrupt_header, header_not_tensors, offsets_past_the_end,
    wrong_dtype, wrong_shape, transposed, missing_tensor, extra_tensor, missing_shard,
    index_points_at_a_missing_tensor, index_names_the_wrong_shard, index_empty, index_corrupt,
    index_without_weight_map, config_contradicts_tensors, config_field_falls_back_to_default, config_fewer_layers,
    config_corrupt, config_wrong_type, config_missing)}


# files only a run that tokenizes reads (generate, chat, batch, elastic_local.load)
def tokenizer_corrupt(d: Path) -> str:
    (d / "tokenizer.json").write_text('{"version": ')
    return "tokenizer.json"


def tokenizer_config_corrupt(d: Path) -> str:
    (d / "tokenizer_config.json").write_text("{not json")
    return "tokenizer_config.json"


def chat_template_does_not_parse(d: Path) -> str:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content "
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return "tokenizer_config.json"


def generation_config_corrupt(d: Path) -> str:
    (d / "generation_config.json").write_text('{"eos_token_id": ')
    return "generation_config.json"


TOKENIZER_CORRUPTIONS: dict[str, Callable[[Path], str]] = {f.__name__: f for f in (
    tokenizer_corrupt, tokenizer_config_corrupt, chat_template_does_not_parse, generation_config_corrupt)}
