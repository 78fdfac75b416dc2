"""Secure aggregation (``secure-aggregation = true``) with Flower's own SecAgg+, in process:
a fake Grid runs the real ClientApp (with Flower's ``secaggplus_mod``) for every message that
Flower's ``SecAggPlusWorkflow`` sends, so the whole protocol runs (keys, shares, masked
uploads, unmasking) and its result is compared with the plain rounds' on the same seed. The
settings that refuse it are checked from the cards (``load_config``)."""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.server import ServerAppComponents, ServerConfig
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import DefaultWorkflow

from fedapp import client_app
from fedapp.config import ConfigError, pyproject_defaults
from fedapp.runtime import secure_aggregation
from fedapp.runtime.results import Recorder
from strategies import METHODS, load_config, settings_report
from tests.test_async import FakeGrid

COLLECT = "collect_masked_vectors"  # the stage at which a client trains and uploads


class ProtocolGrid(FakeGrid):
    """The fake grid, answering Flower's workflows (``send_and_receive`` of whole stages);
    ``drop``: (partition id, stage) pairs whose message is answered by an error, as when the
    node went away (a plain training message counts as the ``collect_masked_vectors`` stage,
    the one where a client trains)."""

    def __init__(self, run_config: dict, num_nodes: int, drop=(), lie=None) -> None:
        super().__init__(run_config, num_nodes)
        self.drop = set(drop)
        self.lie = lie  # (partition id, metric, value): a training reply's metric replaced
        self.stages: list[str] = []

    def _answer(self, message: Message) -> Message:
        # Each node gets its own copy, as a real link serialises it (Flower's workflow sends
        # one content object to every node of a stage, and its mod pops from it).
        message = copy.deepcopy(message)
        context = self.contexts[message.metadata.dst_node_id]
        stage = None
        if message.metadata.message_type == "train":
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = str(configs["stage"]) if configs is not None else COLLECT
            self.stages.append(stage)
        if (context.node_config["partition-id"], stage) in self.drop:
            return Message(Error(code=5, reason="node offline"), reply_to=message)
        try:
            reply = client_app.app(message, context)
        except Exception as exc:  # as a SuperNode reports a ClientApp that raised
            return Message(Error(code=2, reason=repr(exc)), reply_to=message)
        if self.lie is not None and stage == COLLECT \
                and context.node_config["partition-id"] == self.lie[0]:
            reply.content.config_records["fitres.metrics"][self.lie[1]] = self.lie[2]
        return reply


def flat_config(**overrides) -> dict:
    """One round of 4 small clients on synthetic data."""
    flat = pyproject_defaults()
    flat.update({"method": "fedavg", "dataset": "synthetic", "synthetic-train": 240,
                 "synthetic-test": 40, "num-clients": 4, "num-server-rounds": 1,
                 "max-samples-per-client": 0, "arch-mix": "cnn1", "model-width": 0.25,
                 "local-steps": 2, "batch-size": 16, "feature-dim": 16})
    flat.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return flat


def run(tmp_path, name, drop=(), lie=None, **overrides):
    """(strategy, rounds.jsonl records, grid) of one run on the fake grid: the SecAgg+
    workflow when the config says so, else Flower's plain default workflow (the same
    Strategy calls as the app's rounds)."""
    flat = flat_config(**overrides)
    cfg = load_config(flat)
    # One round more than the run has: no summary and plots, which are not what is tested.
    recorder = Recorder(tmp_path / name, method=cfg.method, dataset=cfg.dataset,
                        num_clients=cfg.num_clients, num_rounds=cfg.num_server_rounds + 1,
                        config={}, partition={})
    strategy = METHODS[cfg.method].strategy(cfg, recorder, input_shape=(1, 28, 28),
                                            num_classes=10)
    strategy.node_partitions = lambda: {1000 + p: p for p in range(cfg.num_clients)}
    grid = ProtocolGrid(flat, cfg.num_clients, drop=drop, lie=lie)
    context = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=flat)
    config = ServerConfig(num_rounds=cfg.num_server_rounds)
    if cfg.secure_aggregation:
        secure_aggregation.run_rounds(grid, context, ServerAppComponents(strategy=strategy,
                                                                         config=config))
    else:
        manager = secure_aggregation.PromptClientManager()
        DefaultWorkflow()(grid, LegacyContext(context, config=config, strategy=strategy,
                                              client_manager=manager))
    records = [json.loads(line) for line in
               (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
    return strategy, records, grid


def step() -> float:
    """One quantisation step of a dense upload's values (fedapp.runtime.secure_aggregation)."""
    return 2 * float(flat_config()["upload-max-abs"]) / secure_aggregation.QUANTIZATION_RANGE


def assert_within_quantisation(secure, plain, survivors: list[int]) -> None:
    """FedAvg's global model under SecAgg+ is the plain one within the quantisation error:
    weights n_k / weight_scale sum to S_w over the survivors; each survivor's values and
    weight are off by less than one step, so the mean is off by at most
    N step (1 + |mean|) / S_w (and float32's rounding)."""
    sizes = secure.train_sizes
    s_w = sum(sizes[p] for p in survivors) / max(sizes)
    changed = 0
    for name, want in plain.global_model.items():
        got = secure.global_model[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = len(survivors) * step() * (1 + np.abs(want).max()) / s_w + 1e-6
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)
        changed += int(not np.array_equal(got, want))
    assert changed, "SecAgg+ quantises: a result bit-identical to the plain one means it never ran"


def assert_initial_model(strategy) -> None:
    """FedAvg's global model is still the seed's initial one: no round changed it."""
    initial = METHODS["fedavg"].strategy(strategy.cfg, None, input_shape=(1, 28, 28),
                                         num_classes=10).global_model
    for name, want in initial.items():
        np.testing.assert_array_equal(strategy.global_model[name], want)


def run_cache(tmp_path_factory):
    """``get(name, **overrides)``: the run of that name, made once (a module's fixture)."""
    made = {}

    def get(name, **kwargs):
        if name not in made:
            made[name] = run(tmp_path_factory.mktemp(name), name, **kwargs)
        return made[name]
    return get


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs the tests compare, each made once."""
    return run_cache(tmp_path_factory)


# -- the sums are the plain aggregate, within the quantisation error ---------------------------
def test_fedavg_secure_average_equals_the_plain_one(runs):
    plain, _, _ = runs("plain")
    secure, records, grid = runs("secure", secure_aggregation=True)
    # The whole protocol ran, each client trained once, inside the collect stage.
    assert grid.stages.count("setup") == 4 and grid.stages.count("unmask") == 4
    assert grid.stages.count(COLLECT) == 4
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    assert records[0]["clients_fit"] == 4 and not records[0]["empty_round"]
    assert_within_quantisation(secure, plain, [0, 1, 2, 3])


def test_fedproto_secure_class_table_equals_the_plain_prototypes(runs):
    setting = dict(method="fedproto", arch_mix="cnn1,cnn2")  # dirichlet(0.5) label skew
    plain, _, _ = runs("plain-fedproto", **setting)
    secure, records, _ = runs("secure-fedproto", secure_aggregation=True, **setting)
    assert sorted(secure.global_prototypes) == sorted(plain.global_prototypes)
    counts = _class_counts(secure)
    assert (counts == 0).any()  # label skew: not every client holds every class
    # Row c is weighted by n_kc / weight_scale: the class mean is off by at most
    # 4 step (1 + |mean|) / (the sum of those weights).
    scale = max(secure.train_sizes)
    for c, want in plain.global_prototypes.items():
        tol = 4 * step() * (1 + np.abs(want).max()) / (counts[:, c].sum() / scale) + 1e-6
        np.testing.assert_allclose(secure.global_prototypes[c], want, rtol=0, atol=tol)
    # The server learnt no client's classes, so every client is sent every prototype.
    assert secure.client_classes == {}
    # Each masked upload: C x d rows, C weights, C holders, SecAgg+'s own weight, in int64.
    assert records[0]["bytes_up"] == 4 * 8 * (10 * 16 + 10 + 10 + 1)


def _class_counts(strategy) -> np.ndarray:
    """[K, C] training samples per partition and class."""
    from fedapp.data import setup
    return setup.partition(strategy.cfg).class_counts(
        setup.dataset(strategy.cfg).train_y.numpy(), 10)


# -- clients that drop mid-protocol -----------------------------------------------------------
DROPS = {(2, COLLECT), (1, "unmask")}


def test_a_client_dropping_before_it_shared_its_keys_is_out_of_the_protocol(runs):
    # Partition 3 goes away after sending its public keys, before sharing its secrets: no
    # survivor holds a share of its key, and none is needed, as nobody masked with it.
    # (Flower 1.41's workflow still asked the survivors for it at unmasking, and every one of
    # them failed: SecureSumWorkflow takes such a client out of the round.)
    plain, _, _ = runs("plain-without-3", drop={(3, COLLECT)})
    secure, records, grid = runs("secure-without-3", drop={(3, "share_keys")},
                                 secure_aggregation=True)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2]}
    assert records[0]["failed_clients"] == [3]
    assert grid.stages.count("unmask") == 3
    assert_within_quantisation(secure, plain, [0, 1, 2])


def test_clients_dropping_above_the_threshold_cost_the_round_nothing(runs):
    # Partition 2 goes away when it should train and upload: the others are summed, and the
    # sum is the plain average of the same three. Partition 1 uploads its masked vector, then
    # goes away before unmasking: its mask is rebuilt from its neighbours' key shares, and its
    # upload stays in the round.
    plain, _, _ = runs("plain-without-2", drop={(2, COLLECT)})
    secure, records, grid = runs("secure-drops", drop=DROPS, secure_aggregation=True)
    record = records[0]
    assert record["secure_aggregation"] == {"survivors": [0, 1, 3]}
    assert record["failed_clients"] == [2] and record["clients_fit"] == 3
    assert grid.stages.count("unmask") == 3  # partition 2 was not asked again
    assert_within_quantisation(secure, plain, [0, 1, 3])


def test_a_client_dropping_below_the_threshold_ends_the_round_empty(runs, caplog):
    # Threshold 1.0: every client's masks need all 4 shares; one client gone halts SecAgg+.
    caplog.set_level(logging.ERROR)
    secure, records, _ = runs("secure-halted", drop={(3, COLLECT)}, secure_aggregation=True,
                              secure_aggregation_threshold=1.0)
    record = records[0]
    assert record["empty_round"] and record["clients_fit"] == 0
    assert record["failed_clients"] == [3]
    assert record["secure_aggregation"]["survivors"] == []
    halted = record["secure_aggregation"]["halted"]
    assert "masked uploads stage" in halted and "3 of 4" in halted and "needs 4" in halted
    assert any("secure aggregation halted" in r.getMessage() for r in caplog.records)
    # The method's state is left as it was: the initial model, not an average.
    assert_initial_model(secure)


def test_a_survivor_whose_reply_is_refused_leaves_the_round_empty(runs):
    # Partition 0 claims a training-set size that is not its partition's: its reply is
    # refused, but its masked upload is already in the one sum, which cannot be taken apart.
    secure, records, _ = runs("secure-liar", lie=(0, "num-examples", 10**6),
                              secure_aggregation=True)
    record = records[0]
    assert record["rejected_clients"] == [0] and record["empty_round"]
    assert record["secure_aggregation"] == {"survivors": [1, 2, 3], "refused": [0]}
    assert_initial_model(secure)


# -- settings and refusals --------------------------------------------------------------------
def test_fedapp_settings_shows_the_secure_aggregation_settings():
    report = settings_report(flat_config(secure_aggregation=True,
                                         secure_aggregation_threshold=0.75))
    values, layers = report["settings"], report["layers"]
    assert values["secure-aggregation"] is True
    assert values["secure-aggregation-threshold"] == 0.75
    assert values["secure-aggregation-shares"] == 1.0
    assert values["secure-aggregation-timeout"] == 0.0
    assert layers["secure-aggregation-timeout"] == "default"


@pytest.mark.parametrize("overrides, words", [
    (dict(method="fedgh"), ["'fedgh'", "individual", "Methods that take it: ",
                            "fedproto", "fedavg"]),
    (dict(method="fedkd"), ["'fedkd'", "SVD factors"]),
    (dict(method="standalone"), ["'standalone'", "upload nothing"]),
    (dict(method="fedhe", server_loop="async"), ["server-loop = 'async'", "'fedhe'",
                                                 "no cohort to sum"]),
    (dict(method="compfl", server_loop="walk", arch_mix="cnn1,cnn2"),
     ["server-loop = 'walk'", "'compfl'", "device to device"]),
    (dict(robust_aggregation="median"), ["robust-aggregation = 'median'", "hides"]),
    (dict(method="lg-fedavg", differential_privacy=True),
     ["differential-privacy = true", "'lg-fedavg'", "clipped on the server"]),
    (dict(num_clients=4, fraction_fit=0.25, min_fit_clients=1), ["1 client per round"]),
])
def test_settings_that_cannot_take_secure_aggregation_are_refused(overrides, words):
    with pytest.raises(ConfigError) as refused:
        load_config(flat_config(secure_aggregation=True, **overrides))
    for word in words:
        assert word in str(refused.value)


def test_fedapp_methods_says_which_methods_take_secure_aggregation(capsys):
    from fedapp.cli.main import main
    assert main(["methods"]) == 0
    assert ("secure-aggregation = true (the server sees only sums, docs/privacy.md) runs: "
            "compfl, depthfl, dsfl, fd, fedavg, fedclassavg, fedgen, fedhe, fedl2g, fedmd, "
            "fedmrl, fedper, fedproto, fedrep, fedrolex, felo, fjord, fml, heterofl, "
            "lg-fedavg\n"
            ) in capsys.readouterr().out


def test_every_method_card_declares_whether_its_server_works_from_sums():
    for name, method in METHODS.items():
        assert method.secure_aggregation, name
    takes = sorted(n for n, m in METHODS.items()
                   if m.secure_aggregation in ("as-is", "fixed-layout"))
    assert takes == ["compfl", "depthfl", "dsfl", "fd", "fedavg", "fedclassavg", "fedgen",
                     "fedhe", "fedl2g", "fedmd", "fedmrl", "fedper", "fedproto", "fedrep",
                     "fedrolex", "felo", "fjord", "fml", "heterofl", "lg-fedavg"]


# -- the dense layout, by hand ------------------------------------------------------------------
def test_class_table_sums_give_the_count_weighted_class_means():
    # Client A holds classes 0 and 2 (counts 3, 1), client B class 2 (count 2), C = 3.
    a = secure_aggregation.class_table(np.array([0, 2]), np.array([[1.0, 2.0], [4.0, 0.0]]),
                                       np.array([0.3, 0.1]), 3)
    b = secure_aggregation.class_table(np.array([2]), np.array([[1.0, 3.0]]), np.array([0.2]),
                                       3)
    sums = {k: a[k] + b[k] for k in a}
    means = secure_aggregation.class_means_from_sums(sums)
    assert sorted(means) == [0, 2]  # nobody holds class 1
    np.testing.assert_allclose(means[0], [1.0, 2.0])
    np.testing.assert_allclose(means[2], [(0.1 * 4 + 0.2 * 1) / 0.3, (0.2 * 3) / 0.3])


def test_a_secure_upload_out_of_range_or_not_finite_is_not_sent():
    with pytest.raises(Exception, match="beyond upload-max-abs = 10"):
        secure_aggregation.to_arrays({"w": np.array([11.0])}, 10.0)
    with pytest.raises(Exception, match="NaN or infinite"):
        secure_aggregation.to_arrays({"w": np.array([np.nan])}, 10.0)
    arrays = secure_aggregation.to_arrays({"b": np.ones(2), "a": np.zeros(3)}, 10.0)
    assert [a.shape for a in arrays] == [(3,), (2,)]  # name order, no names array
