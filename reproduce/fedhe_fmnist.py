"""FedHe's paper comparison on Fashion-MNIST: FedHe against FedMD and Private (Chan & Ngai,
MSN 2021, Sec. IV: ten clients, client k running FedHe's CNN k of Table II; FedMD with 10 % of
the training data as its public set, pre-trained).

Runs conf/fedhe-async-fmnist.toml in synchronous rounds (FedHe's 3 mini-batches of 50 per
update, Adam 1e-3 kept for the whole run, 500 training samples per client, 30 rounds, every
client each round) for four rows at equal local work on the private data:

- Private: FedHe with ``fedhe.alpha = 0`` (the same 3-batch updates, nothing of the others in
  the loss), as docs/fedhe-async.md runs it;
- FedHe;
- FedMD: its revisit is the same 3 batches of 50 with its own Adam kept; it adds what the
  method is, the transfer learning before its first round (public set, then private data,
  early-stopped on held-out training data) and the digest of the consensus on 500 public
  samples per round;
- FedMD, no digest (``fedmd.digest-epochs = 0``): FedMD's transfer learning and revisits with
  the consensus ignored, the control that splits FedMD's gain over Private into what its
  transfer learning adds (this row against Private) and what the collaboration adds (FedMD
  against this row).

Every row, Private and FedHe included, cuts the same public set (``public-source =
"train-holdout"``, a seeded stratified 10 % of the training split) before partitioning, so the
four runs of one seed train on the same client shards and start from the same weights: the
differences are paired by seed. IID (the paper's split) and Dirichlet 0.5. Reports the mean over
clients of the global-test accuracy (the paper's metric) and of the local-test accuracy; writes
the tables into docs/fedhe.md (between its generated markers).

    .venv/bin/python reproduce/fedhe_fmnist.py                 # 3 seeds, 24 runs
    .venv/bin/python reproduce/fedhe_fmnist.py --splits IID --seeds 0
    .venv/bin/python reproduce/fedhe_fmnist.py --quick         # pipeline check only

``--quick`` (one seed, IID, 3 rounds, 100-sample shards) writes into its own folder, never into
docs/. Finished runs are reused (their summary.json, else their records in
reproduce/records/reproduce-fedhe/), so an interrupted reproduction resumes.
"""

from __future__ import annotations


from common import (slug, VERDICT_RULE, comparison_table, global_accuracy, resource_overrides,
                    run_experiment, run_parallel, seeds_option, training_caption,
                    write_generated)
from fedhe_async_fmnist import (EQUAL, EVAL, PRIVATE, QUICK, SPLITS, SYNC, parse_split_options,
                                quick_or_full, split_parser)

# A pipeline check must not spend minutes on FedMD's transfer learning (20 + 25 epochs).
QUICK = {**QUICK, "fedmd.pretrain-public-epochs": 1, "fedmd.pretrain-private-epochs": 1}

SCRIPT = "reproduce/fedhe_fmnist.py"
PUBLIC = {"public-source": "train-holdout", "public-fraction": 0.1}
NO_DIGEST = "FedMD, no digest"
ROWS = [
    (PRIVATE, {"fedhe.alpha": 0.0}),
    ("FedHe", {}),
    ("FedMD", {"method": "fedmd"}),
    (NO_DIGEST, {"method": "fedmd", "fedmd.digest-epochs": 0}),
]
# The paper's claims: FedHe above both baselines; FedMD against Private is what the public set
# and the digest add, which the control splits into the transfer learning (no digest against
# Private) and the collaboration (FedMD against no digest).
CLAIMS = [("FedHe", PRIVATE), ("FedHe", "FedMD"), ("FedMD", PRIVATE), (NO_DIGEST, PRIVATE),
          ("FedMD", NO_DIGEST)]


def main() -> None:
    args = parse_split_options(split_parser(__doc__), "reproduce-fedhe", "fedhe.md")
    splits, extra, seeds, out, doc = quick_or_full(args, QUICK)
    resources = resource_overrides(args)

    def plan(split: str, split_overrides: dict) -> dict[str, list[tuple]]:
        return {label: [(EQUAL, {**SYNC, **PUBLIC, **overrides, **split_overrides, **EVAL,
                                 "seed": seed, **extra, **resources},
                         slug(f"{split.split()[0]} {label}") + f"-seed{seed}")
                        for seed in seeds]
                for label, overrides in ROWS}

    # Seed by seed, so that an interrupted reproduction has whole paired comparisons.
    todo = [e for split, o in splits for seed in range(len(seeds))
            for runs_of in plan(split, o).values() for e in runs_of[seed:seed + 1]]
    run_parallel(todo, out, args.jobs)
    tables = []
    for split, split_overrides in splits:
        results = {label: [run_experiment(*e, out) for e in runs_of]
                   for label, runs_of in plan(split, split_overrides).items()}
        tables.append(comparison_table(
            f"FedHe's CNNs 0-9, {split}", results, seeds, CLAIMS, global_accuracy))
    command = f".venv/bin/python {SCRIPT}" + (" --quick" if args.quick else "") + (
        seeds_option(args.seeds)) + (
        "" if len(splits) == len(SPLITS) or args.quick else " --splits " + " ".join(
            args.splits))
    caption = (f"Every row trains each client's private data the same way: "
               f"{training_caption(EQUAL, SYNC)}; a round is one update of every client. "
               "FedMD adds its transfer learning before its first round and the digest of the "
               "consensus on 500 public samples per round (docs/fedmd.md); FedMD, no digest, has "
               "the transfer learning and not the digest. Every row cuts the "
               "same public set (10 % of the training split, before partitioning).")
    write_generated(doc, SCRIPT, "\n\n".join([f"Produced by `{command}`.", caption,
                                              VERDICT_RULE, *tables]))
    print(f"[reproduce] wrote {doc}")


if __name__ == "__main__":
    main()
