"""Train several recipes one after another in one launch, so a test's `torchrun` pays its ranks' start-up once:

python -m torch.distributed.run --nproc_per_node 2 -m tests.train_many RECIPE...
"""

import sys

from speculators_train.recipe import load_recipe
from speculators_train.training.trainer import Trainer

if __name__ == "__main__":
    for path in sys.argv[1:]:
        Trainer(load_recipe(path)).train()
