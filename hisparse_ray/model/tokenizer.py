"""Text <-> token ids for the front doors (ring 2): one small interface, two implementations.

* :class:`ByteTokenizer` - the built-in tiny models' (vocab 96): printable ASCII 32..126 -> ids
  1..95, any other byte -> 0 (decoded as ``?``); no end-of-sequence id; a plain-text chat format.
* :class:`HFTokenizer` - a model folder's ``tokenizer.json`` (the ``tokenizers`` library) with
  ``tokenizer_config.json``'s special tokens, ``add_bos_token`` and Jinja ``chat_template``
  (rendered like transformers' ``apply_chat_template``; tests compare the two).

Streaming: :meth:`Tokenizer.stream` returns a :class:`TextStream` whose ``push(ids)`` returns only
the text that became final: a multi-byte character split across tokens is held back until it is
complete, and a token that changes how earlier ones decode (leading-space rules) never makes
already-returned text wrong, so the pieces concatenate to ``decode(all ids)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence

from hisparse_ray.errors import CheckpointError, ConfigError

Message = dict[str, Any]


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...
    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]: ...
    def stream(self, *, skip_special_tokens: bool = True) -> "TextStream": ...


class TextStream:
    """Incremental detokenizer of one sequence: ``push(new ids) -> new final text``.

    Keeps a window ``ids[prefix:]``; text decoded from the window beyond what was already read is
    returned when it does not end in U+FFFD (an incomplete character); the window then slides so
    that the cost per token stays bounded.
    """

    def __init__(self, tokenizer: "BaseTokenizer", skip_special_tokens: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0    # ids whose text was returned

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        dec = lambda a, b: self._tok.decode(self._ids[a:b], skip_special_tokens=self._skip)  # noqa: E731
        before = dec(self._prefix, self._read)
        now = dec(self._prefix, len(self._ids))
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]

    def flush(self) -> str:
        """The held-back tail (an incomplete character decodes as U+FFFD) at the sequence's end."""
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(before):] if text.startswith(before) else ""


class BaseTokenizer:
    """What both implementations share: chat encoding and streaming on top of encode / decode."""

    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        raise NotImplementedError

    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """The rendered chat template's ids (the template carries its own BOS: none added)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def stream(self, *, skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self, skip_special_tokens)


class ByteTokenizer(BaseTokenizer):
    """Byte-level tokenizer of the tiny built-in models (vocab 96). Chat format: one
    ``"{role}: {content}\\n"`` line per message, then ``"assistant: "`` for the reply."""

    vocab_size = 96

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [b - 31 if 32 <= b <= 126 else 0 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 31) if 1 <= i <= 95 else "?" for i in ids)

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


def _token_text(v: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(v, dict):
        return v.get("content")
    return v


class HFTokenizer(BaseTokenizer):
    """A model folder's tokenizer: ``tokenizer.json`` + ``tokenizer_config.json`` (optional), plus
    ``generation_config.json``'s ``eos_token_id`` (optional; an int or a list; without that file,
    config.json's, as transformers derives its generation config) for the stop ids."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(str(self.folder), "tokenizer.json", "missing (the folder has no HF tokenizer: "
                                  "give token ids, not text)")
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as err:  # the Rust library raises its own Exception type
            raise CheckpointError("tokenizer.json", "-", f"not loadable by tokenizers ({err})") from None
        cfg_path = self.folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.chat_template = self.config.get("chat_template")
        tmpl = self.folder / "chat_template.jinja"
        if self.chat_template is None and tmpl.is_file():
            self.chat_template = tmpl.read_text()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id(self.bos_token)
        eos = {self._id(self.eos_token)} - {None}
        # transformers' generation config: generation_config.json, else the model's config.json
        gen = self.folder / "generation_config.json"
        if not gen.is_file():
            gen = self.folder / "config.json"
        if gen.is_file():
            g = json.loads(gen.read_text()).get("eos_token_id")
            eos |= set(g if isinstance(g, list) else [] if g is None else [g])
        self.eos_token_ids = tuple(sorted(eos))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``chat_template`` (Jinja, sandboxed) with ``messages``, ``add_generation_prompt``,
        the special tokens and ``kwargs`` (``tools``, ...), as transformers does."""
        if not self.chat_template:
            raise ConfigError("chat_template", None, f"{self.folder} has no chat template "
                              "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        return _render(self.chat_template, messages=list(messages),
                       add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                       eos_token=self.eos_token or "", **kwargs)


def _render(template: str, **ctx: Any) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template).render(**ctx)
