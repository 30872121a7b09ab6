"""Offline batch prompt files (OpenAI batch JSONL or plain prompts) with continuous batching."""
