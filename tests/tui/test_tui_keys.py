"""The chat app's keys a person moves (keys.toml) and the clipboard: copying a reply, its thinking, the last
message or the whole conversation."""

from __future__ import annotations

import pytest
from elastic_local.tui import keys
from elastic_local.tui.app import ElasticChat
from elastic_local.tui.cli import main
from elastic_local.tui.commands import CommandError, parse
from elastic_local.tui.export import to_markdown
from elastic_local.tui.screens.chat import ChatScreen
from elastic_local.tui.screens.help import HelpScreen, key_rows
from elastic_local.tui.store import Store
from elastic_local.tui.widgets.prompt import PromptInput
from test_tui_start import _headless
from tui_util import QUESTION, make_app, wait_until


def test_every_action_of_keys_toml_is_a_binding_with_that_id_and_default():
    bound = {b.id: b.key for b in ElasticChat.BINDINGS + ChatScreen.BINDINGS}
    assert bound == keys.ACTIONS


@pytest.mark.parametrize("text, message", [
    ('answer_budget = "f8"\nstop = "Escape, ctrl+g"\n', None),
    ('answr_budget = "f7"\n', r"no action 'answr_budget'; the actions are quit, stop, think_budget"),
    ('copy = "ctrl+f99"\n', r"copy = 'ctrl\+f99': 'ctrl\+f99' is not a key name"),
    ('copy = 7\n', r'copy = 7: write the key as a string, e.g. copy = "f5"'),
    ('help = "f3"\n', r"f3 is given to both answer_budget and help; move one of them"),
    ('new = "enter"\n', r"new = 'enter': the message input takes enter \(to type, send, move or edit\)"),
    ('answer_budget = "f7"\n', r"answer_budget = 'f7': the message input takes f7"),  # TextArea's select-all
    ('copy = "y"\n', r"copy = 'y': the message input takes y"),
    ('copy = "shift+y"\n', r"copy = 'shift\+y': the message input takes shift\+y"),
    ('copy = "comma"\n', r"copy = 'comma': the message input takes comma"),
    ('copy = "f5\n', r"not TOML"),
])
def test_keys_toml_is_read_or_refused_naming_the_file_and_the_action(tmp_path, text, message):
    file = tmp_path / "keys.toml"
    file.write_text(text)
    if message is None:
        assert keys.load(file) == {"answer_budget": "f8", "stop": "escape,ctrl+g"}
    else:
        with pytest.raises(keys.KeysError, match=rf"{file}: .*{message}" if "not TOML" in message else
                           rf"{file}: {message}"):
            keys.load(file)


def test_no_keys_toml_changes_nothing(home):
    assert not keys.path().exists() and keys.load() == {}
    assert keys.path().parent == home


def test_a_bad_keys_toml_stops_elastic_chat_with_one_line_before_any_screen(home, monkeypatch, capsys):
    home.mkdir(parents=True)
    keys.path().write_text('thinking = "f9"\nthink = "f2"\n')
    apps = _headless(monkeypatch)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elastic-chat: error: {keys.path()}: no action 'think'") and len(err.splitlines()) == 1
    assert apps == []


async def send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")


async def replied(pilot) -> None:
    await wait_until(pilot, lambda: pilot.app.session.turn and pilot.app.session.turn.reply.status == "done")
    await pilot.pause()


@pytest.mark.anyio
async def test_a_moved_key_does_the_action_and_the_footer_and_help_show_it(model):
    app = make_app(model, keys={"answer_budget": "f8", "help": "ctrl+o"})
    async with app.run_test(size=(80, 24)) as pilot:
        session = app.session
        await pilot.press("f3")  # no longer the answer budget's
        assert session.budgets["answer"] == "full"
        await pilot.press("f8")
        assert session.budgets["answer"] == "mid"
        footer = {b.binding.id: key for key, b in app.screen.active_bindings.items() if b.binding.id}
        assert footer["answer_budget"] == "f8" and footer["help"] == "ctrl+o"
        await pilot.press("f1")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, HelpScreen)
        rows = dict(key_rows(app.screen.bindings, app.screen.keymap))
        assert rows["f8"].startswith("next answer budget") and rows["ctrl+o"] == "this help"
        assert "f3" not in rows and "f1" not in rows


@pytest.mark.anyio
async def test_copy_puts_the_answer_the_thinking_the_message_or_the_chat_on_the_clipboard(model):
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f5")
        assert app.clipboard == ""  # nothing yet: said, not copied
        await send(pilot, QUESTION)
        await replied(pilot)
        reply = app.session.turn.reply
        await pilot.press("f5")
        assert app.clipboard == reply.answer and reply.answer.startswith("237 + 682 = ")
        for command, want in [("/copy think", reply.think), ("/copy prompt", QUESTION), ("/copy", reply.answer),
                              ("/copy all", to_markdown(Store().conversation(app.screen.conversation_id)))]:
            await send(pilot, command)
            await pilot.pause()
            assert app.clipboard == want, command
        assert "## User" in app.clipboard and "carry" in app.clipboard  # the chat, thinking included


def test_copy_command_says_how_to_write_it():
    assert parse("/copy").text == "answer" and parse("/copy think").text == "think"
    with pytest.raises(CommandError, match="/copy everything: write /copy"):
        parse("/copy everything")
