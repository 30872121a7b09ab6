"""elastic-chat: the terminal chat app (Textual). Holds no model logic; it drives the engine."""
