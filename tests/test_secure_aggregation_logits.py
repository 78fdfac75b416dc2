"""Secure aggregation for the methods that share per-class logits, FD and FedHe: each client
uploads a table of all C classes (its rows, zeros elsewhere, and which classes it holds), and
the server's tables from the round's sums equal the plain ones within the quantisation error.
FD's exclude-own is taken out by each client whose rows the sum holds. The whole protocol
runs in process (tests/test_secure_aggregation.py's harness)."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.runtime import secure_aggregation
from fedapp.runtime.payload import PayloadError
from fedapp.runtime.strategy_base import ClientInfo, Upload
from strategies import METHODS, load_config
from strategies.fd.maths import SENT_KEY, without_rows
from tests.conftest import InProcessFederation, make_strategy
from tests.test_secure_aggregation import COLLECT, flat_config, run_cache, step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs the tests compare, each made once."""
    return run_cache(tmp_path_factory)


# Dirichlet(0.5) label skew over two architectures: not every client holds every class.
SKEWED = dict(arch_mix="cnn1,cnn2")
C = 10
# Each masked upload: C x C rows, C weights (all 1: each holder counts once), C holders and
# SecAgg+'s own weight, in int64.
UPLOAD_BYTES = 8 * (C * C + C + C + 1)


def info(strategy, pid: int) -> ClientInfo:
    """The ClientInfo the server holds for partition ``pid``."""
    return next(c for c in strategy.clients.values() if c.partition_id == pid)


def assert_table_within_quantisation(got, want, counts) -> None:
    """A table of class means from sums of weight-1 rows: each of the N = 4 clients' values is
    off by less than one step, so a class's sum by less than 4 steps and its mean by less than
    4 steps / its count (and float32's rounding of the mean)."""
    np.testing.assert_array_equal(got["labels"], want["labels"])
    tol = 4 * step() / counts[want["labels"], None] + 1e-6 * (1 + np.abs(want["logits"]))
    assert (np.abs(got["logits"] - want["logits"]) <= tol).all()


# -- FD ------------------------------------------------------------------------------------------
def test_fd_secure_sums_are_the_plain_table_and_each_survivor_takes_out_its_own_rows(runs):
    # Partition 2 goes away when it should train: the plain server averages the other three;
    # the secure one their sum.
    plain, _, _ = runs("plain-fd", drop={(2, COLLECT)}, method="fd", **SKEWED)
    secure, records, grid = runs("secure-fd", drop={(2, COLLECT)}, secure_aggregation=True,
                                 method="fd", **SKEWED)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 3]}
    np.testing.assert_array_equal(secure.counts, plain.counts)  # holder counts: exact
    assert (plain.counts < 3).any()  # some class is not held by every survivor
    np.testing.assert_allclose(secure.sums, plain.sums, rtol=0, atol=3 * step())
    assert not np.array_equal(secure.sums, plain.sums)  # the quantisation ran
    assert_table_within_quantisation(secure._payload, plain._payload, plain.counts)
    assert records[0]["bytes_up"] == 3 * UPLOAD_BYTES
    for pid in range(4):
        want = plain.fit_payload(2, info(plain, pid))  # the plain server's F^(i)
        sent = secure.fit_payload(2, info(secure, pid))
        assert ("own-round" in sent) == (pid != 2)  # partition 2's rows are in no sum
        # A fresh client on its node's state after the run, as the next round builds it.
        client = METHODS["fd"].client(grid.contexts[1000 + pid], secure.cfg)
        client.receive(sent, 2)
        labels = np.flatnonzero(client.has_logits.cpu().numpy())
        got = {"labels": labels, "logits": client.class_logits[labels].cpu().numpy()}
        # (count * mean - own rows) / (count - 1): the sum is off by less than 3 steps, so
        # this mean by less than 3 steps / (count - 1); bounded here by 4 steps / count.
        counts = plain.counts.copy()
        if pid != 2:
            # What the client keeps: its round-1 rows, the only ones a later table may hold.
            kept = client.context.state[SENT_KEY]
            assert sorted(kept) == ["1/labels", "1/logits"]
            counts[kept["1/labels"].numpy()] -= 1
            assert not (np.array_equal(want["labels"], plain._payload["labels"])
                        and np.allclose(want["logits"], plain._payload["logits"]))
        else:
            assert sorted(client.context.state.get(SENT_KEY, {})) == []
        assert_table_within_quantisation(got, want, np.maximum(counts, 1))


def test_fd_from_hand_computed_sums():
    # Partitions 0, 1, 2 survive; 0 holds classes 0 and 1, 1 holds class 0, 2 class 2;
    # partition 3's rows are in no sum.
    strategy = make_strategy("fd", num_clients=4, arch_mix="cnn1", secure_aggregation=True)
    tables = [secure_aggregation.holder_rows(np.array(labels), _rows(rows), C)
              for labels, rows in (([0, 1], [(1, 0), (2, 2)]), ([0], [(3, 2)]), ([2], [(5, 5)]))]
    sums = {k: sum(t[k] for t in tables) for k in tables[0]}
    uploads = [Upload(ClientInfo(p, "cnn1"), 10, {}, {}) for p in (0, 1, 2)]
    strategy.aggregate_sums(1, sums, uploads)
    everyone = strategy.fit_payload(2, ClientInfo(3, "cnn1"))
    np.testing.assert_array_equal(everyone["labels"], [0, 1, 2])
    np.testing.assert_allclose(everyone["logits"], _rows([(2, 1), (2, 2), (5, 5)]))
    assert set(everyone) == {"labels", "logits"}  # no counts for a client not in the sum
    mine = strategy.fit_payload(2, ClientInfo(0, "cnn1"))
    np.testing.assert_array_equal(mine["counts"], [2, 1, 1])
    np.testing.assert_array_equal(mine["own-round"], [1])
    # Partition 0 takes out its rows: class 0 is partition 1's row, class 1 (its own alone)
    # has none, class 2 is partition 2's.
    others = without_rows(mine, np.array([0, 1]), _rows([(1, 0), (2, 2)]), C)
    np.testing.assert_array_equal(others["labels"], [0, 2])
    np.testing.assert_allclose(others["logits"], _rows([(3, 2), (5, 5)]))
    # Partition 2's: classes 0 and 1 as for everyone, class 2 gone.
    theirs = strategy.fit_payload(2, ClientInfo(2, "cnn1"))
    others = without_rows(theirs, np.array([2]), _rows([(5, 5)]), C)
    np.testing.assert_array_equal(others["labels"], [0, 1])
    np.testing.assert_allclose(others["logits"], _rows([(2, 1), (2, 2)]))
    # fd.exclude-own = false: the same means for everyone.
    include = make_strategy("fd", num_clients=4, arch_mix="cnn1", secure_aggregation=True,
                            **{"fd.exclude-own": False})
    include.aggregate_sums(1, sums, uploads)
    assert include.fit_payload(2, ClientInfo(0, "cnn1")) is include.fit_payload(2, None)


def _rows(rows) -> np.ndarray:
    """[len(rows), C] logits whose first entries are ``rows``'s."""
    out = np.zeros((len(rows), C), np.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def test_an_fd_client_keeps_the_rows_a_later_table_may_hold():
    fed = InProcessFederation("fd", num_clients=2, arch_mix="cnn1", secure_aggregation=True,
                              dataset="synthetic", synthetic_train=80, synthetic_test=20)
    client = fed.client(0)
    table = {"logits": _rows([(2, 1)]), "labels": np.array([0], np.int32)}
    client.receive(table, 3)  # nothing kept yet, and nothing in the table
    client.sent = {"labels": np.array([0], np.int32), "logits": _rows([(1, 0)])}
    client.save_state(3)
    assert sorted(client.context.state[SENT_KEY]) == ["3/labels", "3/logits"]
    # Round 3 was left empty (its table never came): a table of an earlier round, without
    # this client's rows, drops them (no later table can be of round 3).
    client = fed.client(0)
    client.receive(table, 4)
    assert sorted(client.context.state[SENT_KEY]) == []
    client.sent = {"labels": np.array([0], np.int32), "logits": _rows([(1, 0)])}
    client.save_state(4)
    # The table of round 4 holds its rows: taken out, class 0 is the other holder's (3, 2).
    client = fed.client(0)
    client.receive({**table, "counts": np.array([2], np.int32),
                    "own-round": np.array([4])}, 5)
    np.testing.assert_allclose(client.class_logits[0, :2].cpu().numpy(), [3, 2])
    assert bool(client.has_logits[0])
    # A client that lost its state cannot take its rows out: it says so rather than train
    # towards a target holding its own logits.
    client = fed.client(1)
    with pytest.raises(PayloadError, match="round 4, which it no longer has"):
        client.receive({**table, "counts": np.array([2], np.int32),
                        "own-round": np.array([4])}, 5)


# -- FedHe ---------------------------------------------------------------------------------------
def test_fedhe_secure_store_equals_the_plain_one(runs):
    plain, _, _ = runs("plain-fedhe", method="fedhe", **SKEWED)
    secure, records, _ = runs("secure-fedhe", secure_aggregation=True, method="fedhe", **SKEWED)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    np.testing.assert_array_equal(secure.store.counts, plain.store.counts)
    assert (plain.store.counts < 4).any()  # some class is not held by every client
    assert secure.store.uploads == plain.store.uploads == 4
    np.testing.assert_allclose(secure.store.sums, plain.store.sums, rtol=0, atol=4 * step())
    assert not np.array_equal(secure.store.sums, plain.store.sums)  # the quantisation ran
    assert_table_within_quantisation(secure._payload, plain._payload, plain.store.counts)
    assert records[0]["bytes_up"] == 4 * UPLOAD_BYTES


def test_fedhe_store_from_hand_computed_sums_grows_as_upload_by_upload():
    strategy = make_strategy("fedhe", num_clients=4, arch_mix="cnn1", secure_aggregation=True)
    strategy.store.add(9, np.array([0]), _rows([(4, 4)]))  # an earlier upload in the store
    tables = [secure_aggregation.holder_rows(np.array([0, 2]), _rows([(1, 0), (6, 6)]), C),
              secure_aggregation.holder_rows(np.array([0]), _rows([(1, 2)]), C)]
    sums = {k: tables[0][k] + tables[1][k] for k in tables[0]}
    strategy.aggregate_sums(1, sums, [Upload(ClientInfo(p, "cnn1"), 10, {}, {}) for p in (0, 1)])
    np.testing.assert_array_equal(strategy._payload["labels"], [0, 2])
    np.testing.assert_allclose(strategy._payload["logits"], _rows([(2, 2), (6, 6)]))
    assert strategy.store.uploads == 3


# -- settings ------------------------------------------------------------------------------------
def test_the_default_histories_take_secure_aggregation():
    # FD's default "auto" takes "round" in synchronous rounds; FedHe's default keeps "all".
    for method, history in (("fd", "auto"), ("fedhe", "all")):
        cfg = load_config(flat_config(method=method, secure_aggregation=True))
        assert cfg.secure_aggregation is True and cfg.settings.history == history


@pytest.mark.parametrize("overrides, words", [
    ({"method": "fd", "fd.history": "latest-per-client"},
     ["'fd'", "fd.history = 'latest-per-client'", "past round's sum", "fd.history = 'round'"]),
    ({"method": "fedhe", "fedhe.history": "running-mean"},
     ["'fedhe'", "fedhe.history = 'running-mean'", "collapse-every", "fedhe.history = 'all'"]),
    ({"method": "fedhe", "fedhe.history": "latest-per-client"},
     ["'fedhe'", "fedhe.history = 'latest-per-client'", "past round's sum"]),
    ({"method": "fd", "server-loop": "async"}, ["server-loop = 'async'", "no cohort to sum"]),
])
def test_histories_the_sums_cannot_keep_are_refused(overrides, words):
    flat = flat_config(secure_aggregation=True)
    flat.update(overrides)
    with pytest.raises(ConfigError) as refused:
        load_config(flat)
    for word in words:
        assert word in str(refused.value)
