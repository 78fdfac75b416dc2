"""Client recipes that several methods share (their cards name them: ``strategies/*/__init__.py``).

A recipe is the shared training settings (``fedapp.config.RECIPE_KEYS``) a method's authors
chose; docs/recipes.md cites the paper and the code line for every value. No torch here: the
cards that import these are read by the command line.
"""

# The FedAvg family as LG-FedAvg's and FedRep's authors train it: SGD with momentum 0.5, a
# new optimizer every round, no clipping.
SGD_HALF = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.5, "grad-clip": 0.0,
            "optimizer-state": "fresh"}

# HtFLlib's shared client recipe (FD, FedRE, FedTGP, FedGen, FedL2G, FML, FedMRL, FedKD): plain
# SGD 0.01 without momentum, weight decay or clipping, built in every round's train(); batch 10,
# one epoch, drop_last; d = 512. FedL2G clips at 100, FML and FedKD at 10.
HTFLLIB = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.0, "weight-decay": 0.0,
           "grad-clip": 0.0, "optimizer-state": "fresh", "batch-size": 10, "drop-last": True,
           "local-epochs": 1, "local-steps": 0, "feature-dim": 512}
