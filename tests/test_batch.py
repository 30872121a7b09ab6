"""`elastic-local batch`: OpenAI batch files in and out, continuous batching, resume after a kill.

Independent checks: the output is validated by the `openai` package's own response types, and batched
results are compared token for token with the same requests run one at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gen_util import elastic_model, runs_ahead
from openai.types import Completion
from openai.types.chat import ChatCompletion
from tiny import make_checkpoint, write_tokenizer

from elastic_local.batch.outfile import OutputError, OutputFile
from elastic_local.batch.requests import Checker, LineError, check_unique, parse, read_lines
from elastic_local.batch.scheduler import Admission, Memory, run_jobs
from elastic_local.cli import main
from elastic_local.engine.generate import Generation

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


def request(cid: str, body: dict, url: str = CHAT) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "ckpt"
    make_checkpoint(path, seed=4)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    return elastic_model(tmp_path_factory.mktemp("batchm"), seed=3)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_output_line_parses_with_openai_types_and_bad_lines_get_errors(ckpt, tmp_path, capsys):
    lines = [
        request("chat-think", {"model": "m", "messages": user("why is the sky blue"), "max_tokens": 5,
                               "max_think_tokens": 4, "think_budget": "full"}),
        request("chat-off", {"messages": [{"role": "system", "content": "be brief"}, *user("hi")], "max_tokens": 6,
                             "chat_template_kwargs": {"enable_thinking": False}, "stop": ["\n"]}),
        request("text", {"prompt": "once upon a time", "max_tokens": 7, "temperature": 0.8, "top_p": 0.9,
                         "seed": 1}, COMPLETION),
        request("ids", {"prompt": [5, 6, 7, 8], "max_completion_tokens": 3}, COMPLETION),
        '{"custom_id": "broken", "method": "POST", "url": ',  # 5: bad JSON
        json.dumps({"method": "POST", "url": CHAT, "body": {"messages": user("x")}}),  # 6: no custom_id
        request("budget", {"messages": user("x"), "answer_budget": "tiny"}),  # 7: unknown budget
        request("long", {"messages": user("word " * 300), "max_tokens": 4}),  # 8: longer than the context
        request("n", {"messages": user("x"), "n": 3}),  # 9: unsupported n
        request("last", {"messages": user("the last one"), "max_tokens": 4, "max_think_tokens": 2}),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["batch", str(src), str(out), str(ckpt), "--context", "256", "--max-batch", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["done"] == 5 and summary["errors"] == 5 and summary["requests"] == 10
    got = {r["custom_id"]: r for r in records(out)}
    assert len(records(out)) == 10
    for cid in ("chat-think", "chat-off", "last"):
        r = got[cid]
        assert r["error"] is None and r["response"]["status_code"] == 200
        c = ChatCompletion.model_validate(r["response"]["body"])
        assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
        assert c.usage.completion_tokens == c.usage.total_tokens - c.usage.prompt_tokens
        thinking = c.choices[0].message.model_extra["reasoning_content"]
        reasoning = c.usage.completion_tokens_details.reasoning_tokens
        assert (thinking is None) == (cid == "chat-off") and (reasoning == 0) == (cid == "chat-off")
    assert ChatCompletion.model_validate(got["chat-think"]["response"]["body"]).model == "m"
    for cid in ("text", "ids"):
        c = Completion.model_validate(got[cid]["response"]["body"])
        assert c.object == "text_completion" and c.choices[0].finish_reason in ("stop", "length")
    assert Completion.model_validate(got["ids"]["response"]["body"]).usage.prompt_tokens == 4
    errors = {r["error"]["line"]: r["error"]["code"] for r in records(out) if r["error"] is not None}
    assert errors == {5: "invalid_json", 6: "missing_custom_id", 7: "unknown_budget", 8: "context_length_exceeded",
                      9: "unsupported_parameter"}
    assert all(r["response"] is None and f"line {r['error']['line']}" in r["error"]["message"]
               for r in records(out) if r["error"] is not None)
    # a rerun finds everything done and writes nothing
    assert main(["batch", str(src), str(out), str(ckpt), "--context", "256"]) == 0
    assert len(records(out)) == 10 and "10 from before" in capsys.readouterr().err


@pytest.mark.parametrize("max_batch", [3, 1])
def test_continuous_batching_gives_each_request_its_tokens_alone(m, monkeypatch, max_batch):
    """Requests on different budgets, limits, thinking on and off and seeded sampling join and leave a
    batch of 3; each result equals the request run alone, token for token. A batch of one runs each greedy
    row ahead in C, as a lone row does (and the last of a larger batch)."""
    bodies = [
        {"messages": user("first question"), "max_tokens": 6, "max_think_tokens": 5},
        {"messages": user("second, a longer question than the first"), "max_tokens": 3, "think_budget": "small"},
        {"messages": user("third"), "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False},
         "answer_budget": "small"},
        {"messages": user("fourth"), "max_tokens": 4, "max_think_tokens": 9, "think_budget": "small",
         "answer_budget": "full"},
        {"messages": user("fifth one"), "max_tokens": 5, "temperature": 1.0, "seed": 7},
        {"messages": user("sixth"), "max_tokens": 2, "max_think_tokens": 0},
        {"messages": user("seventh, the last"), "max_tokens": 7, "answer_budget": "small"},
    ]
    lines = [(i + 1, request(f"r{i}", {**b, "max_think_tokens": b.get("max_think_tokens", 3)}))
             for i, b in enumerate(bodies)]
    jobs = parse(lines, Checker.for_model(m).job)
    assert not [j for j in jobs if isinstance(j, LineError)]
    for j in jobs:
        j.request.ignore_eos = True
        j.request.think_close = "ok."
    lengths = runs_ahead(monkeypatch)
    fixed = Admission(fixed=True)
    batched = {job.custom_id: r for job, r in run_jobs(m, jobs, max_batch=max_batch, admission=fixed)}
    assert len(batched) == len(jobs)
    assert max(lengths, default=0) > (1 if max_batch == 1 else 0)
    for job in jobs:
        alone = Generation(m, [job.prompt], job.request).collect()[0]
        assert batched[job.custom_id].ids == alone.ids, job.custom_id
    assert batched["r1"].stats.think_budgets == ["small"] and batched["r2"].stats.answer_budgets == ["small"]


def batch_sizes(monkeypatch) -> list[int]:
    """The rows of every step a Generation takes from here on."""
    sizes, step = [], Generation.step

    def counting(self, *args, **kwargs):
        sizes.append(len(self.active))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Generation, "step", counting)
    return sizes


def test_admission_stays_within_the_memory_bound(m, monkeypatch):
    lines = [(i + 1, request(f"r{i}", {"messages": user(f"question {i}"), "max_tokens": 4, "max_think_tokens": 3}))
             for i in range(6)]
    lines.append((7, request("huge", {"messages": user("big"), "max_tokens": 3000, "max_think_tokens": 3})))
    jobs = parse(lines, Checker.for_model(m).job)
    probe = Memory.of(m, None)
    cap = max(j.capacity for j in jobs[:6])
    room = probe.bytes(2, cap, {"full"})  # two rows of one budget fit, three do not
    sizes = batch_sizes(monkeypatch)
    out = dict((job.custom_id, r) for job, r in run_jobs(m, jobs, max_batch=8, memory=Memory.of(m, room),
                                                          admission=Admission(fixed=True)))
    assert max(sizes) == 2 and len(out) == 7
    assert isinstance(out["huge"], LineError) and out["huge"].code == "out_of_memory"


def test_memory_leaves_room_for_the_sub_batches_copies_where_no_c_step_runs(m, monkeypatch):
    """Without a C step in place (a GPU) each budget's decoding rows step on a copy of theirs, held while
    the same rows decode (CacheSet.held): a batch on two budgets holds up to one more cache of every row,
    which its memory bound counts; on one budget there are no sub-batches."""
    from elastic_local.model import step

    in_place = Memory.of(m, None)
    monkeypatch.setattr(step, "build", lambda net, b: None)
    monkeypatch.setattr(m.net, "c_steps", {})
    copies = Memory.of(m, None)
    assert not in_place.copies and copies.copies
    two, cap = set(m.budgets[:2]), 40
    assert len(two) == 2
    row = [cap * copies.kv_token[b] + copies.state[b] for b in two]
    assert in_place.bytes(3, cap, two) == 3 * sum(row)
    assert copies.bytes(3, cap, two) == 3 * (sum(row) + max(row))
    assert copies.bytes(3, cap, {m.budgets[0]}) == in_place.bytes(3, cap, {m.budgets[0]})


def test_admission_times_a_whole_batch_then_alone_and_keeps_the_faster():
    admission = Admission(probe_s=0.05)
    assert admission.limit(8) == 8  # the first jobs run batched, as many as it may hold, until 0.05 s is timed
    admission.add(4, 100, 0.03)
    assert admission.limit(8) == 8
    admission.add(4, 100, 0.03)  # 200 tokens in 0.06 s batched
    assert admission.limit(8) == 1  # now alone (once the batch drains), until as much is timed
    admission.add(1, 100, 0.02)
    assert admission.limit(8) == 1
    admission.add(1, 200, 0.04)  # 5000 tok/s alone against 3333 batched: one at a time from here on
    assert admission.limit(8) == 1
    admission.add(4, 800, 0.06)  # 8333 tok/s batched over both steps: batched
    assert admission.limit(8) == 8
    assert Admission(fixed=True).limit(8) == 8 and Admission().limit(1) == 1


@pytest.mark.parametrize("alone_faster", [True, False])
def test_a_batch_holds_one_row_where_alone_decodes_faster(m, monkeypatch, alone_faster):
    """The scheduler follows its Admission: rows join up to max_batch only where the timed batched steps made
    more tokens a second than the lone ones (rigged here: timings are not for tests)."""

    class Rigged(Admission):
        def add(self, rows, tokens, seconds):
            super().add(rows, tokens, 0.1 * tokens * (1 if (rows == 1) == alone_faster else 3))

    sizes = batch_sizes(monkeypatch)
    lines = [(i + 1, request(f"r{i}", {"messages": user(f"q {i}"), "max_tokens": 6, "max_think_tokens": 3}))
             for i in range(24)]
    jobs = parse(lines, Checker.for_model(m).job)
    out = {job.custom_id: r for job, r in run_jobs(m, jobs, max_batch=4, admission=Rigged())}
    assert len(out) == 24 and sizes[0] == 4  # a whole batch timed first, then (once it drained) one row alone
    after = sizes[sizes.index(1):]
    if alone_faster:  # one at a time from then on
        assert max(after) == 1
    else:  # full again while jobs wait (lone steps while it was timed alone, and at the tail)
        assert after.count(4) > 2 * after.count(1)


def test_killed_with_sigkill_and_rerun_gives_every_custom_id_once(ckpt, tmp_path):
    n = 120
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(request(f"id-{i}", {"messages": user(f"prompt number {i}"), "max_tokens": 12,
                                                 "max_think_tokens": 12}) + "\n" for i in range(n)))
    cmd = [sys.executable, "-m", "elastic_local.cli", "batch", str(src), str(out), str(ckpt), "--max-batch", "4"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_bytes().count(b"\n")
    assert 5 <= written < n, "the run was not killed mid-file"
    with out.open("ab") as f:  # what a write cut short by the kill leaves
        f.write(b'{"id": "batch_req_0123", "custom_id": "id-')
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    ids = [r["custom_id"] for r in records(out)]
    assert sorted(ids) == sorted(f"id-{i}" for i in range(n))
    assert all(r["error"] is None for r in records(out))


def test_output_file_repairs_a_torn_line_and_refuses_a_foreign_file(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputFile(out) as f:
        f.write({"id": "a", "x": 1})
        with pytest.raises(OutputError, match="another run"):
            OutputFile(out)
    out.write_bytes(out.read_bytes() + b'{"id": "b", "x"')
    with OutputFile(out) as f:
        assert f.done == {"a"} and f.repaired == len(b'{"id": "b", "x"')
        f.write({"id": "b"})
    assert [r["id"] for r in records(out)] == ["a", "b"]
    (tmp_path / "other.jsonl").write_text("hello\nworld\n")
    with pytest.raises(OutputError, match="line 1"):
        OutputFile(tmp_path / "other.jsonl")


def test_an_output_file_of_other_requests_is_kept_and_said(ckpt, tmp_path, capsys):
    """Appending answers to a file that holds another input's (a reused name) keeps them, and says so."""
    first, second, out = tmp_path / "first.txt", tmp_path / "second.jsonl", tmp_path / "out.jsonl"
    first.write_text("hello\nthere\n")
    second.write_text('{"custom_id": "mine", "prompt": "hi", "max_tokens": 2}\n')
    assert main(["batch", str(first), str(out), str(ckpt), "--max-tokens", "2"]) == 0
    assert "none of them" not in capsys.readouterr().err
    assert main(["batch", str(second), str(out), str(ckpt)]) == 0
    err = capsys.readouterr().err
    assert f"{out}: holds 2 records, none of them for {second}'s requests; appending after them" in err
    ids = [r["custom_id"] for r in records(out)]
    assert sorted(ids[:2]) == ["line-1", "line-2"] and ids[2] == "mine"
    assert main(["batch", str(second), str(out), str(ckpt)]) == 0  # a rerun resumes, quietly
    err = capsys.readouterr().err
    assert "none of them" not in err and "1 from before" in err and len(records(out)) == 3


def test_plain_text_and_prompt_jsonl_forms_and_dry_run(ckpt, tmp_path, capsys):
    text = tmp_path / "prompts.txt"
    text.write_text("what is two plus two\n\n{not json, just a prompt}\nname a color\n")
    items = parse(read_lines(text), Checker.for_checkpoint(ckpt).job)
    assert [(it.line, it.custom_id) for it in items] == [(1, "line-1"), (3, "line-3"), (4, "line-4")]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "hello"}\n{"custom_id": "mine", "prompt": "there", "max_tokens": 2}\n[1, 2]\n')
    items = parse(read_lines(jsonl), Checker.for_checkpoint(ckpt).job)
    assert [it.custom_id for it in items] == ["line-1", "mine", None] and isinstance(items[2], LineError)
    assert items[1].request.max_answer_tokens == 2 and items[0].url == CHAT
    out = tmp_path / "never.jsonl"
    assert main(["batch", str(jsonl), str(out), str(ckpt), "--dry-run"]) == 1
    report = capsys.readouterr().out
    assert "3 requests, 2 valid" in report and "line 3: expected" in report and not out.exists()
    assert main(["batch", str(text), str(out), str(ckpt), "--dry-run"]) == 0


def test_duplicate_custom_ids_are_named_by_line(ckpt, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([request("a", {"messages": user("1")}), request("b", {"messages": user("2")}),
                              request("a", {"messages": user("3")})]) + "\n")
    assert main(["batch", str(src), str(tmp_path / "out.jsonl"), str(ckpt)]) == 2
    assert "custom_id 'a' is used on lines 1, 3" in capsys.readouterr().err
    assert check_unique(parse(read_lines(src), Checker.for_checkpoint(ckpt).job))


def test_progress_line_and_summary():
    import io

    from elastic_local.batch.progress import ProgressBar, Summary

    s = Summary(requests=10, skipped=2)
    out = io.StringIO()
    bar = ProgressBar(s, out, every=0.0)
    s.add(True, prompt_tokens=5, completion_tokens=40)
    s.add(False)
    bar.step(40)
    line = out.getvalue().splitlines()[-1]
    assert "4/10 done, 1 errors" in line and "tok/s" in line and "eta" in line and "eta ?" not in line
    assert "1 done and 1 errors in this run, 2 from before" in s.line() and s.to_dict()["completion_tokens"] == 40
    s.interrupted = True
    assert "run the same command to finish" in s.line()
