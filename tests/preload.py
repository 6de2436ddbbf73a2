"""Everything the CLI's stages import before they do any work, imported once by the fork server of
tests/children.py so that each child starts with it loaded. transformers and accelerate import most of it lazily,
on first use, which is why names are touched here and not only modules imported. The shipped ShareGPT file is parsed
here too (as source `sharegpt`, the name the tests give it): `data.mix` keeps parses by content, so a child that
reads it hashes it instead of parsing it."""

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
from speculators_train.data.conversations import SkipReport
from speculators_train.data.mix import MixConfig, read_source
from tests.conftest import SHAREGPT

LOADED = (
    accelerate.Accelerator,
    transformers.AutoConfig,
    transformers.AutoModelForCausalLM,
    transformers.AutoTokenizer,
    transformers.LlamaForCausalLM,
    transformers.LlamaConfig,
)

_mix = MixConfig(sources=[{"name": "sharegpt", "path": SHAREGPT}])
read_source(_mix, _mix.sources[0], SkipReport())
