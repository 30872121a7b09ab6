"""Screens: loading (fit pick and progress), chat, help, rename."""
