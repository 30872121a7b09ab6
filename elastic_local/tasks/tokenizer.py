"""The demo model's tokenizer: byte-level BPE trained on the corpus with `tokenizers`, every digit its own
token (so column arithmetic sees one digit per position), and the chat and think specials.

The chat template is ChatML with Nemotron-3's thinking convention, the one the engine renders: an earlier
assistant turn is its answer alone (`<think></think>answer`), the generation prompt opens thinking
(`<think>\\n`) or, with enable_thinking false, closes it at once. It renders a chat's latest question only, or
every turn for a model trained on multi-turn conversations (CHAT_TEMPLATES says why).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# A chat as the engine renders it: ChatML, an earlier assistant turn as its answer alone. `latest` shows the
# model a chat's latest question (and any system message) and not the turns before it, for a model whose
# corpus holds one question per conversation: with the whole history rendered such a model answered a
# question asked second far worse than asked first (`elastic-local eval`'s "asked second"; README, "The
# embedded demo model"). `all` renders every turn, for a corpus with multi-turn conversations.
_TURN = (
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n<think></think>' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
)
_GENERATION_PROMPT = (
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' ~ ('<think>\\n' if enable_thinking is not defined or enable_thinking "
    "else '<think></think>') -}}"
    "{%- endif -%}"
)
CHAT_TEMPLATES = {
    "latest": (
        "{%- set latest = namespace(user=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set latest.user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for m in messages -%}{%- if m.role == 'system' or loop.index0 >= latest.user -%}"
        + _TURN + "{%- endif -%}{%- endfor -%}" + _GENERATION_PROMPT
    ),
    "all": "{%- for m in messages -%}" + _TURN + "{%- endfor -%}" + _GENERATION_PROMPT,
}


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE of `vocab_size` tokens (specials included) learned from `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, path: str | Path, history: str = "latest") -> None:
    """tokenizer.json, tokenizer_config.json (specials, the chat template that renders `history`: "latest"
    or "all" turns) and generation_config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
              "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 4096,
              "chat_template": CHAT_TEMPLATES[history]}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    # think_close "": the task corpus never holds NVIDIA's closing sentence, and the demo model answered
    # thinking cut short at 8 tokens right 9 times in 63 after a bare </think>, once after the sentence
    gen = {"bos_token_id": ids["<s>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<pad>"],
           "think_close": ""}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
