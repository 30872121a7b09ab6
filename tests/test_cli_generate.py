"""`elastic-local generate`: thinking on stderr, the answer on stdout, a stats line; --json."""

import json

from tiny import make_checkpoint, write_tokenizer

from elastic_local.cli import main


def test_generate_streams_thinking_and_answer_apart(tmp_path, capsys):
    make_checkpoint(tmp_path, seed=8)
    write_tokenizer(tmp_path)
    args = ["generate", str(tmp_path), "--prompt", "hello there", "--max-think-tokens", "4", "--max-tokens", "6"]
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["stats"]["prompt_tokens"] == r["prompt_len"] and r["finish_phase"] in ("think", "answer")
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert r["answer_text"] in out and r["think_text"] in err  # greedy: the same text both times
    assert "prompt " in err and "think [full]" in err and "catch-up" in err
    assert main(args + ["--think-budget", "nope"]) == 2
    assert "unknown budget" in capsys.readouterr().err


def test_generate_needs_a_tokenizer(tmp_path, capsys):
    make_checkpoint(tmp_path, seed=8)
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer" in capsys.readouterr().err
