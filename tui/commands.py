"""Slash commands: what the keys do, in words. Parsing only; the chat screen carries them out.

    /budget think=12B answer=30B    budgets of the phases (either one alone is fine)
    /think on|off                   thinking for the next messages
    /think 256                      the think token budget (tokens before the engine closes thinking)
    /system TEXT                    this conversation's system prompt (empty: none)
    /sample temperature=0.7 top_p=0.9  sampling (also top_k=, min_p=, seed=); /sample off: greedy
    /new                            a new conversation
    /export                         write this conversation as Markdown and JSON
    /copy [think|prompt|all]        the last answer to the clipboard (or its thinking, your message, the chat)
    /help                           every key and command
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .session import SAMPLING

COPY = ("", "answer", "think", "prompt", "all")
HELP = [line.strip() for line in __doc__.splitlines()[2:] if line.strip()]


class CommandError(ValueError):
    """A slash command that cannot be carried out; the message says how to write it."""


@dataclass(frozen=True)
class Command:
    name: str  # "budget" | "think" | "system" | "sample" | "new" | "export" | "copy" | "help"
    budgets: dict[str, str] = field(default_factory=dict)
    sampling: dict[str, float | int | None] = field(default_factory=dict)  # /sample's settings
    thinking: bool | None = None
    think_tokens: int | None = None
    text: str = ""  # /system's prompt; /copy's what


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
    if name == "sample":
        return Command("sample", sampling=_sampling(rest))
    if name == "copy":
        if rest not in COPY:
            raise CommandError(f"/copy {rest}: write /copy (the last answer), /copy think, /copy prompt or /copy all")
        return Command("copy", text=rest or "answer")
    if name in ("new", "export", "help"):
        if rest:
            raise CommandError(f"/{name} takes nothing after it")
        return Command(name)
    raise CommandError(f"unknown command /{name}; /help lists them")


SAMPLE_HOW = "write /sample temperature=T top_p=P top_k=K min_p=P seed=N (any of them), or /sample off"


def _sampling(rest: str) -> dict[str, float | int | None]:
    """/sample's settings: "off" is greedy (temperature 0); seed=none draws a new seed each reply. Their
    ranges are the engine's to check (Sampling), against the settings they join."""
    if rest == "off":
        return {"temperature": 0.0}
    out: dict[str, float | int | None] = {}
    for part in rest.split():
        key, sep, value = part.partition("=")
        if key not in SAMPLING or not sep or not value:
            raise CommandError(f"/sample {rest}: {SAMPLE_HOW}")
        try:
            out[key] = None if key == "seed" and value == "none" else \
                int(value) if key in ("top_k", "seed") else float(value)
        except ValueError:
            raise CommandError(f"/sample {rest}: {key} takes a number; {SAMPLE_HOW}") from None
    if not out:
        raise CommandError(f"/sample: {SAMPLE_HOW}")
    return out
