"""benchmarks/runtime_overhead.py's settings: what `--set` adds, and that the in-process loops
train exactly the work the Flower run's `--set` flags pin (a method's recipe fills in only what
the work leaves unset), so a method's bare loop and its Flower run do the same arithmetic."""

from __future__ import annotations

import argparse

import pytest

from tests.conftest import benchmark_script


@pytest.fixture(scope="module")
def bench():
    return benchmark_script("runtime_overhead")


def test_set_reads_json_values_and_keeps_other_text_as_a_string(bench):
    assert bench.key_value("public-source=train-holdout") == ("public-source", "train-holdout")
    assert bench.key_value("lr=0.5") == ("lr", 0.5)
    assert bench.key_value('fedmd.pretrain="none"') == ("fedmd.pretrain", "none")
    with pytest.raises(argparse.ArgumentTypeError):
        bench.key_value("lr")


def test_the_in_process_work_is_the_pinned_work_not_the_methods_recipe(bench):
    args = argparse.Namespace(setting="tenclients", rounds=2, samples_per_client=100,
                              method="fedmd", client_state="memory",
                              set=[("public-source", "train-holdout")])
    cfg = bench.work_config(bench.settings(args))
    # FedMD's recipe trains with batches of 5 and Adam; the benchmark pins SGD on batches of 64.
    assert (cfg.method, cfg.batch_size, cfg.optimizer, cfg.lr, cfg.momentum) == (
        "fedmd", 64, "sgd", 0.01, 0.9)
    assert cfg.public_source == "train-holdout"


def test_the_flower_runs_set_flags_give_the_in_process_loops_training(bench, tmp_path):
    # What `fedapp run` makes of the command's `--set` flags (its own resolution) trains as
    # work_config does: the same optimizer, lr, batches and public set, not FedMD's recipe.
    from fedapp.cli.run import resolve_settings
    from strategies import load_config
    args = argparse.Namespace(setting="tenclients", rounds=2, samples_per_client=100,
                              method="fedmd", client_state="memory",
                              set=[("public-source", "train-holdout")])
    command = bench.flwr_command(args, tmp_path)
    sets = [arg.removeprefix("--set=") for arg in command if arg.startswith("--set=")]
    assert len(sets) == len(bench.settings(args))
    run = load_config(resolve_settings(None, sets)[0])
    work = bench.work_config(bench.settings(args))
    fields = ("method", "optimizer", "lr", "momentum", "weight_decay", "grad_clip",
              "optimizer_state", "batch_size", "local_epochs", "local_steps",
              "max_samples_per_client", "num_server_rounds", "public_source")
    assert {f: getattr(run, f) for f in fields} == {f: getattr(work, f) for f in fields}
    assert (run.batch_size, run.optimizer) == (64, "sgd")
