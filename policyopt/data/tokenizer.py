"""Tokenizers: a tiny character tokenizer for the synthetic task, HuggingFace ones, and a
byte-level BPE trained on a task's own text (`train_bpe`, `python -m experiments.tokenizer`).

Both expose the same small interface, which is all the trainer and the sampler use:

```
tokenizer.encode(text) -> list[int]            # no BOS/EOS added
tokenizer.decode(ids, skip_special=True) -> str
tokenizer.encode_prompt(prompt) -> list[int]   # what the policy is conditioned on
tokenizer.wrap_prompt(ids) -> list[int]         # the same, from encoded prompt text
tokenizer.encode_response(response) -> list[int]   # the SFT target, ending with EOS
tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
tokenizer.stop_ids                              # further tokens that end a response
tokenizer.save(path); load_tokenizer(path)    # load_tokenizer also reads tokenizer.json
```

`encode_prompt` is where a chat template goes: the character tokenizer prepends BOS; a
HuggingFace tokenizer with ChatML tokens (Qwen) wraps the prompt in a user turn and opens
the assistant turn (see `HFTokenizer`). The response format of every task is
`<think>REASONING</think>\\boxed{ANSWER}`, followed by EOS.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

# Special tokens of the response format. In `CharTokenizer` each is ONE id.
PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
BOXED_OPEN = "\\boxed{"
BOXED_CLOSE = "}"

_CHAR_SPECIALS = (PAD, BOS, EOS, THINK_OPEN, THINK_CLOSE, BOXED_OPEN, BOXED_CLOSE)
# Digits first (the task is arithmetic), then operators and a little punctuation, then
# lowercase letters for short words. 7 specials + 10 + 12 + 26 = 55 ids.
_CHAR_ALPHABET = "0123456789" + "+-*/=(),.:; " + "abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Character-level tokenizer with the response-format markers as single tokens.

    Ids: `<pad>` = 0, `<bos>` = 1, `<eos>` = 2, `<think>` = 3, `</think>` = 4,
    `\\boxed{` = 5, `}` = 6, then one id per character of the alphabet. Encoding is
    greedy longest match, so `"<think>12</think>\\boxed{12}"` is 8 tokens. A character
    outside the alphabet raises `ValueError` naming it (there is no UNK: a silently
    mangled prompt would be a wrong data point).

    Args:
      alphabet: the single characters of the vocabulary, in id order after the specials.
    """

    def __init__(self, alphabet: str = _CHAR_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"CharTokenizer alphabet has repeated characters: {alphabet!r}")
        clashes = [c for c in alphabet if c in _CHAR_SPECIALS]
        if clashes:
            raise ValueError(
                f"CharTokenizer alphabet {alphabet!r} contains special tokens {clashes}"
            )
        self.alphabet = alphabet
        self.tokens: tuple[str, ...] = _CHAR_SPECIALS + tuple(alphabet)
        self._ids = {token: i for i, token in enumerate(self.tokens)}
        # Multi-character tokens, longest first, for greedy matching.
        self._multi = sorted((t for t in self.tokens if len(t) > 1), key=len, reverse=True)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def pad_id(self) -> int:
        return self._ids[PAD]

    @property
    def bos_id(self) -> int:
        return self._ids[BOS]

    @property
    def eos_id(self) -> int:
        return self._ids[EOS]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens other than EOS that end a response: none for this vocabulary."""
        return ()

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids dropped by `decode(..., skip_special=True)`: PAD, BOS and EOS."""
        return frozenset((self.pad_id, self.bos_id, self.eos_id))

    def token_to_id(self, token: str) -> int:
        """Id of one token (e.g. `"<think>"`); `KeyError` naming it if absent."""
        if token not in self._ids:
            raise KeyError(f"token {token!r} is not in the CharTokenizer vocabulary")
        return self._ids[token]

    def encode(self, text: str) -> list[int]:
        """Text to ids (greedy longest match; no BOS/EOS added)."""
        ids = []
        i = 0
        while i < len(text):
            for token in self._multi:
                if text.startswith(token, i):
                    ids.append(self._ids[token])
                    i += len(token)
                    break
            else:
                char = text[i]
                if char not in self._ids:
                    raise ValueError(
                        f"character {char!r} at position {i} of {text[:60]!r} is not in the "
                        f"CharTokenizer alphabet {self.alphabet!r}; the character tokenizer is "
                        "for the synthetic arithmetic task: for real text set model.tokenizer "
                        "(a tokenizer.json; `python -m experiments.tokenizer` trains one on the "
                        "task's files) or model.pretrained (a Hugging Face checkpoint folder)"
                    )
                ids.append(self._ids[char])
                i += 1
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Ids to text. With `skip_special`, PAD/BOS/EOS are dropped (think/boxed kept)."""
        pieces = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is outside the vocabulary [0, {len(self.tokens)})")
            if skip_special and i in self.special_ids:
                continue
            pieces.append(self.tokens[i])
        return "".join(pieces)

    def encode_prompt(self, prompt: str) -> list[int]:
        """`[BOS] + encode(prompt)`: the ids the policy is conditioned on."""
        return self.wrap_prompt(self.encode(prompt))

    def wrap_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The template around already encoded prompt text: `[BOS] + prompt_ids`."""
        return [self.bos_id] + list(prompt_ids)

    def encode_response(self, response: str) -> list[int]:
        """`encode(response) + [EOS]`: the SFT target (the policy must learn to stop)."""
        return self.encode(response) + [self.eos_id]

    def to_json(self) -> dict:
        return {"type": "char", "alphabet": self.alphabet, "tokens": list(self.tokens)}

    def save(self, path: str | os.PathLike) -> None:
        """Writes the vocabulary as JSON (saved with the run, so ids never drift)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, ensure_ascii=False, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if config.get("type") != "char":
            raise ValueError(f"{path}: not a CharTokenizer file (type={config.get('type')!r})")
        tokenizer = cls(config["alphabet"])
        if list(tokenizer.tokens) != config["tokens"]:
            raise ValueError(
                f"{path}: token list does not match its alphabet; file edited by hand?"
            )
        return tokenizer

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and self.tokens == other.tokens

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ChatML, as used by Qwen2/2.5/3: a user turn, then an open assistant turn.
CHATML_PROMPT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def _token_content(value) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    """A HuggingFace `tokenizer.json` (fast tokenizer) with a minimal chat template.

    The template is not the model's Jinja template (that would need a template engine and
    its every branch); it is the fixed string that template renders for one user message
    with generation prompt, for the one family policyopt imports checkpoints of:

    - ChatML (the vocabulary has `<|im_start|>` and `<|im_end|>`, e.g. Qwen3):
      `<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`; EOS is
      `<|im_end|>` (where the chat model stops) unless given. When EOS is another token
      (a base model's `<|endoftext|>`), `<|im_end|>` still ends a response: it is in
      `stop_ids`, so a model that closes its turn is not left to invent the next one.
    - Otherwise ("plain"): `[BOS] + prompt` when a BOS token is known, else the prompt.

    Qwen3's template adds an empty `<think>\\n\\n</think>` block only when thinking is
    disabled; RL with reasoning keeps thinking on, so nothing is added.

    Special tokens written in text are NOT parsed as control tokens by `encode` (the text
    `"<|im_end|>"` becomes ordinary pieces; `encode(text, parse_special=True)` parses them
    as HuggingFace does by default), and the template's own tokens are inserted by id, so
    a prompt from a data file cannot forge a turn boundary or an EOS.

    Args:
      tokenizer: a `tokenizers.Tokenizer`.
      bos_token / eos_token / pad_token: token strings; each must be in the vocabulary.
        Defaults: BOS none; EOS `<|im_end|>` for ChatML, else required; PAD = EOS.
      chat_template: "auto" (ChatML when its tokens exist, else plain), "chatml", "plain".
      stop_tokens: further tokens that end a response as EOS does (sampling stops on
        them; see `stop_ids`). `from_pretrained` adds `generation_config.json`'s
        `eos_token_id` list, as HuggingFace's `generate` does.
    """

    def __init__(
        self,
        tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str = "auto",
        stop_tokens: Sequence[str] = (),
    ):
        import tokenizers  # Imported here: the char tokenizer needs nothing.

        self.tokenizer = tokenizer
        # A copy that encodes special tokens found in text as plain text.
        self._text_tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True
        has_chatml = all(
            tokenizer.token_to_id(t) is not None for t in ("<|im_start|>", "<|im_end|>")
        )
        if chat_template == "auto":
            chat_template = "chatml" if has_chatml else "plain"
        if chat_template not in ("chatml", "plain"):
            raise ValueError(
                f"chat_template must be 'auto', 'chatml' or 'plain', got {chat_template!r}"
            )
        if chat_template == "chatml" and not has_chatml:
            raise ValueError(
                "chat_template='chatml' but the vocabulary lacks <|im_start|>/<|im_end|>"
            )
        self.chat_template = chat_template
        if eos_token is None and chat_template == "chatml":
            eos_token = "<|im_end|>"
        if eos_token is None:
            raise ValueError("HFTokenizer needs eos_token (no ChatML tokens to default to)")
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token = pad_token if pad_token is not None else eos_token
        self._bos_id = self._required_id(bos_token, "bos_token") if bos_token is not None else None
        self._eos_id = self._required_id(eos_token, "eos_token")
        self._pad_id = self._required_id(self.pad_token, "pad_token")
        self.stop_tokens = tuple(stop_tokens)
        stops = list(self.stop_tokens) + (["<|im_end|>"] if chat_template == "chatml" else [])
        stop_ids = [self._required_id(token, "stop_tokens") for token in stops]
        self._stop_ids = tuple(dict.fromkeys(i for i in stop_ids if i != self._eos_id))

    def _required_id(self, token: str, field: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field}={token!r} is not in the tokenizer vocabulary")
        return token_id

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> "HFTokenizer":
        """Loads a `tokenizer.json` file."""
        import tokenizers  # Imported here: the char tokenizer needs nothing.

        return cls(tokenizers.Tokenizer.from_file(os.fspath(path)), **kwargs)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs) -> "HFTokenizer":
        """Loads `tokenizer.json` from a local checkpoint folder (no network).

        BOS/EOS/PAD default to `tokenizer_config.json`'s `bos_token`/`eos_token`/`pad_token`
        when that file exists; keyword arguments override them. The ids of
        `generation_config.json`'s `eos_token_id` (an id or a list, e.g. Qwen2.5-Instruct's
        `[151645, 151643]`) become `stop_tokens` unless those are given.
        """
        import tokenizers  # Imported here: the char tokenizer needs nothing.

        tokenizer = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            for field in ("bos_token", "eos_token", "pad_token"):
                if field not in kwargs and _token_content(config.get(field)) is not None:
                    kwargs[field] = _token_content(config[field])
        generation_path = os.path.join(directory, "generation_config.json")
        if "stop_tokens" not in kwargs and os.path.exists(generation_path):
            with open(generation_path, encoding="utf-8") as f:
                end_ids = json.load(f).get("eos_token_id")
            end_ids = [end_ids] if isinstance(end_ids, int) else list(end_ids or ())
            tokens = [tokenizer.id_to_token(int(i)) for i in end_ids]
            missing = [i for i, token in zip(end_ids, tokens) if token is None]
            if missing:
                raise ValueError(f"{generation_path}: eos_token_id {missing} not in the vocabulary")
            kwargs["stop_tokens"] = tuple(tokens)
        return cls(tokenizer, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens other than EOS that end a response (sampling stops on them, with mask 1
        on the token, as on EOS): `<|im_end|>` under ChatML when EOS is another token, and
        the `stop_tokens`."""
        return self._stop_ids

    def token_to_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(f"token {token!r} is not in the tokenizer vocabulary")
        return token_id

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        """Text to ids, without the post-processor's BOS/EOS; special tokens in the text are
        kept as text unless `parse_special`."""
        tokenizer = self.tokenizer if parse_special else self._text_tokenizer
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def encode_prompt(self, prompt: str) -> list[int]:
        """The prompt with the chat template applied (see the class docstring)."""
        return self.wrap_prompt(self.encode(prompt))

    def wrap_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The chat template around already encoded prompt text (the text is tokenized on
        its own, so truncating `prompt_ids` never cuts into the template)."""
        if self.chat_template == "chatml":
            start, end = self.token_to_id("<|im_start|>"), self.token_to_id("<|im_end|>")
            newline = self.encode("\n")
            return (
                [start]
                + self.encode("user\n")
                + list(prompt_ids)
                + [end]
                + newline
                + [start]
                + self.encode("assistant\n")
            )
        prefix = [self._bos_id] if self._bos_id is not None else []
        return prefix + list(prompt_ids)

    def encode_response(self, response: str) -> list[int]:
        """`encode(response) + [EOS]`."""
        return self.encode(response) + [self._eos_id]

    def save(self, path: str | os.PathLike) -> None:
        """Writes `tokenizer.json` at `path` and the policyopt settings at `path + '.meta.json'`."""
        self.tokenizer.save(os.fspath(path))
        meta = {
            "type": "hf",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "chat_template": self.chat_template,
            "stop_tokens": list(self.stop_tokens),
        }
        with open(os.fspath(path) + ".meta.json", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HFTokenizer":
        with open(os.fspath(path) + ".meta.json", encoding="utf-8") as f:
            meta = json.load(f)
        return cls.from_file(
            path,
            bos_token=meta["bos_token"],
            eos_token=meta["eos_token"],
            pad_token=meta["pad_token"],
            chat_template=meta["chat_template"],
            stop_tokens=tuple(meta.get("stop_tokens", ())),
        )

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, chat_template={self.chat_template!r})"


def load_tokenizer(path: str | os.PathLike) -> CharTokenizer | HFTokenizer:
    """Loads a tokenizer: a file written by `save` (either kind), a HuggingFace
    `tokenizer.json` (e.g. from `train_bpe`; the chat template and EOS from its ChatML
    tokens, `HFTokenizer`), or a checkpoint folder holding one (`HFTokenizer.from_pretrained`).

    Raises:
      FileNotFoundError: naming `path` when there is nothing there.
      ValueError: naming `path` and what was expected when it does not parse.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise FileNotFoundError(f"{path}: a folder without tokenizer.json")
        return _parsed(path, HFTokenizer.from_pretrained)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    if os.path.exists(path + ".meta.json"):
        return _parsed(path, HFTokenizer.load)
    try:
        with open(path, encoding="utf-8") as f:
            kind = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path}: not a tokenizer file (expected tokenizer.json: {error})"
        ) from None
    if isinstance(kind, dict) and kind.get("type") == "char":
        return CharTokenizer.load(path)
    return _parsed(path, HFTokenizer.from_file)


def _parsed(path: str, load) -> HFTokenizer:
    """``load(path)``, its errors as one line naming the file."""
    try:
        return load(path)
    except (FileNotFoundError, KeyError) as error:
        raise ValueError(f"{path}: {error}") from None
    except ValueError as error:  # the HFTokenizer settings: EOS, PAD, template
        hint = (
            " (a tokenizer.json without ChatML's <|im_start|>/<|im_end|> needs its EOS named: "
            f"save it with HFTokenizer.save, which writes {os.path.basename(path)}.meta.json)"
            if load == HFTokenizer.from_file
            else ""
        )
        raise ValueError(f"{path}: {error}{hint}") from None
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise ValueError(
            f"{path}: not a tokenizer.json the tokenizers library reads ({error})"
        ) from None


# A tokenizer trained by `train_bpe`: ChatML's turn markers (the chat template of
# `HFTokenizer`, as in Qwen's vocabularies; `<|im_end|>` ends a response) and an
# end-of-text token are special; the response format's reasoning markers are ordinary
# tokens of one id each (decoded as text, so the format check sees them).
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_ADDED_TOKENS = (THINK_OPEN, THINK_CLOSE)


def train_bpe(texts: Iterable[str], *, vocab_size: int = 1024, min_frequency: int = 2):
    """A byte-level BPE tokenizer trained on ``texts`` (the ``tokenizers`` library).

    Byte level: every text encodes (no unknown token) and decodes back exactly. Digits are
    split one per token before the merges (as Qwen's and Llama's pre-tokenizers do), so a
    number's tokens spell its digits, which arithmetic needs; words and punctuation merge.

    Args:
      texts: the training text (a task's prompts and worked solutions).
      vocab_size: most tokens, the 256 bytes and the specials included (fewer when the text
        runs out of pairs seen ``min_frequency`` times).
      min_frequency: least count of a pair for it to merge.

    Returns:
      An ``HFTokenizer`` with the ChatML template (``BPE_SPECIAL_TOKENS``); save it with
      ``tokenizer.tokenizer.save(path)`` (a plain ``tokenizer.json``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    least = 256 + len(BPE_SPECIAL_TOKENS)
    if vocab_size < least:
        raise ValueError(f"vocab_size must be >= {least} (256 bytes + specials), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BPE_ADDED_TOKENS),
        min_frequency=min_frequency,
        special_tokens=list(BPE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in BPE_ADDED_TOKENS]
    )
    return HFTokenizer(tokenizer)
