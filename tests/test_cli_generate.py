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
    assert r["stats"]["prompt_tokens"] == r["prompt_len"]
    # the random model never closes thinking: 4 sampled think tokens, then the closing text, then 6 answer tokens
    assert r["think_end"] == "budget" and r["finish_reason"] == "answer_limit" and r["finish_phase"] == "answer"
    assert r["stats"]["think_tokens"] - r["stats"]["think_inserted"] == 4 and len(r["answer_ids"]) == 6
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


def test_generate_reads_the_prompt_from_stdin_or_a_file(tmp_path, capsys, monkeypatch):
    """--prompt, --file FILE, --file - and a piped stdin give the same answer; no prompt at all, an empty
    one, a missing or non-UTF-8 file are one-line errors before any model is loaded."""
    import io

    make_checkpoint(tmp_path, seed=8)
    write_tokenizer(tmp_path)
    base = ["generate", str(tmp_path), "--max-think-tokens", "3", "--max-tokens", "4", "--json"]
    (tmp_path / "q.txt").write_text("hello there\n")

    def answer(*extra, stdin=None, tty=False) -> str:
        fake = io.StringIO(stdin or "")
        fake.isatty = lambda: tty
        monkeypatch.setattr("sys.stdin", fake)
        assert main(base + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["answer_text"]

    ref = answer("--prompt", "hello there")
    assert answer("--file", str(tmp_path / "q.txt")) == ref
    assert answer("--file", "-", stdin="hello there\n") == ref
    assert answer(stdin="hello there") == ref
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    for extra, tty, message in (((), True, "no prompt"), (("--file", "nope.txt"), True, "nope.txt: no such file"),
                                (("--file", str(tmp_path / "bad.txt")), True, "not UTF-8"),
                                ((), False, "the prompt is empty"),
                                (("--prompt", "a", "--file", "-"), True, "not both")):
        monkeypatch.setattr("sys.stdin", io.StringIO(""))
        monkeypatch.setattr("sys.stdin.isatty", lambda tty=tty: tty)
        assert main(base + list(extra)) == 2
        assert message in capsys.readouterr().err
