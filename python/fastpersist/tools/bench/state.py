"""The synthetic training states ``fastpersist bench`` saves: a GPT-style mixed-precision Adam state
sized to the byte, a 10,000-small-tensor state for flatten+plan, and the views its peers need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...format.flatten import flatten

if TYPE_CHECKING:
    import torch

BYTES_PER_PARAM = 14  # bf16 weight + fp32 master + fp32 exp_avg + fp32 exp_avg_sq


@dataclass(frozen=True)
class GptShape:
    """Dimensions of the synthetic GPT model (the embedding is tied to the LM head).

    Example:
        >>> s = gpt_shape(1 << 30)
        >>> abs(s.params * BYTES_PER_PARAM / (1 << 30) - 1) < 0.01
        True
    """

    hidden: int
    layers: int
    vocab: int
    context: int

    @staticmethod
    def layer_params(hidden: int) -> int:
        """Parameters of one block: qkv, attention projection, MLP up/down, 2 layernorms."""
        return 12 * hidden * hidden + 13 * hidden

    @property
    def params(self) -> int:
        """Unique parameters (the tied LM head counts once)."""
        h = self.hidden
        return self.vocab * h + self.context * h + self.layers * self.layer_params(h) + 2 * h


def gpt_shape(total_bytes: int, *, min_layers: int = 16) -> GptShape:
    """Picks a GPT shape whose training state is `total_bytes` (to within one hidden row).

    The hidden size is the largest multiple of 64 that gives `min_layers` blocks holding about
    70% of the parameters; the vocabulary absorbs the remainder, so the size comes out exact.
    """
    params = max(total_bytes // BYTES_PER_PARAM, 1)
    hidden, layers = 64, 1
    for h in range(8192, 63, -64):
        n = int(0.7 * params) // GptShape.layer_params(h)
        if n >= min_layers:
            hidden, layers = h, n
            break
    else:
        layers = max(1, int(0.7 * params) // GptShape.layer_params(hidden))
    context = min(2048, max(16, int(0.02 * params) // hidden))
    vocab = (params - layers * GptShape.layer_params(hidden) - context * hidden - 2 * hidden) // hidden
    return GptShape(hidden, layers, max(vocab, 16), context)


def _param_shapes(shape: GptShape) -> list[tuple[str, tuple[int, ...]]]:
    h = shape.hidden
    names: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (shape.vocab, h)), ("wpe.weight", (shape.context, h))]
    for i in range(shape.layers):
        p = f"h.{i}."
        names += [
            (p + "ln_1.weight", (h,)),
            (p + "ln_1.bias", (h,)),
            (p + "attn.c_attn.weight", (3 * h, h)),
            (p + "attn.c_attn.bias", (3 * h,)),
            (p + "attn.c_proj.weight", (h, h)),
            (p + "attn.c_proj.bias", (h,)),
            (p + "ln_2.weight", (h,)),
            (p + "ln_2.bias", (h,)),
            (p + "mlp.c_fc.weight", (4 * h, h)),
            (p + "mlp.c_fc.bias", (4 * h,)),
            (p + "mlp.c_proj.weight", (h, 4 * h)),
            (p + "mlp.c_proj.bias", (h,)),
        ]
    return [*names, ("ln_f.weight", (h,)), ("ln_f.bias", (h,))]


def build_state(total_bytes: int, *, seed: int = 0, min_layers: int = 16) -> dict[str, Any]:
    """A realistic mixed-precision Adam training state of about `total_bytes`.

    ``model`` holds bf16 weights (``lm_head.weight`` is the same tensor as ``wte.weight``),
    ``optimizer`` holds per-parameter ``step`` / ``exp_avg`` / ``exp_avg_sq``, the fp32 master
    copy and ``param_groups``; ``lr_scheduler``, ``rng``, ``step`` and ``lr`` are small extras.
    Fewer `min_layers` give fewer, larger tensors (see :func:`gpt_shape`).

    Example:
        >>> state = build_state(8 << 20)
        >>> state["model"]["lm_head.weight"] is state["model"]["wte.weight"]
        True
    """
    import torch

    shape = gpt_shape(total_bytes, min_layers=min_layers)
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    master: list[torch.Tensor] = []
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    step = 1000
    for i, (name, dims) in enumerate(_param_shapes(shape)):
        w = torch.randn(dims, generator=gen).mul_(0.02)
        model[name] = w.to(torch.bfloat16)
        exp_avg = torch.mul(w, 1e-3)
        exp_avg_sq = torch.mul(w, w).mul_(1e-4)
        master.append(w)
        opt_state[i] = {"step": torch.tensor(float(step)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        if name == "wte.weight":
            model["lm_head.weight"] = model[name]  # tied, as in GPT-2
    groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "params": list(opt_state),
        },
    ]
    return {
        "model": model,
        "optimizer": {"state": opt_state, "param_groups": groups, "fp32_master": master},
        "lr_scheduler": {"last_epoch": step, "base_lrs": [3e-4], "_last_lr": [2.9e-4], "warmup_steps": 100},
        "rng": {"torch": torch.get_rng_state(), "seed": seed},
        "step": step,
        "lr": 2.9e-4,
        "config": {"hidden": shape.hidden, "layers": shape.layers, "vocab": shape.vocab, "context": shape.context},
    }


def build_small_state(tensor_count: int = 10_000, *, seed: int = 0) -> dict[str, Any]:
    """A state of `tensor_count` small tensors (multiple of 5): weights, moments, steps, masters.

    Used to time flatten+plan, whose cost is per tensor, not per byte.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    params = max(tensor_count // 5, 1)
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    master: list[torch.Tensor] = []
    sizes = torch.randint(16, 1024, (params,), generator=gen).tolist()
    for i, n in enumerate(sizes):
        w = torch.randn(n, generator=gen)
        model[f"layers.{i // 8}.p{i % 8}"] = w.to(torch.bfloat16)
        master.append(w)
        opt_state[i] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    return {"model": model, "optimizer": {"state": opt_state, "fp32_master": master, "param_groups": []}}


def state_summary(state: object) -> dict[str, int]:
    """``{"bytes", "tensors", "blobs"}``: unique tensor bytes (tied storage once) and counts."""

    flat = flatten(state)
    return {"bytes": sum(b.nbytes for b in flat.blobs), "tensors": len(flat.tensors), "blobs": len(flat.blobs)}


def safetensors_view(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``("a.b.c" -> tensor, metadata)`` for safetensors: tied tensors cloned, values as JSON."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(node: object, key: str) -> None:
        if isinstance(node, torch.Tensor):
            ptr = node.untyped_storage().data_ptr()
            tensors[key] = node.clone() if ptr in seen and node.numel() else node.contiguous()
            seen.add(ptr)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in node):
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}")
        else:
            values[key] = node

    walk(state, "")
    return tensors, {"values": json.dumps(values, default=str)}


def count_tensors(node: object) -> int:
    import torch

    if isinstance(node, torch.Tensor):
        return 1
    if isinstance(node, dict):
        return sum(count_tensors(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return sum(count_tensors(v) for v in node)
    return 0
