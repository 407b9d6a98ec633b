"""A model's tokenizer straight from its ``tokenizer.json``, without transformers.

transformers' ``AutoTokenizer`` wraps the same Rust tokenizer (the ``tokenizers`` library), but
importing and building it costs about a second on a small CPU. For tokenizer files transformers
itself saved with the plain tokenizers backend, ``FastTokenizer`` encodes, decodes and renders chat
templates the way ``AutoTokenizer`` does (the same Rust object, the same Jinja sandbox settings;
tested token for token against it on every bundled model). Others load through transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

# tokenizer classes whose tokenizer.json holds everything transformers adds (tested)
_PLAIN_CLASSES = ("Qwen2Tokenizer", "TokenizersBackend", "GPT2Tokenizer")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


class FastTokenizer:
    """The part of transformers' tokenizer API selfspec uses, over ``tokenizers.Tokenizer``."""

    def __init__(self, folder: str | Path, settings: dict):
        from tokenizers import Tokenizer

        folder = Path(folder)
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.name_or_path = str(folder)
        template = folder / "chat_template.jinja"
        self.chat_template = (
            template.read_text() if template.is_file() else settings.get("chat_template")
        )
        self.special_tokens_map = {
            name: settings[name] for name in _SPECIAL_NAMES if isinstance(settings.get(name), str)
        }
        for name in _SPECIAL_NAMES:
            token = self.special_tokens_map.get(name)
            token_id = None if token is None else self._tokenizer.token_to_id(token)
            setattr(self, name, token)
            setattr(self, f"{name}_id", token_id)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs,
    ):
        """One conversation through the chat template, as transformers renders it (messages'
        None values dropped, special tokens visible to the template by name)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        text = self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids

    @cached_property
    def _template(self):
        return _compile_template(self.chat_template)


def _compile_template(source: str):
    """transformers' sandbox for chat templates: the same environment options, filters and
    globals (its generation-tracking extension only marks spans, which selfspec never asks for)."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def fast_tokenizer_settings(folder: str | Path) -> dict | None:
    """``tokenizer_config.json`` when ``FastTokenizer`` reads this folder's tokenizer as
    transformers does, else None."""
    folder = Path(folder)
    config = folder / "tokenizer_config.json"
    if not (config.is_file() and (folder / "tokenizer.json").is_file()):
        return None
    settings = json.loads(config.read_text())
    plain = (
        settings.get("backend") == "tokenizers"
        and settings.get("tokenizer_class") in _PLAIN_CLASSES
        and not settings.get("clean_up_tokenization_spaces")
        and not settings.get("add_bos_token")
        and not settings.get("add_eos_token")
    )
    return settings if plain else None


def load_tokenizer_from(folder: str | Path):
    """The tokenizer in ``folder``: ``FastTokenizer`` where it reads it as transformers does,
    else transformers' ``AutoTokenizer``."""
    settings = fast_tokenizer_settings(folder)
    if settings is not None:
        return FastTokenizer(folder, settings)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
