"""Which devices hold what, how much memory each needs, and refusal of layouts that do not fit.

SSD layout: devices [0, n_t) form the target mesh (TP = n_t), devices [n_t, n_t + n_d) the draft
mesh (TP = n_d). AR and SD use the target mesh only; SD's draft is replicated on every target
device (a small draft runs fastest without collectives), which costs its weights and KV there.
"""
from __future__ import annotations

from dataclasses import dataclass

from ssd_jax.config import ModelConfig
from ssd_jax.plan import memory
from ssd_jax.plan.devices import GB, Device

MAX_TP = 64  # largest TP degree tried when suggesting a layout that fits


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything a plan depends on. `budget` is M, the SSD branches per row."""

    target_name: str
    target: ModelConfig
    draft_name: str
    draft: ModelConfig
    device: Device
    target_devices: int = 1
    draft_devices: int = 1
    batch: int = 1
    context: int = 4096
    k: int = 7
    sd_k: int = 7
    budget: int = 24
    sampling: bool = False
    mem_fraction: float = 0.95

    def __post_init__(self):
        for name in ("target_devices", "draft_devices", "batch", "context", "k", "sd_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: it must be >= 1")
        if self.budget < self.k + 1:
            raise ValueError(f"fan-out budget M={self.budget} is smaller than K+1={self.k + 1}: "
                             "every accept length needs a branch; raise it or lower K")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction={self.mem_fraction} must lie in (0, 1]")

    @property
    def cache_len(self) -> int:
        """KV slots per row: the context plus the K+1 slack verification writes past it."""
        return self.context + max(self.k, self.sd_k) + 1

    @property
    def usable(self) -> float:
        return self.device.hbm_bytes * self.mem_fraction


@dataclass(frozen=True)
class MeshMemory:
    """Bytes on *each* device of one mesh."""

    role: str
    model: str
    devices: range
    weights: int
    kv_cache: int
    spec: int  # speculation buffers: SpecCache + tree K/V (draft), incoming speculation (target)

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.spec


def target_memory(s: Setup, tp: int | None = None) -> MeshMemory:
    tp = tp or s.target_devices
    return MeshMemory(
        "target", s.target_name, range(tp), memory.weight_bytes(s.target, tp).total,
        memory.kv_cache_bytes(s.target, s.batch, s.cache_len, tp),
        memory.speculation_bytes(s.batch, s.k, s.draft.vocab_size, s.sampling))


def draft_memory(s: Setup, tp: int | None = None) -> MeshMemory:
    tp = tp or s.draft_devices
    spec = (memory.spec_cache_bytes(s.batch, s.budget, s.k, s.draft.vocab_size, s.sampling)
            + memory.tree_kv_bytes(s.draft, s.batch, s.budget, s.k, tp))
    first = s.target_devices
    return MeshMemory("draft", s.draft_name, range(first, first + tp),
                      memory.weight_bytes(s.draft, tp).total,
                      memory.kv_cache_bytes(s.draft, s.batch, s.cache_len, tp), spec)


def sd_memory(s: Setup) -> MeshMemory:
    """Target device in the AR/SD baseline: target shard plus a full draft replica."""
    t = target_memory(s)
    return MeshMemory("target+draft", f"{s.target_name} + {s.draft_name}", t.devices,
                      t.weights + memory.weight_bytes(s.draft, 1).total,
                      t.kv_cache + memory.kv_cache_bytes(s.draft, s.batch, s.cache_len, 1),
                      memory.speculation_bytes(s.batch, s.sd_k, s.draft.vocab_size, s.sampling))


class LayoutError(ValueError):
    """A mesh needs more memory per device than the device has."""


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def check_fits(s: Setup) -> None:
    """Raise LayoutError naming the overflowing mesh, its breakdown and the smallest fix."""
    for mem, flag, per_tp in ((target_memory(s), "--target-devices", lambda n: target_memory(s, n)),
                              (draft_memory(s), "--draft-devices", lambda n: draft_memory(s, n))):
        if mem.total <= s.usable:
            continue
        fix = next((n for n in range(mem.tp + 1, MAX_TP + 1) if per_tp(n).total <= s.usable), None)
        advice = (f"use {flag} {fix} or more" if fix else
                  f"no TP degree up to {MAX_TP} fits: lower --batch or --context")
        dtype = s.target.dtype if mem.role == "target" else s.draft.dtype
        raise LayoutError(
            f"{mem.model} {dtype} ({mem.role}) on {mem.tp}x{s.device.name} needs "
            f"{_gb(mem.total)} per device (weights {_gb(mem.weights)}, KV cache "
            f"{_gb(mem.kv_cache)}, speculation {_gb(mem.spec)}), {_gb(mem.total - s.usable)} over "
            f"the {_gb(s.usable)} usable ({s.mem_fraction:.0%} of {_gb(s.device.hbm_bytes)}): "
            f"{advice}")
