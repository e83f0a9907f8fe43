"""Tokenizers (Hugging Face `tokenizers`) with the model's chat template and stop tokens."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from ssd_jax.loading.gguf_loader import CONTROL, USER_DEFINED, stop_token_ids

# llama.cpp's pre-tokenizer names -> the split regex their tokenizers apply before byte-level
# BPE (Qwen2's: one digit per piece, letters with one leading non-letter, punctuation runs).
_SPLIT = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}


# Fill-in-the-middle tokens by family, (prefix, suffix, middle); the prompt is prefix-suffix-
# middle order (PSM) in both.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))  # StarCoder / SantaCoder


@dataclass
class Tokenizer:
    """Text <-> ids, plus what generation needs: the chat template and the stop tokens."""

    backend: HFTokenizer
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    add_bos: bool = False
    special: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # HF tokenizer.json files carry their own post-processor (e.g. Llama-3 adds BOS);
        # GGUF-built ones have none, so `add_bos` from the GGUF metadata is applied here.
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and ids[:1] != [self.bos_token_id]):
            ids = [self.bos_token_id] + ids
        return ids

    def fim_ids(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle): the fill-in-the-middle tokens of a code model trained for
        it (Qwen2.5-Coder's <|fim_prefix|>..., StarCoder's <fim_prefix>...); None without."""
        for names in FIM_TOKENS:
            ids = [self.backend.token_to_id(n) for n in names]
            if None not in ids:
                return ids[0], ids[1], ids[2]
        return None

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a byte-level BPE token may hold part of a UTF-8 character,
        which decoding it alone would turn into U+FFFD)."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        if (isinstance(self.backend.decoder, decoders.ByteLevel)
                and int(token_id) not in self.backend.get_added_tokens_decoder()
                and all(c in _BYTE_OF_CHAR for c in piece)):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model ships no chat template: pass raw text with chat=False")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **self.special)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        meta = {"chat_template": self.chat_template, "eos_token_ids": list(self.eos_token_ids),
                "bos_token_id": self.bos_token_id, "add_bos": self.add_bos, "special": self.special}
        (directory / "ssd_jax_tokenizer.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        directory = Path(directory)
        meta = json.loads((directory / "ssd_jax_tokenizer.json").read_text())
        return cls(HFTokenizer.from_file(str(directory / "tokenizer.json")),
                   chat_template=meta["chat_template"],
                   eos_token_ids=tuple(meta["eos_token_ids"]), bos_token_id=meta["bos_token_id"],
                   add_bos=meta["add_bos"], special=meta.get("special", {}))


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte as the printable character that stands for it in
    token strings (bytes that print as themselves keep their character; the rest take code
    points from 256 up, in byte order). Inverted: character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in set(keep)]
    chars = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_chars()


def _raise(message):
    raise jinja2.TemplateError(message)


def from_gguf_metadata(meta: dict) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer (llama.cpp model 'gpt2') from GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported: only byte-level BPE "
                         "('gpt2', used by Llama-3, Qwen and SmolLM) is")
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's tokenizer splits every digit on its own before the GPT-2 regex.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _SPLIT:
        # No NFC normaliser: Qwen's own tokenizer.json has one, but llama.cpp and transformers'
        # GGUF tokenizer do not, and a GGUF's ids should be the ones its other readers give.
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                for i, t in enumerate(types) if t == CONTROL])
    # User-defined tokens (<tool_call>) are matched whole, like llama.cpp does, but not special.
    backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                        for i, t in enumerate(types) if t == USER_DEFINED])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    special = {}
    if eos is not None:
        special["eos_token"] = tokens[eos]
    if bos is not None:
        special["bos_token"] = tokens[bos]
    return Tokenizer(backend, chat_template=meta.get("tokenizer.chat_template"),
                     eos_token_ids=stop_token_ids(meta),
                     bos_token_id=None if bos is None else int(bos),
                     add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     special=special)


def from_hf_dir(directory: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer | None:
    """None when the directory has no tokenizer.json (weights-only exports); such a model
    still generates from token-id prompts."""
    path = directory / "tokenizer.json"
    if not path.exists():
        return None
    backend = HFTokenizer.from_file(str(path))
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    template = cfg.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    special = {k: v for k, v in cfg.items() if k in ("eos_token", "bos_token")
               and isinstance(v, str)}
    bos = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
    eos = tuple(eos_token_ids)
    if not eos and "eos_token" in special and backend.token_to_id(special["eos_token"]) is not None:
        eos = (backend.token_to_id(special["eos_token"]),)
    return Tokenizer(backend, chat_template=template, eos_token_ids=eos, bos_token_id=bos,
                     add_bos=False, special=special)
