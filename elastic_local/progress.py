"""The progress callback every long piece of work takes: (done, total, what)."""

from collections.abc import Callable

Progress = Callable[[int, int, str], None]
