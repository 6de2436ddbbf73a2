"""Everything the CLI's stages import before they do any work, imported once by the fork server of
tests/children.py so that each child starts with it loaded. transformers and accelerate import most of it lazily,
on first use, which is why names are touched here and not only modules imported."""

import accelerate
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import transformers

import speculators_train.cli
import speculators_train.export.run
import speculators_train.hidden_states.generator
import speculators_train.osd.distill
import speculators_train.target
import speculators_train.training.trainer
import speculators_train.verify.run  # noqa: F401

LOADED = (
    accelerate.Accelerator,
    transformers.AutoConfig,
    transformers.AutoModelForCausalLM,
    transformers.AutoTokenizer,
    transformers.LlamaForCausalLM,
    transformers.LlamaConfig,
)
