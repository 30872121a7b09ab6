"""The chat screen's widgets: each owns its state and posts messages; the screen wires them."""
