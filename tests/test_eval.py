"""`elastic-local eval` on a few items: the report holds every section, its table and JSON, and the plot."""

from __future__ import annotations

import json

from elastic_local.cli import main
from elastic_local.evaluate.report import pareto
from elastic_local.evaluate.run import asked_second, eval_items, follow_ups
from elastic_local.tasks.families import FOLLOW_UP


def test_eval_on_a_few_items_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "frontier.png"
    assert main(["eval", "--items", "1", "--levels", "1", "--precisions", "fp8,nvfp4-a4", "--json", str(out),
                 "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    for heading in ("accuracy per budget and level", "accuracy per budget and family", "budget control",
                    "asked second in a chat", "follow-ups on those items' answers", "load-time quantization"):
        assert heading in text
    report = json.loads(out.read_text())
    full = next(s for s in report["scores"] if (s["think"], s["answer"], s["precision"]) == ("full", "full", "bf16"))
    families = text.split("accuracy per budget and family")[1].split("\n\n")[0].splitlines()
    assert families[1].split() == ["budget", "addition", "comparison", "counting", "equation", "sorting",
                                   "subtraction", "word", "problem"]
    assert families[2].split() == ["full"] + [f"{100 * full['by_family'][f]:.1f}%" for f in sorted(full["by_family"])]
    assert report["items"] == 7 and list(report["budgets"]) == ["full", "mid", "small"]
    pairs = {(c["think"], c["answer"]) for c in report["control"]}
    assert pairs == {("small", "small"), ("small", "full"), ("mid", "full"), ("full", "small"), ("full", "full")}
    quantized = {(p["budget"], p["precision"]) for p in report["precision"]}
    assert quantized == {(b, p) for b in ("full", "mid", "small") for p in ("fp8", "nvfp4-a4")}
    for s in report["scores"]:
        assert s["n"] == 7 and 0 <= s["accuracy"] <= 1 and s["seconds_per_item"] > 0
        assert set(s["by_level"]) == {"1"}
    second = report["asked_second"]
    assert second["budget"] == "full" and second["second"]["n"] == 7 and 0 <= second["second"]["accuracy"] <= 1
    ups = report["follow_ups"]
    assert ups["think"] == "full" and ups["n"] == 6 and 0 <= ups["accuracy"] <= 1  # every family but sorting
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_asked_second_puts_another_item_s_question_and_answer_before_each_question():
    its = eval_items(1, levels=(1,))
    chats = asked_second(its)
    assert len(chats) == len(its)
    for it, chat in zip(its, chats):
        assert [m["role"] for m in chat] == ["user", "assistant", "user"] and chat[-1]["content"] == it.question
        before = next(b for b in its if b.question == chat[0]["content"])
        assert before is not it and chat[1]["content"] == before.answer


def test_follow_ups_ask_about_each_numeric_item_s_answer_right_after_it():
    its = eval_items(2)
    ups, chats = follow_ups(its, seed=1234)
    assert (ups, chats) == follow_ups(its, seed=1234)
    numeric = [it for it in its if it.family != "sorting"]
    assert len(ups) == len(chats) == len(numeric)
    for it, up, chat in zip(numeric, ups, chats):
        assert up.family == FOLLOW_UP and up.level == it.level and up.trace.startswith(f"that is {it.truth}\n")
        assert chat == [{"role": "user", "content": it.question}, {"role": "assistant", "content": it.answer},
                        {"role": "user", "content": up.question}]


def test_frontier_keeps_only_configurations_nothing_beats():
    pts = [(1.0, 0.5), (2.0, 0.9), (1.5, 0.4), (3.0, 0.9), (0.5, 0.2)]
    assert pareto(pts) == [4, 0, 1]


def test_eval_of_a_quantized_file_labels_its_rows_with_what_it_stores(tmp_path, capsys):
    from elastic_local.paths import DEMO_MODEL

    assert main(["quantize", str(DEMO_MODEL), str(tmp_path / "fp8"), "--precision", "fp8"]) == 0
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main(["eval", str(tmp_path / "fp8"), "--items", "1", "--levels", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "accuracy per budget and level (fp8, greedy)" in text and "load-time quantization" not in text
    report = json.loads(out.read_text())
    assert report["base"] == "fp8" and {s["precision"] for s in report["scores"]} == {"fp8"}
