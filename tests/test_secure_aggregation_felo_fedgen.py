"""Felo's and FedGen's fixed-layout variants under secure aggregation (SecAgg+, in process:
tests/test_secure_aggregation.py's harness): the server's state from the sums equals the plain
one of the same seed within the quantisation error, the masked upload is the layout's size, and
the layouts' sums give the server's quantities by hand."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.runtime import secure_aggregation
from strategies import load_config
from tests.test_secure_aggregation import _class_counts, flat_config, run, step

# With the paper's group averaging, whose group models are summed too.
FELO = {"method": "felo", "arch_mix": "cnn1,cnn2", "felo.history": "latest-round",
        "felo.group-avg": True}


# -- Felo ----------------------------------------------------------------------------------------
def test_felo_secure_tables_and_group_models_equal_the_plain_ones(tmp_path):
    plain, _, _ = run(tmp_path / "plain", "plain", **FELO)
    secure, records, _ = run(tmp_path / "secure", "secure", secure_aggregation=True, **FELO)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    want, got = plain.tables, secure.tables
    np.testing.assert_array_equal(got["class-labels"], want["class-labels"])
    # Class c's row is the unweighted mean over its h_c >= 1 holders: each of the 4 survivors'
    # row values and weights is off by less than one step, so the mean is off by at most
    # 4 step (1 + |mean|) / h_c (and float32's rounding).
    changed = 0
    for name in ("class-features", "class-logits"):
        tol = 4 * step() * (1 + np.abs(want[name]).max()) + 1e-6
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=tol, err_msg=name)
        changed += int(not np.array_equal(got[name], want[name]))
    # Group g's model: weights n_k / weight_scale sum to S_g over its members; every survivor
    # adds an error below one step to every slot (zeros in the other groups' slots), so the
    # mean is off by at most 4 step (1 + |mean|) / S_g.
    sizes, scale = secure.train_sizes, max(secure.train_sizes)
    assert sorted(plain.group_models) == sorted(secure.group_models) == ["cnn1", "cnn2"]
    for arch, model in plain.group_models.items():
        s_g = sum(n for n, a in zip(sizes, secure.architectures) if a == arch) / scale
        for name, array in model.items():
            tol = 4 * step() * (1 + np.abs(array).max()) / s_g + 1e-6
            assert secure.group_models[arch][name].dtype == array.dtype
            np.testing.assert_allclose(secure.group_models[arch][name], array, rtol=0,
                                       atol=tol, err_msg=f"{arch} {name}")
            changed += int(not np.array_equal(secure.group_models[arch][name], array))
    assert changed, "SecAgg+ quantises: a bit-identical result means it never ran"
    # Each masked upload: the class table (C x (d + C) rows, C weights, C holders), every
    # architecture's model slot with its weight and holders, SecAgg+'s own weight, in int64.
    models = sum(sum(a.size for a in m.values()) + 2 for m in plain.group_models.values())
    assert records[0]["bytes_up"] == 4 * 8 * (10 * (16 + 10) + 10 + 10 + models + 1)


def test_felo_settings_whose_server_needs_individual_uploads_are_refused():
    with pytest.raises(ConfigError) as refused:
        load_config(flat_config(secure_aggregation=True, method="felo"))  # history = "fifo"
    for word in ("'felo'", "felo.history = 'fifo'", "history = 'latest-round'"):
        assert word in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        load_config(flat_config(secure_aggregation=True, **{**FELO, "felo.history-size": 3}))
    for word in ("'felo'", "felo.history-size = 3", "4 clients of a round"):
        assert word in str(refused.value)
    load_config(flat_config(secure_aggregation=True, **FELO))  # latest-round: taken


def test_group_table_sums_give_each_groups_weighted_mean():
    # A (group "a", weight 0.5) and B ("a", 0.25) average into group "a"; C ("b", 1.0) alone
    # is group "b"'s mean; nobody is in group "c". An integer counter is rounded back. The
    # prefix keeps the table's columns apart from a class table's (Felo's upload has both).
    layouts = {"c": {"w": (2,), "n": (1,)}, "a": {"w": (2,), "n": (1,)},
               "b": {"w": (2,), "n": (1,)}}
    uploads = [("a", {"w": np.array([1.0, 2.0]), "n": np.array([4])}, 0.5),
               ("a", {"w": np.array([4.0, -4.0]), "n": np.array([7])}, 0.25),
               ("b", {"w": np.array([3.0, 3.0]), "n": np.array([1])}, 1.0)]
    dense = [secure_aggregation.group_table(layouts, g, p, w, prefix="group/")
             for g, p, w in uploads]
    assert {k: v.shape for k, v in dense[0].items()} == \
        secure_aggregation.group_table_layout(layouts, prefix="group/")
    assert secure_aggregation.SUM_WEIGHT not in dense[0]  # the class table's column is free
    np.testing.assert_array_equal(dense[0]["group/b/w"], [0.0, 0.0])
    # The columns follow the groups' sorted names (a, b, c), whatever the mapping's order.
    np.testing.assert_array_equal(dense[2]["group/" + secure_aggregation.HOLDERS], [0, 1, 0])
    sums = {k: sum(d[k] for d in dense) for k in dense[0]}
    means = secure_aggregation.group_means_from_sums(sums, layouts, prefix="group/")
    assert sorted(means) == ["a", "b"]
    like = {"w": np.zeros(2, np.float32), "n": np.zeros(1, np.int64)}
    a = secure_aggregation.in_dtypes_of(means["a"], like)
    np.testing.assert_allclose(a["w"], [(0.5 * 1 + 0.25 * 4) / 0.75,
                                        (0.5 * 2 - 0.25 * 4) / 0.75], rtol=1e-6)
    assert a["n"].dtype == np.int64 and a["n"][0] == 5  # (0.5 * 4 + 0.25 * 7) / 0.75
    assert a["w"].dtype == np.float32
    np.testing.assert_allclose(means["b"]["w"], [3.0, 3.0])


# -- FedGen --------------------------------------------------------------------------------------
# dirichlet(0.5) label skew; a small G trained briefly (what it is trained on is compared)
FEDGEN = {"method": "fedgen", "arch_mix": "cnn1,cnn2", "fedgen.server-steps": 2,
          "fedgen.hidden-dim": 16}


def _fedgen_run(tmp_path, monkeypatch, name, **overrides):
    """A FedGen run, with what its server trained G on: (strategy, records, {"teachers": each
    label's teacher head sum_k w[y, k] h_k as (weight [C, C, d], bias [C, C]), "pool": the
    histogram G's labels were drawn from}) of train_generator's last call."""
    from strategies.fedgen import maths
    seen = {}
    train = maths.train_generator

    def spy(generator, heads, weights, pool, *args, **kwargs):
        seen.update(teachers=_teachers(heads, weights), pool=pool.copy())
        return train(generator, heads, weights, pool, *args, **kwargs)
    monkeypatch.setattr(maths, "train_generator", spy)
    strategy, records, _ = run(tmp_path / name, name, **FEDGEN, **overrides)
    return strategy, records, seen


def _teachers(heads, weights) -> tuple[np.ndarray, np.ndarray]:
    """Each label's teacher head of an ensemble (K heads, weights [C, K])."""
    return (np.einsum("yk,kcd->ycd", weights, np.stack([h["head.weight"] for h in heads])),
            np.einsum("yk,kc->yc", weights, np.stack([h["head.bias"] for h in heads])))


def test_fedgen_secure_head_and_teachers_equal_the_plain_ones(tmp_path, monkeypatch):
    plain, _, want = _fedgen_run(tmp_path, monkeypatch, "plain")
    secure, records, got = _fedgen_run(tmp_path, monkeypatch, "secure", secure_aggregation=True)
    assert records[0]["secure_aggregation"] == {"survivors": [0, 1, 2, 3]}
    counts = _class_counts(secure)
    assert (counts == 0).any()  # label skew: the teachers differ from label to label
    # The label histograms come back as exact integers: the round's pool G's labels are
    # drawn from, and the pool of every client the server knows (all 4 asked in round 1).
    np.testing.assert_array_equal(got["pool"], counts.sum(0))
    np.testing.assert_array_equal(got["pool"], want["pool"])
    np.testing.assert_array_equal(secure.known_pool(), plain.known_pool())
    assert secure.reported == plain.reported == {0, 1, 2, 3} and secure.label_counts == {}
    # The global head: weights n_k / weight_scale sum to S_w; each survivor's values and
    # weight are off by less than one step: off by at most 4 step (1 + |mean|) / S_w.
    scale = max(secure.train_sizes)
    s_w = sum(secure.train_sizes) / scale
    changed = 0
    for name, array in plain.global_head.items():
        tol = 4 * step() * (1 + np.abs(array).max()) / s_w + 1e-6
        np.testing.assert_allclose(secure.global_head[name], array, rtol=0, atol=tol)
        changed += int(not np.array_equal(secure.global_head[name], array))
    # Label y's teacher head: weights n_k^y / weight_scale, the same bound over their sum.
    for part, (got_part, want_part) in enumerate(zip(got["teachers"], want["teachers"])):
        for y in range(10):
            if counts[:, y].sum() == 0:  # nobody's label: zero weights, never drawn
                np.testing.assert_array_equal(got_part[y], 0)
                continue
            tol = 4 * step() * (1 + np.abs(want_part[y]).max()) / (counts[:, y].sum() / scale)
            np.testing.assert_allclose(got_part[y], want_part[y], rtol=0, atol=tol + 1e-6,
                                       err_msg=f"teacher {y} ({part})")
        changed += int(not np.array_equal(got_part, want_part))
    assert changed, "SecAgg+ quantises: a bit-identical result means it never ran"
    # Each masked upload: the weighted head (C x d + C) and its weight; a table of C teacher
    # rows (C x d + C each), C weights, C holders; two C-count columns; SecAgg+'s own weight.
    head = 10 * 16 + 10
    assert records[0]["bytes_up"] == 4 * 8 * (head + 1 + 10 * head + 10 + 10 + 2 * 10 + 1)


def test_fedgen_with_per_client_teacher_weights_sends_only_the_head(tmp_path, monkeypatch):
    # teacher-weights = "samples": every label's teacher is the n_k-weighted mean head, which
    # the weighted head gives; the pool is every known client's, which the new counts give.
    plain, _, want = _fedgen_run(tmp_path, monkeypatch, "plain-samples",
                                 **{"fedgen.teacher-weights": "samples"})
    secure, records, got = _fedgen_run(tmp_path, monkeypatch, "secure-samples",
                                       secure_aggregation=True,
                                       **{"fedgen.teacher-weights": "samples"})
    np.testing.assert_array_equal(got["pool"], want["pool"])
    s_w = sum(secure.train_sizes) / max(secure.train_sizes)
    for got_part, want_part in zip(got["teachers"], want["teachers"]):
        tol = 4 * step() * (1 + np.abs(want_part).max()) / s_w + 1e-6
        np.testing.assert_allclose(got_part, want_part, rtol=0, atol=tol)
    assert records[0]["bytes_up"] == 4 * 8 * (10 * 16 + 10 + 1 + 10 + 1)


def test_teacher_heads_train_the_generator_as_the_ensemble_does():
    # Linear heads: label y's teacher sum_k w[y, k] h_k, from the summed table of n_k^y-
    # weighted heads, with the identity as weights, gives the ensemble's logits, so G's
    # training is the same (same seed, same steps) up to float rounding.
    import torch
    from strategies.fedgen import FedGenSettings
    from strategies.fedgen.maths import Generator, teacher_heads, train_generator
    rng = np.random.default_rng(0)
    c, d = 3, 2
    heads = [{"head.weight": rng.normal(size=(c, d)).astype(np.float32),
              "head.bias": rng.normal(size=c).astype(np.float32)} for _ in range(2)]
    histograms = np.array([[4, 1, 0], [0, 3, 0]])  # nobody holds label 2
    weights = histograms.T / np.maximum(histograms.sum(0), 1)[:, None]  # teacher_weights
    tables = [secure_aggregation.class_table(
        np.flatnonzero(n), np.tile(np.concatenate([h["head.weight"].ravel(), h["head.bias"]]),
                                   (int((n > 0).sum()), 1)), n[n > 0] / 8, c)
        for h, n in zip(heads, histograms)]
    table = {k: tables[0][k] + tables[1][k] for k in tables[0]}
    teachers, identity = teacher_heads(table, c, d)
    np.testing.assert_array_equal(identity, np.eye(c))
    np.testing.assert_allclose(teachers[1]["head.weight"],
                               0.25 * heads[0]["head.weight"] + 0.75 * heads[1]["head.weight"],
                               rtol=1e-6)
    np.testing.assert_array_equal(teachers[2]["head.bias"], 0)
    settings = FedGenSettings(server_steps=3, noise_dim=4, hidden_dim=8)
    gens = [Generator(4, c, 8, d) for _ in range(2)]
    gens[1].load_state_dict(gens[0].state_dict())
    pool = histograms.sum(0)
    loss_ensemble = train_generator(gens[0], heads, weights, pool, settings, batch_size=5,
                                    seed=7)
    loss_teachers = train_generator(gens[1], teachers, identity, pool, settings, batch_size=5,
                                    seed=7)
    assert loss_teachers == pytest.approx(loss_ensemble, rel=1e-5)
    labels, eps = torch.arange(c), torch.rand(c, 4)
    torch.testing.assert_close(gens[0](labels, eps), gens[1](labels, eps), rtol=1e-4,
                               atol=1e-4)


def test_label_counts_come_back_exact_through_the_public_divisor():
    # Counts 7 and 5 over the divisor 3 are 7/3 and 5/3; their sum, off by a quantisation
    # error far below 1/2 / 3, times 3 rounds back to 12.
    from strategies.fedgen.maths import counts_from_sum
    np.testing.assert_array_equal(counts_from_sum(np.array([7 / 3 + 5 / 3 + 4e-5, 1e-5]), 3),
                                  [12, 0])
