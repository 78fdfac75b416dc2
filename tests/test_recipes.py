"""Training recipes: a client's optimizer lives as long as the recipe says, and each method's
recipe is a layer of defaults (global defaults < recipe < preset < --set)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fedapp.cli.main import main as fedapp_main
from fedapp.cli.run import resolve_settings
from fedapp.data import setup
from fedapp.data.local_data import expected_input
from fedapp.config import (RECIPE_KEYS, SHARED_KEYS, ConfigError, pyproject_defaults,
                           read_preset, resolve_preset)
from fedapp.runtime import checkpoint
from fedapp.runtime.payload import decode
from fedapp.runtime.client_base import MODEL_STATE_KEY, OPTIMIZER_STATE_KEY
from fedapp.runtime.results import Recorder
from fedapp.runtime.training import recipe_optimizer, train_epochs
from strategies import METHODS, load_config, settings_report
from tests.conftest import InProcessFederation

# Two clients training a small CNN with Adam for 3 mini-batches per message: a fresh Adam
# would move every weight by about lr * sign(gradient) at each message's first step.
SETTING = dict(dataset="synthetic", synthetic_train=160, synthetic_test=40, num_clients=2,
               partition="iid", max_samples_per_client=0, arch_mix="cnn5", model_width=0.25,
               feature_dim=32, optimizer="adam", lr=0.003, batch_size=16, local_steps=3,
               weight_decay=0.0, grad_clip=0.0)


def _federation(tmp_path, name, resume_after=0, **extra):
    overrides = {**SETTING, "output_dir": str(tmp_path), "run_name": name, **extra}
    recorder = Recorder(tmp_path / name, method="standalone", dataset="synthetic",
                        num_clients=2, num_rounds=3, config={}, partition={},
                        resume_after=resume_after)
    return InProcessFederation("standalone", recorder=recorder, **overrides)


def _continuous(fed, pid, rounds):
    """Partition ``pid`` trained by one optimizer over the batches its messages draw."""
    client, cfg = fed.client(pid), fed.cfg
    model = setup.new_model(cfg, client.arch, *expected_input(cfg), pid).to(client.device)
    optimizer = recipe_optimizer(model.parameters(), cfg)
    for rnd in rounds:
        train_epochs(model, client.data.train_x, client.data.train_y,
                     loss_fn=lambda x, y: F.cross_entropy(model(x), y), optimizer=optimizer,
                     epochs=cfg.local_epochs, steps=cfg.local_steps, batch_size=cfg.batch_size,
                     grad_clip=cfg.grad_clip, generator=client.batch_generator(rnd))
    return model.state_dict()


def _saved(fed, pid):
    return fed.contexts[pid].state[MODEL_STATE_KEY].to_torch_state_dict()


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _states_after(fed, rounds):
    for rnd in rounds:
        fed.fit_round(rnd)
        fed.evaluate_round(rnd)  # ends the round: its record and checkpoint
    return [_saved(fed, pid) for pid in range(2)]


def test_a_kept_optimizer_is_one_optimizer_over_all_messages(tmp_path):
    fed = _federation(tmp_path, "keep", optimizer_state="keep")
    kept = _states_after(fed, (1, 2, 3))
    want = [_continuous(fed, pid, (1, 2, 3)) for pid in range(2)]
    assert all(_same(k, w) for k, w in zip(kept, want))
    # The state lives beside the model, and a fresh optimizer really is another run.
    assert OPTIMIZER_STATE_KEY.format(name="model") in fed.contexts[0].state
    fresh = _states_after(_federation(tmp_path, "fresh", optimizer_state="fresh"), (1, 2, 3))
    assert not any(_same(f, w) for f, w in zip(fresh, want))
    assert OPTIMIZER_STATE_KEY.format(name="model") not in \
        _federation(tmp_path, "f2", optimizer_state="fresh").contexts[0].state


def test_a_kept_optimizer_survives_the_idle_file_of_client_state_on_disk(tmp_path):
    fed = _federation(tmp_path, "disk", optimizer_state="keep", client_state="disk")
    on_disk = _states_after_disk(fed, (1, 2, 3))
    want = [_continuous(fed, pid, (1, 2, 3)) for pid in range(2)]
    assert all(_same(d, w) for d, w in zip(on_disk, want))


def _states_after_disk(fed, rounds):
    """With client-state = "disk" no array stays in memory: read the idle files back."""
    from flwr.app import ArrayRecord
    for rnd in rounds:
        fed.fit_round(rnd)
        assert not [k for c in fed.contexts for k, v in c.state.items()
                    if isinstance(v, ArrayRecord)]
    states = []
    for pid, context in enumerate(fed.contexts):
        checkpoint.take_back(fed.strategy.recorder.run_dir / "client-state", pid, context.state)
        assert OPTIMIZER_STATE_KEY.format(name="model") in context.state
        states.append(_saved(fed, pid))
    return states


def test_a_kept_optimizer_resumes_from_its_checkpoint_to_the_same_weights(tmp_path):
    first = _federation(tmp_path, "cut", optimizer_state="keep", checkpoint_every=2)
    _states_after(first, (1, 2))
    done, state = checkpoint.load_server(tmp_path / "cut" / "checkpoint")
    # A new run from the checkpoint: new clients, empty context.state (as after a restart).
    resumed = _federation(tmp_path, "cut", optimizer_state="keep", checkpoint_every=2,
                          resume=True, resume_after=done)
    resumed.strategy.restore(done, state)
    resumed.fit_round(1)  # Flower's round 1 of the resumed run is round 3
    want = [_continuous(resumed, pid, (1, 2, 3)) for pid in range(2)]
    assert all(_same(_saved(resumed, pid), want[pid]) for pid in range(2))


def test_optimizer_state_never_travels():
    fed = InProcessFederation("fedhe", **{**SETTING, "arch_mix": "cnn5,cnn4"})
    assert fed.cfg.optimizer_state == "keep"  # FedHe's recipe
    for rnd in (1, 2):
        sent = fed.fit_round(rnd)
        for _, res in sent.values():
            assert set(decode(res.parameters)) == {"logits", "labels"}  # nothing else


# -- recipes as a layer of defaults -----------------------------------------------------------

def test_choosing_a_method_alone_gives_its_recipe_and_an_explicit_setting_wins():
    cfg = load_config(resolve_settings(None, ['method="fedclassavg"'])[0])
    assert (cfg.optimizer, cfg.lr, cfg.adam_beta1, cfg.feature_dim) == ("adam", 0.0006, 0.5, 512)
    cfg = load_config(resolve_settings(None, ['method="fedclassavg"', 'optimizer="sgd"'])[0])
    assert cfg.optimizer == "sgd" and cfg.lr == 0.0006
    # --set of the global default's own value is explicit too: the recipe does not replace it.
    cfg = load_config(resolve_settings(None, ['method="fedhe"', "batch-size=64"])[0])
    assert (cfg.batch_size, cfg.optimizer, cfg.local_steps) == (64, "adam", 3)


def test_a_preset_sits_above_the_recipe_and_below_set(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('method = "fedhe"\nlr = 0.01\n')
    flat, _ = resolve_settings(str(preset), ["lr=0.02"])
    report = settings_report(flat)
    assert report["settings"]["lr"] == 0.02 and report["layers"]["lr"] == "set"
    assert report["layers"]["optimizer"] == "recipe fedhe"
    flat, _ = resolve_settings(str(preset), [])
    assert settings_report(flat)["layers"]["lr"] == "preset"


def test_a_plain_run_config_counts_a_changed_value_as_set():
    # flwr run hands the app pyproject's defaults with the overrides on top: a value other
    # than the default was set; one equal to it takes the recipe unless named explicit.
    flat = {**pyproject_defaults(), "method": "fedhe", "lr": 0.05}
    cfg = load_config(flat)
    assert (cfg.lr, cfg.optimizer) == (0.05, "adam")
    assert load_config({**flat, "explicit-settings": "optimizer"}).optimizer == "sgd"
    assert load_config({**flat, "recipe": "none"}).optimizer == "sgd"


def test_every_recipe_gives_valid_values_of_recipe_keys_only():
    for name, method in METHODS.items():
        assert set(method.recipe) <= set(RECIPE_KEYS), name
        cfg = load_config({"method": name, "arch-mix": "cnn5" if method.homogeneous_only
                           else "cnn1,cnn2",
                           "public-source": "train-holdout" if method.needs_public else "none"})
        for key, value in method.recipe.items():
            assert getattr(cfg, SHARED_KEYS[key].name) == value, (name, key)


def test_every_preset_still_gives_what_it_pins():
    for path in sorted(resolve_preset("smoke").parent.glob("*.toml")):
        pins = read_preset(path)
        cfg = load_config(resolve_settings(str(path), [])[0])
        for key, value in pins.items():
            if key in SHARED_KEYS:
                assert getattr(cfg, SHARED_KEYS[key].name) == value, (path.name, key)


def test_a_moved_setting_says_where_it_went():
    with pytest.raises(ConfigError, match="fedhe.local-batches .now local-steps"):
        load_config({"method": "fedhe", "fedhe.local-batches": 3})


def test_fedapp_settings_prints_the_effective_value_and_its_layer(capsys):
    assert fedapp_main(["settings", "--set", 'method="fedclassavg"']) == 0
    out = capsys.readouterr().out
    assert 'optimizer = "adam"    # [recipe fedclassavg]' in out
    assert 'method = "fedclassavg"    # [--set]' in out
    assert "momentum = 0.9    # [default]" in out
    assert fedapp_main(["settings", "--set", "lr=-1"]) == 2


@pytest.mark.parametrize("extra,refusal", [
    (["--set", 'method="fedmd"'], "needs a public set"),           # a method's rule
    (["--set", 'method="heterofl"', "--set", 'heterofl.rates="z"'], "heterofl.rates"),
    (["--set", 'method="heterofl"', "--set", 'synthetic-shape="1,6,6"',  # its global model
      "--set", 'arch-mix="resnet10"'], "too small for 'heterofl-conv'"),
])
def test_fedapp_settings_check_refuses_what_fedapp_run_refuses(extra, refusal, capsys):
    # Listing the settings applies the settings' own rules only; --check applies the run's.
    argv = ["settings", "smoke", "--set", 'dataset="synthetic"', *extra]
    assert fedapp_main(argv) == 0
    capsys.readouterr()
    assert fedapp_main([*argv, "--check"]) == 2
    assert refusal in capsys.readouterr().err
    assert fedapp_main(["settings", "smoke", "--set", 'dataset="synthetic"', "--check"]) == 0
    assert "every check fedapp run makes before it starts passes" in capsys.readouterr().out


def test_config_json_records_every_setting_and_its_layer(tmp_path):
    from flwr.app import Context, RecordDict

    from fedapp.server_app import server_fn
    flat, _ = resolve_settings("smoke", ['method="fedhe"', "lr=0.002",
                                         f'output-dir="{tmp_path}"', 'run-name="r"',
                                         'dataset="synthetic"', "num-clients=2",
                                         'partition="iid"', "max-samples-per-client=0"])
    server_fn(Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                      run_config=flat))
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["settings"]["optimizer"] == "adam"
    assert saved["layers"]["optimizer"] == "recipe fedhe"
    assert saved["layers"]["lr"] == "set" and saved["settings"]["lr"] == 0.002
    assert saved["layers"]["num-server-rounds"] == "preset"
    assert saved["layers"]["momentum"] == "default"


def test_the_learning_rate_schedule_follows_the_round_and_reaches_kept_optimizers(tmp_path):
    cfg = load_config({"method": "felo", "num-server-rounds": 10})
    assert (cfg.lr_decay_at, cfg.optimizer_state) == ("0.5", "keep")  # Felo's recipe
    assert [cfg.lr_factor(r) for r in (1, 5, 6, 10)] == [1, 1, 0.1, 0.1]
    fed = _federation(tmp_path, "decay", optimizer_state="keep", lr_decay_at="0.4,0.7",
                      num_server_rounds=3)
    client = fed.client(0)
    client.message = {"server-round": 2}
    assert client.optimizer().param_groups[0]["lr"] == pytest.approx(0.003 * 0.1)
    with pytest.raises(ConfigError, match="lr-decay-at"):
        load_config({"lr-decay-at": "0.5,1.5"})


def test_drop_last_leaves_out_the_short_batch_of_a_pass():
    from fedapp.runtime.training import _batches
    sizes = [len(b) for b in _batches(10, 4, 2, 0, torch.Generator().manual_seed(0),
                                      torch.device("cpu"), drop_last=True)]
    assert sizes == [4, 4, 4, 4]
    sizes = [len(b) for b in _batches(10, 4, 1, 0, torch.Generator().manual_seed(0),
                                      torch.device("cpu"))]
    assert sizes == [4, 4, 2]
    assert [len(b) for b in _batches(3, 4, 1, 0, torch.Generator(), torch.device("cpu"),
                                     drop_last=True)] == [3]  # a pass shorter than a batch


def test_a_fixed_batch_order_repeats_the_data_order_every_pass():
    # HtFLlib's and PFLlib's training loaders do not shuffle: batch-order = "fixed" takes the
    # data in its own order every pass, whatever the generator; "shuffled" draws a new order.
    from fedapp.runtime.training import _batches
    fixed = [b.tolist() for b in _batches(10, 4, 2, 0, torch.Generator().manual_seed(0),
                                          torch.device("cpu"), drop_last=True, shuffle=False)]
    assert fixed == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    shuffled = [b.tolist() for b in _batches(10, 4, 2, 0, torch.Generator().manual_seed(0),
                                             torch.device("cpu"), drop_last=True)]
    assert shuffled[:2] != fixed[:2] and shuffled[:2] != shuffled[2:]
    # And the setting reaches a client's training: with it, batch generators of other seeds
    # train the same model on the same data to the same weights.
    from fedapp.runtime.training import train_recipe
    client = InProcessFederation("standalone", **{"batch-order": "fixed"}).client(0)
    weights = []
    for seed in (0, 1):
        torch.manual_seed(0)
        model = torch.nn.Linear(client.data.train_x[0].numel(), 10).to(client.data.train_x.device)
        train_recipe(model, client.data.train_x, client.data.train_y,
                     loss_fn=lambda x, y: F.cross_entropy(model(x.flatten(1)), y),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1), cfg=client.cfg,
                     generator=torch.Generator().manual_seed(seed))
        weights.append(model.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_a_preset_that_sets_the_training_pins_its_whole_recipe():
    # So that every method compared on it (Standalone included) trains alike: --set method=...
    # on such a preset changes the method, not the training. (demo and smoke leave the
    # training to the method's recipe.)
    for path in sorted(resolve_preset("smoke").parent.glob("*.toml")):
        pins = read_preset(path)
        if "optimizer" not in pins:
            continue
        unused = {"sgd": {"adam-beta1", "adam-beta2"}, "adam": {"momentum"}}[pins["optimizer"]]
        if not pins.get("lr-decay-at"):
            unused.add("lr-decay")
        if pins.get("local-steps"):
            unused.add("local-epochs")
        missing = set(RECIPE_KEYS) - {"feature-dim"} - unused - set(pins)
        assert not missing, (path.name, sorted(missing))
