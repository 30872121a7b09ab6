"""Bad input through the Python API and the CLI's options: a clear ValueError (or a one-line CLI error)
naming the value and what is allowed; limits far past what can run neither allocate for the limit nor
overflow; a sequence never runs past the model's context (max_position_embeddings)."""

import json
import math

import pytest
import torch
from tiny import make_checkpoint, write_tokenizer

import elastic_local
from elastic_local.cli import main
from elastic_local.engine.generate import PREALLOC_TOKENS, Generation
from elastic_local.engine.phases import Request
from elastic_local.model.attention import KVCache

VOCAB = 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad") / "m"
    make_checkpoint(d, seed=4)
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def model(ckpt):
    return elastic_local.load(ckpt)


def _with_context(ckpt, tmp_path, context):
    return elastic_local.load(_context_dir(ckpt, tmp_path, context))


def _context_dir(ckpt, tmp_path, context):
    """A copy of `ckpt` whose config names `context` as max_position_embeddings (None: names none)."""
    import shutil

    d = tmp_path / "ctx"
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    if context is None:
        cfg.pop("max_position_embeddings")
    else:
        cfg["max_position_embeddings"] = context
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("ids, message", [
    (torch.zeros(1, 0, dtype=torch.long), r"input_ids is empty \(shape \[1, 0\]\)"),
    (torch.tensor([[1, VOCAB]]), rf"token id {VOCAB} is outside the vocabulary of {VOCAB} \(ids 0..{VOCAB - 1}\)"),
    (torch.tensor([[-1, 2]]), rf"token id -1 is outside the vocabulary of {VOCAB}"),
    ([[1], [2, 3]], r"a list of equal-length id lists"),
    (torch.tensor([[1.0, 2.0]]), r"integer token ids, not torch.float32"),
    (torch.zeros(1, 1, 1, dtype=torch.long), r"must be \[B, T\] \(or one sequence \[T\]\); got shape \[1, 1, 1\]"),
    (torch.ones(1, 4097, dtype=torch.long), r"4097 tokens, past the model's context of 4096"),
])
def test_logits_rejects_bad_ids_naming_the_value(model, ids, message):
    with pytest.raises(ValueError, match=message):
        model.logits(ids)


def test_logits_takes_one_sequence_as_a_1d_tensor_or_a_list(model):
    batch = model.logits(torch.tensor([[1, 2, 3]]))
    assert torch.equal(model.logits(torch.tensor([1, 2, 3])), batch)
    assert torch.equal(model.logits([1, 2, 3]), batch)
    assert model.logits([[1, 2], [3, 4]]).shape == (2, 2, VOCAB)


@pytest.mark.parametrize("options, message", [
    (dict(temperature=math.nan), r"temperature=nan is not a number"),
    (dict(temperature=-1.0), r"temperature=-1.0 must be a finite number >= 0"),
    (dict(temperature=math.inf), r"temperature=inf must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p=nan is not a number"),
    (dict(min_p=-0.1), r"min_p=-0.1 must be in \[0, 1\]"),
    (dict(top_k=1.5), r"top_k=1.5 must be a whole number"),
    (dict(max_answer_tokens=1e20), r"max_answer_tokens=1e\+20 must be a whole number >= 0"),
    (dict(max_think_tokens=-1), r"max_think_tokens=-1 must be a whole number >= 0"),
])
def test_generation_options_out_of_range_are_value_errors_naming_the_value(model, options, message):
    with pytest.raises(ValueError, match=message):
        model.generate([1, 2, 3], **options)


@pytest.mark.parametrize("options, message", [
    (dict(max_new_tokens=8), r"unknown generation option 'max_new_tokens'; did you mean max_think_tokens and "
                             r"max_answer_tokens \(a limit per phase\)\?"),
    (dict(temprature=0.5), r"unknown generation option 'temprature'; did you mean temperature\?"),
    (dict(colour="red"), r"unknown generation option 'colour' The options are: think_budget, answer_budget, "),
])
def test_an_unknown_generation_option_is_named_with_the_likely_one(model, options, message):
    """generate, stream and chat (at its creation, not its first turn) all say which option they do not know."""
    for call in (lambda: model.generate([1, 2, 3], **options), lambda: model.stream([1, 2, 3], **options),
                 lambda: model.chat(**options), lambda: model.chat().send("Hi", **options)):
        with pytest.raises(TypeError, match=message):
            call()


@pytest.mark.parametrize("prompt, message", [
    ([], r"every prompt needs at least one token"),
    ([1, 200], r"prompt token 200 is not an id of the vocabulary of 96 \(0..95\)"),
    ([1, -3], r"prompt token -3 is not an id"),
    ([1] * 5000, r"the prompt has 5000 tokens, but the model's context is 4096"),
])
def test_bad_prompts_are_value_errors(model, prompt, message):
    with pytest.raises(ValueError, match=message):
        model.generate(prompt, max_answer_tokens=2)


def test_a_huge_token_limit_grows_the_kv_cache_instead_of_allocating_it(ckpt, tmp_path):
    m = _with_context(ckpt, tmp_path, None)  # no context named: only the limit bounds the reply
    gen = Generation(m, [[1, 2, 3]], Request(max_think_tokens=10**9, max_answer_tokens=10**20, ignore_eos=True))
    for n, _ in enumerate(gen.run()):
        if n == 12:
            break
    kv = [s.k.shape[2] for c in gen.caches.values() for s in c.layers if isinstance(s, KVCache)]
    assert kv and max(kv) <= 64, kv  # positions allocated follow the tokens, not 10**20


def test_a_limit_within_reach_is_allocated_once(ckpt, tmp_path):
    m = _with_context(ckpt, tmp_path, None)
    gen = Generation(m, [[1, 2, 3]], Request(max_think_tokens=0, max_answer_tokens=40, ignore_eos=True))
    next(iter(gen.run()))
    kv = [s.k.shape[2] for c in gen.caches.values() for s in c.layers if isinstance(s, KVCache)]
    assert set(kv) == {43}  # prompt 3 + 40: one allocation, no doubling
    assert 43 <= PREALLOC_TOKENS


def test_a_reply_stops_at_the_context_and_says_so(ckpt, tmp_path):
    m = _with_context(ckpt, tmp_path, 24)
    r = m.generate([1, 2, 3, 4, 5], max_think_tokens=10**9, max_answer_tokens=10**9, ignore_eos=True)
    assert r.finish_reason == "context_limit" and len(r.ids) == 24


@pytest.mark.parametrize("argv, message", [
    (["fit", "--context", "-5"], "argument --context: -5 must be >= 1"),
    (["fit", "--caches", "0"], "argument --caches: 0 must be >= 1"),
    (["fit", "--margin-gib", "nan"], "--margin-gib nan: expected a size in GiB >= 0"),
    (["generate", "{ckpt}", "--prompt", "hi", "--max-tokens", "1e20"], "argument --max-tokens: '1e20' is not a whole"),
    (["generate", "{ckpt}", "--prompt", "hi", "--temperature", "nan"], "temperature=nan is not a number"),
    (["generate", "{ckpt}", "--prompt", "hi " * 3000], "but the model's context is 4096"),
    (["nest", "{ckpt}", "{out}", "--budget", "x=0.5", "--budget", "x=0.3"],
     "--budget x is given twice (x=0.5 and x=0.3); give each budget once"),
])
def test_cli_bad_options_are_one_clear_error(ckpt, tmp_path, capsys, argv, message):
    argv = [a.format(ckpt=ckpt, out=tmp_path / "out") for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_billion_max_tokens_runs_without_allocating_for_it(ckpt, tmp_path, capsys):
    d = _context_dir(ckpt, tmp_path, 48)  # a short context, so that the reply ends soon
    assert main(["generate", str(d), "--prompt", "hi", "--max-tokens", "1000000000", "--max-think-tokens",
                 "1000000000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] in ("eos", "context_limit")


@pytest.mark.parametrize("argv, message", [
    (["--context", "-5"], "argument --context: -5 must be >= 1"),
    (["--max-batch", "0"], "argument --max-batch: 0 must be >= 1"),
    (["--max-tokens", "-1"], "argument --max-tokens: -1 must be >= 0"),
    (["--max-think-tokens", "1e20"], "argument --max-think-tokens: '1e20' is not a whole number"),
])
def test_batch_options_out_of_range_are_usage_errors(ckpt, tmp_path, capsys, argv, message):
    src = tmp_path / "in.txt"
    src.write_text("hi\n")
    with pytest.raises(SystemExit) as e:
        main(["batch", str(src), str(tmp_path / "out.jsonl"), str(ckpt), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_batch_input_that_is_a_directory_is_named(ckpt, tmp_path, capsys):
    assert main(["batch", str(tmp_path), str(tmp_path / "out.jsonl"), str(ckpt)]) == 2
    assert f"{tmp_path}: a directory, not an input file" in capsys.readouterr().err
