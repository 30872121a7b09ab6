"""The chat session's turn lifecycle (saved, then begun once the screen has drawn it) and the pace at which
the generation worker hands the UI its batches."""

from __future__ import annotations

from elastic_local.tui.reply import Pace, Reply, pump
from elastic_local.tui.session import ChatSession
from elastic_local.tui.store import Store
from tui_util import QUESTION

from elastic_local.engine.events import CatchUp, Switch, Token


def run(session: ChatSession, turn) -> list:
    posted: list = []
    session.begin(turn)
    pump(turn.stream, turn.reply, session.save, posted.append)
    return posted


def test_escape_before_the_reply_begins_stops_it_and_keeps_the_message(model):
    store = Store()
    session = ChatSession(model, store, max_think_tokens=64, max_answer_tokens=32)
    cid = store.new_conversation()
    turn = session.start(cid, QUESTION)
    assert session.cancel() and turn.stream is None
    run(session, turn)
    assert turn.reply.status == "stopped" and not session.streaming
    saved = store.conversation(cid).messages
    assert [m.role for m in saved] == ["user", "assistant"] and saved[0].content == QUESTION
    assert saved[1].status == "stopped"


def test_a_budget_switched_before_the_reply_begins_is_where_it_starts(model):
    store = Store()
    session = ChatSession(model, store, max_think_tokens=16, max_answer_tokens=16)
    turn = session.start(store.new_conversation(), QUESTION)
    small = model.budgets[-1]
    session.set_budget("answer", small)
    run(session, turn)
    assert turn.reply.answer_budget == small and turn.reply.marks == []  # no switch: it never ran on another
    assert turn.stream.result.stats.answer_budgets == [small]


def test_the_pace_keeps_the_ui_share_of_the_time_within_bounds():
    pace = Pace(share=0.05, fastest=0.1, slowest=1.0)  # the defaults but a slower floor, to see it hold
    assert pace.every == 0.1
    pace.measured(0.002)  # cheap frames: as often as allowed
    assert pace.every == 0.1
    pace.measured(0.030)  # 30 ms of UI work per batch: a batch every 0.6 s keeps it at 5%, at once
    assert abs(pace.every - 0.6) < 1e-9
    pace.measured(0.2)  # never less than a batch a second
    assert pace.every == 1.0
    pace.measured(0.0)  # cheap again: faster by halves, not in one step
    assert abs(pace.every - 0.55) < 1e-9


def test_only_a_switch_and_its_catch_up_are_posted_ahead_of_the_pace():
    def tok(text: str, phase: str) -> Token:
        return Token(0, 1, text, phase, "full", False, 0.0)

    prefill = CatchUp(0, "full", 20, 0.01, prefill=True, transplanted=False, t=0.0)
    events = [prefill, tok("a", "think"), tok("b", "think"), tok("c", "answer"), Switch("answer", "mid", 0.0),
              CatchUp(0, "mid", 3, 0.01, prefill=False, transplanted=False, t=0.0), tok("d", "answer")]
    posted, saved = [], []
    reply = Reply("full", "full", True)
    pump(events, reply, lambda r: saved.append(r.answer), posted.append, Pace(every=100.0))
    assert posted == [events[:5], events[5:6], events[6:]]  # the phase change and the prefill wait
    assert saved == ["c", "c", "cd"] and reply.status == "stopped"  # no Done: the stream ended early


def test_a_phase_rate_counts_the_tokens_after_its_first_clock_reading():
    """A greedy row's run ahead hands over its tokens with one clock reading each run: a rate counted from
    the first token's time took a whole run as made in no time (the status line showed 139,000 answer
    tokens/s for a reply the engine timed at 6,850). Once the reply is done the line shows the engine's
    own account, as the reply's last line does."""
    from elastic_local.tui.widgets.status import rate

    r = Reply("full", "full")
    for _ in range(11):  # the first run: nothing to time yet
        r.apply(Token(0, 7, "x", "answer", "full", False, 1.0))
    assert r.rates["answer"].per_second is None and rate(r, "answer") == "-"
    for _ in range(20):  # the next run, 2 ms later
        r.apply(Token(0, 7, "x", "answer", "full", False, 1.002))
    assert round(r.rates["answer"].per_second) == 10000 and rate(r, "answer") == "10000"
    r.stats = {"think_tokens": 0, "think_s": 0.0, "answer_tokens": 31, "answer_s": 0.0062}
    assert rate(r, "answer") == "5000" and rate(r, "think") == "-"
    r.stats["answer_s"] = 0.5
    assert rate(r, "answer") == "62"
    r.stats.update(think_tokens=71, think_inserted=63, think_s=0.004)  # a think budget of 8 closed by the engine
    assert rate(r, "think") == "2000"


def test_a_switch_is_charged_its_own_catch_up_not_the_prompts_prefill():
    """A switch made as a message is sent can reach the engine before the prompt's prefill is reported; the
    prefill then ran on the budget switched to and nothing caught up (the app said "caught up 22 tokens"
    where the reply's own line said 0)."""
    r = Reply("mid", "full")
    r.apply(Switch("answer", "mid", 0.0))
    r.apply(CatchUp(0, "mid", 22, 0.03, prefill=True, transplanted=False, t=0.03))
    assert r.marks[0].tokens is None and "caught up" not in r.marks[0].label()
    r.apply(Switch("answer", "small", 0.1))
    r.apply(CatchUp(0, "small", 40, 0.02, prefill=False, transplanted=False, t=0.12))
    assert (r.marks[1].tokens, r.marks[1].seconds) == (40, 0.02) and r.marks[0].tokens is None
