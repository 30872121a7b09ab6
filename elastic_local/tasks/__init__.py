"""Reasoning task families with verifiable answers: the demo model's corpus and its checker."""
