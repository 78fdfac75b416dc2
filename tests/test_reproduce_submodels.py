"""reproduce/submodel_models.py and common.submodel_standalone: the Standalone a sub-model method
is read against trains, on each client, the model that client of the method trains."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import common  # noqa: E402
import submodel_models  # noqa: E402

from fedapp.data.setup import architectures, new_model  # noqa: E402

SHAPE, CLASSES = (1, 28, 28), 10
BASE = {"dataset": "fmnist", "num-clients": 10, "arch-mix": "cnn1,cnn2,cnn3,cnn4,cnn5"}


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


@pytest.mark.parametrize("method, settings", [
    ("heterofl", {}),                                          # a1-b1-c1-d1-e1, in blocks
    ("fedrolex", {"fedrolex.rates": "cnn1=a,cnn2=a,cnn3=b,cnn4=b,cnn5=b"}),  # round-robin
    ("fjord", {"fjord.rates": "cnn1=1,cnn2=0.8,cnn3=0.8,cnn4=0.6,cnn5=0.4"}),
])
def test_standalone_trains_each_clients_width_slice_parameter_for_parameter(method, settings):
    from strategies.heterofl.maths import width_model
    run = common.run_config({**BASE, "method": method, **settings})
    alone = common.run_config({**BASE, "method": "standalone",
                               **common.submodel_standalone({**BASE, "method": method,
                                                             **settings})})
    rates = run.settings.client_rates(run, 1)
    pairs = dict(zip(architectures(alone), rates))  # each client's model, once
    assert len(pairs) == len(set(rates)) > 1
    assert [pairs[a] for a in architectures(alone)] == list(rates)
    for arch, rate in pairs.items():
        mine = new_model(alone, arch, SHAPE, CLASSES)
        theirs = width_model(run, rate, SHAPE, CLASSES)
        assert parameter_shapes(mine) == parameter_shapes(theirs), arch
        # The same function of the same weights while training: the method's normalisation
        # (batch statistics) and Scaler. (FjORD's statistics of the narrower widths are
        # buffers only its sampled widths use.)
        mine.load_state_dict(dict(theirs.named_parameters()), strict=False)
        x = torch.randn(4, *SHAPE)
        assert torch.allclose(mine.train()(x), theirs.train()(x), atol=1e-5)


@pytest.mark.parametrize("width", [1.0, 0.5])  # DepthFL's model-width: part of the name
def test_standalone_trains_each_depthfl_clients_path_to_its_deepest_exit(width):
    from strategies.depthfl.maths import depth_model
    settings = {**BASE, "method": "depthfl", "depthfl.model": "cnn4",  # depths 1,2,3,4 blocks
                "model-width": width}
    run = common.run_config(settings)
    alone = common.run_config({**BASE, "method": "standalone",
                               **common.submodel_standalone(settings)})
    depths = run.settings.client_depths(run)
    assert depths == [1, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    pairs = dict(zip(architectures(alone), depths))
    assert [pairs[a] for a in architectures(alone)] == depths
    for arch, depth in pairs.items():
        mine = new_model(alone, arch, SHAPE, CLASSES)
        theirs = depth_model(run, depth, SHAPE, CLASSES)
        # The stem, the stages and the deepest exit: the shallower exits are left out.
        deepest = f"exits.{len(theirs.exits) - 1}."
        path = {k: s for k, s in parameter_shapes(theirs).items()
                if not k.startswith("exits.") or k.startswith(deepest)}
        assert sorted(parameter_shapes(mine).values()) == sorted(path.values()), arch


@pytest.mark.parametrize("family", [
    "cnn4", pytest.param("resnet18", marks=pytest.mark.long)])  # a ResNet-18 builds slowly
def test_a_depth_model_is_the_prefix_up_to_its_deepest_exit(family):
    from client_models.depth_prefix import build_depth_model
    for depth in (1, 3):  # a pooling exit (cnn4), an attention exit (resnet18)
        torch.manual_seed(0)
        prefix = build_depth_model(family, depth, SHAPE, CLASSES)
        torch.manual_seed(0)  # the same weights: built the same way
        whole = submodel_models.depth_model(family, depth)(SHAPE, CLASSES)
        x = torch.randn(3, *SHAPE)
        prefix.eval(), whole.eval()
        assert torch.allclose(whole(x), prefix.exit_logits(x)[-1], atol=1e-5)
        assert isinstance(whole.head, torch.nn.Linear)


def test_names_are_checked_and_a_dynamic_plan_has_no_standalone():
    with pytest.raises(AttributeError, match="width__<arch>"):
        submodel_models.width__heterofl_conv__static__2__1_2  # noqa: B018
    with pytest.raises(ValueError, match="dynamic"):
        common.submodel_standalone({**BASE, "method": "heterofl",
                                    "heterofl.rate-mode": "dynamic"})


def test_fjord_widths_recomputes_each_widths_statistics_on_the_data_it_is_given():
    """reproduce/fjord_widths.py's second reading: width p's BatchNorm statistics become those
    of the data, layer by layer, so that the model in evaluation mode computes on that data
    what it computes in training mode (batch statistics); the first reading changes nothing."""
    import copy
    from fractions import Fraction

    import fjord_widths
    from client_models.width import set_width
    from strategies.heterofl.maths import width_model
    run = common.run_config({**BASE, "method": "fjord", "model-width": 0.125})
    torch.manual_seed(0)
    model = width_model(run, Fraction(1), SHAPE, CLASSES)
    x, test = torch.randn(64, *SHAPE) * 3 + 1, (torch.randn(32, *SHAPE), torch.zeros(32).long())
    before = copy.deepcopy(model.state_dict())
    fjord_widths.width_accuracies(model, run.settings.width_set(), test)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    fjord_widths.width_accuracies(model, run.settings.width_set(), test, train_x=x)
    for p in (Fraction(2, 5), Fraction(1)):
        set_width(model, p if p < 1 else None)
        batch = copy.deepcopy(model).train()(x)
        # (up to the variance's n / (n - 1): running statistics keep the unbiased one)
        assert torch.allclose(model.eval()(x), batch, atol=1e-3), p
        # The statistics as built (0 and 1) are not the data's: without the recomputation
        # evaluation mode computes something else.
        assert not torch.allclose(_evaluated(model, before, x), batch, atol=1e-2), p


def _evaluated(model: torch.nn.Module, state: dict, x: torch.Tensor) -> torch.Tensor:
    """``model`` with ``state`` loaded, in evaluation mode, on ``x`` (at its current width)."""
    import copy
    other = copy.deepcopy(model)
    other.load_state_dict(state)
    return other.eval()(x)


def test_a_tried_row_changes_one_setting_of_the_method_on_its_split_only():
    """reproduce/submodels_fmnist.py's DepthFL row with the distillation ramped over the run's
    rounds: DepthFL's own settings but that one, on IID only; and the ensemble's claim against
    the deepest exit reads both from the same runs."""
    import submodels_fmnist as page
    iid = page.rows("depthfl", "IID", {"partition": "iid"})
    own, tried = iid["DepthFL"], iid["DepthFL, distillation ramped over 20 rounds (tried)"]
    assert {k: v for k, v in tried.items() if own.get(k) != v} == {"depthfl.kd-ramp-rounds": 20}
    assert set(tried) - set(own) == {"depthfl.kd-ramp-rounds"}
    assert tried["depthfl.kd-ramp-rounds"] == tried["num-server-rounds"]
    dirichlet = page.rows("depthfl", "Dirichlet 0.3", {"partition": "dirichlet"})
    assert [k for k in dirichlet if "tried" in k] == []
    runs = [{"accuracy": {"server": {"ensemble": e, "exit-1": 0.1, "exit-4": x}}}
            for e, x in ((0.80, 0.70), (0.82, 0.71), (0.81, 0.69))]
    line = page.ensemble_claim("DepthFL", runs)
    assert line.startswith("DepthFL: the global model's ensemble ≥ its deepest exit (exit-4): "
                           "holds"), line


def test_fedrolex_tried_at_heterofls_recipe_is_read_against_heterofls_runs(tmp_path):
    """FedRolex's row at HeteroFL's recipe: FedRolex, with HeteroFL's training in every
    recipe key, on both splits; its claim against HeteroFL's global model is made only from
    HeteroFL's runs on the same split, and starts none."""
    import submodels_fmnist as page
    for split, settings in page.SPLITS:
        table = page.rows("fedrolex", split, settings)
        tried = table["FedRolex at HeteroFL's recipe (tried)"]
        assert tried["method"] == "fedrolex"
        assert {k: tried[k] for k, _ in common.training("heterofl")} == \
            dict(common.training("heterofl"))
        assert (tried["lr"], tried["local-epochs"]) == (0.01, 5)
    names = []

    def experiments(method, label, settings, split):
        names.append(method)
        return [(None, settings, f"{method}-seed{s}") for s in (0, 1)]
    lines = page.rival_claims("fedrolex", "IID", {"FedRolex": []}, experiments,
                              dict(page.SPLITS)["IID"], tmp_path)
    assert names == ["heterofl"]
    assert lines == ["HeteroFL's runs under IID are not made yet: no claim against it."]


def test_the_table_by_level_groups_each_rows_clients_by_the_methods_levels():
    """reproduce/submodels_fmnist.py's table by level: DepthFL's ten clients in blocks of depths
    1, 1, 1, 2, 2, 2, 3, 3, 4, 4 and HeteroFL's two per level; each cell the mean over seeds of
    the mean over that level's clients, every row grouped by the method's levels."""
    import submodels_fmnist as page
    depthfl = page.rows("depthfl", "IID", {"partition": "iid"})["DepthFL"]
    assert page.client_levels(depthfl) == ["depth 1"] * 3 + ["depth 2"] * 3 + [
        "depth 3"] * 2 + ["depth 4"] * 2
    heterofl = page.rows("heterofl", "IID", {"partition": "iid"})["HeteroFL"]
    assert page.client_levels(heterofl)[::2] == [
        "rate 1", "rate 1/2", "rate 1/4", "rate 1/8", "rate 1/16"]

    def run(*accuracies):
        return {"accuracy": {"per_client": {str(i): a for i, a in enumerate(accuracies)}}}
    levels = ["rate 1", "rate 1/2", "rate 1/2"]
    table = page.by_level_table(levels, {"A": [run(0.9, 0.5, 0.7), run(0.7, 0.4, 0.4)],
                                         "B": [run(0.1, 0.2, 0.3), run(0.3, 0.2, 0.3)]})
    assert table.splitlines()[2:] == ["| row | rate 1 (1) | rate 1/2 (2) |", "|---|---|---|",
                                      "| A | 0.800 | 0.500 |", "| B | 0.200 | 0.250 |"]


def test_fedrolex_rolling_pairs_the_two_methods_on_windows_that_roll_through_every_layer():
    """reproduce/fedrolex_rolling.py: HeteroFL's and FedRolex's runs differ in the method
    alone (and, in dynamic mode, the method's own rate-mode key; every client draws the same
    rate in both), and run at least as many rounds as the global model's widest layer has
    channels (a window moves one channel a round)."""
    import math
    from fractions import Fraction

    import fedrolex_rolling as page
    from strategies.heterofl.maths import width_model
    for _, split in (page.SPLITS[0], page.SPARSE):
        for mode in page.MODES:
            a, b = (page.settings_of("heterofl", split, mode),
                    page.settings_of("fedrolex", split, mode))
            moved = {"heterofl.rate-mode", "fedrolex.rate-mode"} if mode == "dynamic" else set()
            assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"method"} | moved
            ca, cb = common.run_config(a), common.run_config(b)
            assert cb.settings.index_scheme == "rolling"
            assert ca.settings.rate_mode == cb.settings.rate_mode == mode
            assert all(ca.settings.client_rates(ca, r) == cb.settings.client_rates(cb, r)
                       for r in (1, 2, 3))
        drawn = common.run_config(page.settings_of("heterofl", split, "dynamic"))
        assert len({drawn.settings.client_rates(drawn, r) for r in (1, 2, 3)}) > 1
    cfg = common.run_config(page.settings_of("fedrolex", {}, "fix"))
    model = width_model(cfg, Fraction(1), (1, 28, 28), 10)
    widest = max(m.weight.shape[0] for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert widest == math.ceil(512 * page.WIDTH) and page.ROUNDS >= widest
