"""What every family's export layouts share: the `speculators_config` block, reading safetensors weights, and
float weights in the export dtype with the vocabulary maps kept integer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from speculators_train.errors import UserError

SPECULATORS_VERSION = "0.9.0"  # the format version written; vLLM 0.33 reads it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def proposal_config(
    algorithm: str, speculative_tokens: int, verifier: str, verifier_architectures: list[str]
) -> dict[str, Any]:
    """The `speculators_config` block: the algorithm, one greedy proposal method, and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
    }


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f"; {pickled} are pickled, and this toolkit never unpickles checkpoint files: convert them to "
            "safetensors where you trust them"
            if pickled
            else ""
        )
        raise UserError(f"{path}: no .safetensors weights next to config.json{hint}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            out.update(load_file(file))
        except OSError as exc:
            raise UserError(f"{file}: unreadable weights ({exc})") from None
    return out


def export_tensors(
    draft: nn.Module, dtype: str, rename=lambda name: name, skip: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Float tensors in `dtype`; the vocabulary maps stay int64 (d2t offsets) and bool (t2d), whatever `dtype` is."""
    out = {}
    for name, tensor in draft.state_dict().items():
        if name in skip:
            continue
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(DTYPES[dtype])
        out[rename(name)] = tensor.detach().cpu().contiguous()
    return out
