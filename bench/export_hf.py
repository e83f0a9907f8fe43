"""Export an ssd_jax model (e.g. our distilled draft) to a Hugging Face directory, so that
transformers' assisted generation (`generate(..., assistant_model=...)`) can use it as a peer.

    python -m bench.export_hf DRAFT OUT_DIR

A plain model becomes config.json + model.safetensors (+ generation_config.json) that
`AutoModelForCausalLM` loads as it is.

A draft with a truncated vocabulary (ssd_jax.draft_vocab: V_d - 1 frequent target tokens plus an
OOV slot) must speak *target* ids to be an assistant, with greedy proposals identical to ours:
- input side: the embedding is expanded to the target vocabulary by the gather
  E_full[t] = E_draft[to_draft[t]], so a target token outside the draft vocabulary enters as the
  OOV embedding, exactly as `DraftModel` feeds it;
- output side: our draft's distribution is -inf outside its vocabulary (the OOV slot included).
  A bias-free linear head cannot produce a constant -inf, so the head is expanded by the same
  gather and the directory ships a 15-line modeling file (`modeling_ssd_draft.py`, loaded with
  `trust_remote_code=True`, no network) whose forward sets the logits of every token outside the
  draft vocabulary to the dtype's minimum. Inside the vocabulary the logits are the draft's own,
  so argmax (and softmax, renormalised over the draft vocabulary) match `DraftModel`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

MODELING_FILE = "modeling_ssd_draft.py"
MODELING_SOURCE = '''\
"""ssd_jax draft with a truncated vocabulary: logits outside it are the dtype's minimum."""
import torch
from transformers import {base}


class SSDDraftForCausalLM({base}):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        mask = getattr(self, "_ssd_outside", None)
        if mask is None or mask.device != out.logits.device:
            inside = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            inside[torch.tensor(self.config.ssd_draft_target_ids)] = True
            mask = self._ssd_outside = (~inside).to(out.logits.device)
        out.logits = out.logits.masked_fill(mask, torch.finfo(out.logits.dtype).min)
        return out
'''
_BASES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def vocab_map_of(extra: dict):
    """The draft->target vocab map stored in a draft checkpoint's metadata, or None."""
    if not extra or not extra.get("vocab_map"):
        return None
    from ssd_jax.draft_vocab import VocabMap
    if hasattr(VocabMap, "from_extra"):
        return VocabMap.from_extra(extra)
    return VocabMap.from_dict(extra["vocab_map"])


def hf_config(config, vocab_size: int, **extra) -> dict:
    """config.json for transformers, built by its own config class (version-proof field names)."""
    import transformers
    kw = dict(vocab_size=vocab_size, hidden_size=config.hidden_size,
              intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
              num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
              head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
              rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings,
              max_position_embeddings=config.max_position_embeddings,
              bos_token_id=config.bos_token_id,
              eos_token_id=list(config.eos_token_ids) or None)
    if config.rope_scaling is not None:
        s = config.rope_scaling
        kw["rope_scaling"] = dict(rope_type="llama3", factor=s.factor,
                                  low_freq_factor=s.low_freq_factor,
                                  high_freq_factor=s.high_freq_factor,
                                  original_max_position_embeddings=s.original_max_position_embeddings)
    cls = transformers.LlamaConfig if config.arch == "llama" else transformers.Qwen3Config
    cfg = cls(**kw).to_dict()
    cfg.update({"architectures": [_BASES[config.arch]], "torch_dtype": "float32", **extra})
    return cfg


def export(model, directory: str | Path, *, vocab=None, num_assistant_tokens: int = 4) -> Path:
    """Write `model` (an ssd_jax Transformer; `vocab` its VocabMap if it is a truncated-vocab
    draft) as an HF directory. Returns the directory."""
    from safetensors.numpy import save_file
    from ssd_jax.loading.weights import named_weights
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors = {}
    for name, value in named_weights(model):
        value = np.asarray(value, np.float32)
        if vocab is not None and name in ("model.embed_tokens.weight", "lm_head.weight"):
            value = value[np.asarray(vocab.to_draft)]  # [V_target, D]: OOV rows = OOV slot
        tensors[name] = np.ascontiguousarray(value)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    extra = {}
    if vocab is not None:
        base = _BASES[config.arch]
        (directory / MODELING_FILE).write_text(MODELING_SOURCE.format(base=base))
        ids = np.asarray(vocab.to_target)
        extra = dict(architectures=["SSDDraftForCausalLM"],
                     auto_map={"AutoModelForCausalLM": "modeling_ssd_draft.SSDDraftForCausalLM"},
                     ssd_draft_target_ids=[int(i) for i in ids[ids >= 0]])
    V = len(vocab.to_draft) if vocab is not None else config.vocab_size
    (directory / "config.json").write_text(json.dumps(hf_config(config, V, **extra), indent=1))
    # Assisted generation as in our SD: K proposals per round, no early stop on confidence.
    gen = dict(num_assistant_tokens=num_assistant_tokens,
               num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
               bos_token_id=config.bos_token_id, eos_token_id=list(config.eos_token_ids) or None)
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=1))
    return directory


def export_named(name_or_path: str, directory: str | Path, **kw) -> Path:
    """Load any model ssd_jax can load (name, .gguf, HF dir, orbax dir) and export it."""
    from ssd_jax.loading import load
    model, tokenizer, extra = load(name_or_path)
    out = export(model, directory, vocab=vocab_map_of(extra), **kw)
    if tokenizer is not None:
        tokenizer.backend.save(str(Path(out) / "tokenizer.json"))
    return out


def load_hf(directory: str | Path):
    """The exported model in transformers (fp32, eval mode)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), trust_remote_code=True, dtype=torch.float32).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.export_hf",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("model", help="name, .gguf, HF dir or orbax dir (e.g. smollm2-draft)")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--k", type=int, default=4, help="num_assistant_tokens for transformers")
    args = ap.parse_args(argv)
    print(export_named(args.model, args.out, num_assistant_tokens=args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
