"""Training data: chats are rendered with the checkpoint's template and only assistant tokens are
trained; text is trained everywhere; bad lines are named; batches depend only on (seed, step)."""

import json

import pytest
import torch
from tiny import write_tokenizer

from elastic_local.engine.tokenizer import Tokenizer
from elastic_local.train.data import batch_indices, pack, read_stream, split
from elastic_local.train.recipe import Recipe


@pytest.fixture
def tok(tmp_path):
    write_tokenizer(tmp_path / "tok")
    return Tokenizer.from_dir(tmp_path / "tok")


def test_chat_trains_only_the_assistant_answers(tmp_path, tok):
    f = tmp_path / "chat.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]}
    f.write_text(json.dumps(chat) + "\n\n")
    s = read_stream([f], tok)
    # position j is trained when token j+1 is an assistant token: collect those next tokens
    predicted = tok.decode(s.ids[1:][s.target[:-1]].tolist())
    assert predicted.startswith("hello") and "bye" in predicted
    assert "hi there" not in predicted and "and?" not in predicted and "user" not in predicted


def test_text_is_trained_everywhere_and_split_holds_out_the_tail(tmp_path, tok):
    f = tmp_path / "a.txt"
    f.write_text("the cat sat on the mat. " * 40)
    s = read_stream([f], tok)
    assert s.target[:-2].all()
    train, held = split(s, 0.1, 16)
    assert len(train) + len(held) == len(s) and len(held) >= 16
    assert torch.equal(held.ids, s.ids[len(train):])
    seqs, tr = pack(train, 16)
    assert seqs.shape[1] == 16 and torch.equal(seqs.reshape(-1), train.ids[: seqs.numel()])


def test_bad_lines_are_named(tmp_path, tok):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"messages": []}\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: every message needs a role and a string content"):
        read_stream([f], tok)
    f.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        read_stream([f], tok)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_stream([tmp_path / "nope.txt"], tok)


def test_batches_are_a_function_of_seed_and_step_and_cover_every_sequence():
    first = torch.cat([batch_indices(10, 5, step, seed=1) for step in range(2)])
    assert sorted(first.tolist()) == list(range(10))  # one epoch sees each sequence once
    assert torch.equal(batch_indices(10, 5, 3, seed=1), batch_indices(10, 5, 3, seed=1))
    assert not torch.equal(batch_indices(10, 5, 3, seed=1), batch_indices(10, 5, 3, seed=2))


def test_recipe_file_and_overrides(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text("[train]\nsteps = 7\nlr = 0.5\n")
    r = Recipe.load(f, steps=9)
    assert (r.steps, r.lr) == (9, 0.5)
    f.write_text("[train]\nstepz = 7\n")
    with pytest.raises(ValueError, match="unknown recipe key"):
        Recipe.load(f)
    with pytest.raises(ValueError, match="cost_on must be argmax or samples"):
        Recipe.load(None, cost_on="sample")
