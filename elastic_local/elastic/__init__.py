"""Elastic budgets: importance, nesting and slicing (see SPEC §2, §4)."""
