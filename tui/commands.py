"""Slash commands: what the keys do, in words. Parsing only; the chat screen carries them out.

    /budget think=12B answer=30B    budgets of the phases (either one alone is fine)
    /think on|off                   thinking for the next messages
    /think 256                      the think token budget (tokens before the engine closes thinking)
    /system TEXT                    this conversation's system prompt (empty: none)
    /new                            a new conversation
    /export                         write this conversation as Markdown and JSON
    /help                           every key and command
"""

from __future__ import annotations

from dataclasses import dataclass, field

HELP = [line.strip() for line in __doc__.splitlines()[2:] if line.strip()]


class CommandError(ValueError):
    """A slash command that cannot be carried out; the message says how to write it."""


@dataclass(frozen=True)
class Command:
    name: str  # "budget" | "think" | "system" | "new" | "export" | "help"
    budgets: dict[str, str] = field(default_factory=dict)
    thinking: bool | None = None
    think_tokens: int | None = None
    text: str = ""


def parse(line: str) -> Command:
    """A slash command from the input line (which starts with "/")."""
    name, _, rest = line.strip()[1:].partition(" ")
    rest = rest.strip()
    if name == "budget":
        budgets = {}
        for part in rest.split():
            phase, sep, value = part.partition("=")
            if phase not in ("think", "answer") or not sep or not value:
                raise CommandError(f"/budget {rest}: write /budget think=NAME answer=NAME (either one)")
            budgets[phase] = value
        if not budgets:
            raise CommandError("/budget: write /budget think=NAME answer=NAME (either one)")
        return Command("budget", budgets=budgets)
    if name == "think":
        if rest in ("on", "off"):
            return Command("think", thinking=rest == "on")
        if rest.isdigit():
            return Command("think", think_tokens=int(rest))
        raise CommandError(f"/think {rest}: write /think on, /think off or /think N (the think token budget)")
    if name == "system":
        return Command("system", text=rest)
    if name in ("new", "export", "help"):
        if rest:
            raise CommandError(f"/{name} takes nothing after it")
        return Command(name)
    raise CommandError(f"unknown command /{name}; /help lists them")
