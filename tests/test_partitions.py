"""Tests for fedapp.data.partitions (fast: label arrays only, no images except tiny fakes)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedapp.data.datasets import TensorData
from fedapp.data.partitions import (
    SCHEMES,
    Partition,
    PartitionError,
    PartitionSpec,
    client_data,
    get_partition,
    load_client_data,
    make_partition,
)

C = 10
N_TRAIN = 20_000
N_TEST = 4_000


def balanced_labels(n: int, num_classes: int, seed: int) -> np.ndarray:
    """Shuffled labels with exactly n / num_classes samples per class (like FMNIST)."""
    y = np.arange(n) % num_classes
    return np.random.default_rng(seed).permutation(y).astype(np.int64)


TRAIN_Y = balanced_labels(N_TRAIN, C, 1)
TEST_Y = balanced_labels(N_TEST, C, 2)


def part(**kw) -> Partition:
    return make_partition(TRAIN_Y, TEST_Y, C, PartitionSpec(**kw))


def classes_of(idx: np.ndarray, labels: np.ndarray) -> set[int]:
    return set(np.unique(labels[idx]).tolist())


# --------------------------------------------------------------------------- #
# Determinism and disjointness, all schemes
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("scheme", SCHEMES)
def test_same_seed_same_indices_different_seed_different(scheme):
    kw = dict(scheme=scheme, num_clients=8, val_fraction=0.1, label_permutation=True)
    a, b = part(seed=3, **kw), part(seed=3, **kw)
    for ca, cb in zip(a.clients, b.clients):
        for field in ("train", "val", "test", "label_permutation"):
            np.testing.assert_array_equal(getattr(ca, field), getattr(cb, field))
    c = part(seed=4, **kw)
    assert any(
        not np.array_equal(ca.train, cc.train) for ca, cc in zip(a.clients, c.clients)
    ), "a different seed must change the partition"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_train_and_val_indices_disjoint_across_clients(scheme):
    p = part(scheme=scheme, num_clients=10, val_fraction=0.1)
    own = np.concatenate([np.concatenate([c.train, c.val]) for c in p.clients])
    assert len(own) == len(np.unique(own)), "clients share train/val samples"
    for c in p.clients:
        assert c.train.dtype == np.int64 and c.val.dtype == np.int64 and c.test.dtype == np.int64
        assert len(c.train) > 0
        assert not c.train.flags.writeable  # cached partitions are shared: read-only


def test_two_class_with_replacement_reproduces_official_code():
    k, K = 2, 10
    p = part(scheme="two-class", num_clients=K, two_class_with_replacement=True)
    shard = N_TRAIN // (k * K)
    all_train = np.concatenate([c.train for c in p.clients])
    # sampling WITH replacement (FedClassAvg utils.partition_data): duplicates expected
    assert len(np.unique(all_train)) < len(all_train)
    for counts in p.class_counts(TRAIN_Y, C):
        nz = counts[counts > 0]
        assert len(nz) == k and np.all(nz == shard)


# --------------------------------------------------------------------------- #
# Scheme-specific class structure
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("k,K", [(2, 10), (3, 20), (5, 4)])
def test_pathological_k_classes_each_class_to_kK_over_C_clients(k, K):
    p = part(scheme="pathological", num_clients=K, classes_per_client=k, test_fraction=0.0)
    counts = p.class_counts(TRAIN_Y, C)
    assert np.all((counts > 0).sum(axis=1) == k)
    assert np.all((counts > 0).sum(axis=0) == k * K // C)
    assert counts.sum() == N_TRAIN  # every sample is used
    # each (client, class) share ~ U(0.4, 0.6) normalised over the holders
    holders = k * K // C
    shares = counts / counts.sum(axis=0, keepdims=True)
    lo, hi = 0.4 / (0.4 + 0.6 * (holders - 1)), 0.6 / (0.6 + 0.4 * (holders - 1))
    nz = shares[counts > 0]
    assert nz.min() >= lo - 0.01 and nz.max() <= hi + 0.01


def test_pathological_non_integer_holders_spread_evenly():
    k, K = 3, 7  # k*K/C = 2.1 -> one class has 3 holders, nine have 2
    p = part(scheme="pathological", num_clients=K, classes_per_client=k)
    counts = p.class_counts(TRAIN_Y, C)
    assert np.all((counts > 0).sum(axis=1) == k)
    holders = (counts > 0).sum(axis=0)
    assert sorted(holders.tolist()) == [2] * 9 + [3]


def test_two_class_default_two_classes_equal_sizes():
    K = 10
    p = part(scheme="two-class", num_clients=K)
    counts = p.class_counts(TRAIN_Y, C)
    assert np.all((counts > 0).sum(axis=1) == 2)
    assert np.all(counts.sum(axis=1) == N_TRAIN // K)


def test_two_class_generalises_to_classes_per_client():
    p = part(scheme="two-class", num_clients=5, classes_per_client=4)
    counts = p.class_counts(TRAIN_Y, C)
    assert np.all((counts > 0).sum(axis=1) == 4)
    assert np.all(counts[counts > 0] == N_TRAIN // (4 * 5))


def test_two_class_uneven_holders_stay_disjoint_and_capped():
    # k*K/C = 2.4: some classes have 3 holders and cannot give each n/(kK) samples;
    # those (client, class) pairs get n_c // holders instead (documented behaviour)
    p = part(scheme="two-class", num_clients=6, classes_per_client=4)
    counts = p.class_counts(TRAIN_Y, C)
    assert np.all((counts > 0).sum(axis=1) == 4)
    assert set(counts[counts > 0].tolist()) == {N_TRAIN // 24, (N_TRAIN // C) // 3}


@pytest.mark.parametrize("n,k", [(500, 5), (101, 3)])
def test_fixed_size_exact_size_k_classes_balanced(n, k):
    p = part(scheme="fixed-size", num_clients=12, samples_per_client=n, classes_per_client=k)
    counts = p.class_counts(TRAIN_Y, C)
    assert np.all(counts.sum(axis=1) == n)
    assert np.all((counts > 0).sum(axis=1) == k)
    nz = counts[counts > 0]
    assert set(nz.tolist()) <= {n // k, n // k + 1}


def test_dirichlet_respects_min_partition_size_and_is_skewed():
    # alpha 0.1 with min 200 of ~1000 per client needs re-draws (flwr-datasets
    # alone gives up after 10; we restart it with derived seeds, like NIID-Bench)
    p = part(scheme="dirichlet", num_clients=20, alpha=0.1, min_partition_size=200)
    sizes = np.array([len(c.train) for c in p.clients])
    assert sizes.min() >= 200
    assert sizes.sum() == N_TRAIN
    counts = p.class_counts(TRAIN_Y, C)
    # Dir(0.1) is strongly skewed: most clients miss some classes entirely
    assert (counts == 0).sum() > 20


def test_iid_equal_sizes_all_classes():
    p = part(scheme="iid", num_clients=10)
    counts = p.class_counts(TRAIN_Y, C)
    assert np.all(counts.sum(axis=1) == N_TRAIN // 10)
    assert np.all(counts > 100)


# --------------------------------------------------------------------------- #
# Local test sets, validation, cap
# --------------------------------------------------------------------------- #
def _proportions(labels: np.ndarray) -> np.ndarray:
    return np.bincount(labels, minlength=C) / max(1, len(labels))


@pytest.mark.parametrize("mode", ["global", "split"])
@pytest.mark.parametrize("scheme", ["dirichlet", "pathological", "two-class"])
def test_local_test_follows_client_train_distribution(mode, scheme):
    p = part(scheme=scheme, num_clients=10, local_test=mode, test_fraction=0.2, val_fraction=0.1)
    test_pool = TEST_Y if mode == "global" else TRAIN_Y
    for c in p.clients:
        assert len(np.unique(c.test)) == len(c.test), "test drawn without replacement"
        assert classes_of(c.test, test_pool) <= classes_of(c.train, TRAIN_Y)
        assert classes_of(c.val, TRAIN_Y) <= classes_of(c.train, TRAIN_Y)
        # integer rounding moves each class by < 1 sample -> L1 error below C / test size
        l1 = np.abs(_proportions(test_pool[c.test]) - _proportions(TRAIN_Y[c.train])).sum()
        assert l1 < C / len(c.test) + 0.01, f"test proportions differ from train (L1 {l1:.3f})"


def test_global_test_size_is_fraction_of_train():
    p = part(scheme="iid", num_clients=10, test_fraction=0.3)
    for c in p.clients:
        assert len(c.test) == round(0.3 * len(c.train))
        assert c.test.max() < N_TEST


def test_global_test_shrinks_but_keeps_proportions_when_test_pool_too_small():
    # one client holds a whole class (2000 train samples) but the test split has
    # only 400 of it: a 0.5 fraction (1000) cannot be met -> smaller, same proportions
    p = part(scheme="pathological", num_clients=5, classes_per_client=1, test_fraction=0.5)
    for c in p.clients:
        assert len(c.test) == 400
        assert classes_of(c.test, TEST_Y) == classes_of(c.train, TRAIN_Y)


def test_split_mode_disjoint_from_train_and_val():
    p = part(scheme="dirichlet", num_clients=10, local_test="split", test_fraction=0.1,
             val_fraction=0.1)
    for c in p.clients:
        n_own = len(c.train) + len(c.val) + len(c.test)
        assert not set(c.test) & set(c.train)
        assert not set(c.test) & set(c.val)
        assert not set(c.val) & set(c.train)
        assert abs(len(c.test) - 0.1 * n_own) <= 1 and abs(len(c.val) - 0.1 * n_own) <= 1


def test_split_mode_keeps_a_train_sample_of_every_held_out_class():
    # tiny client (cap 12) with a large test fraction: classes with few samples
    # must still keep at least one train sample
    p = part(scheme="dirichlet", num_clients=10, alpha=0.3, local_test="split",
             test_fraction=0.5, max_samples_per_client=12)
    for c in p.clients:
        assert classes_of(c.test, TRAIN_Y) <= classes_of(c.train, TRAIN_Y)


def test_cap_subsamples_train_stratified():
    p_full = part(scheme="dirichlet", num_clients=10, alpha=1.0)
    p_cap = part(scheme="dirichlet", num_clients=10, alpha=1.0, max_samples_per_client=300)
    for full, cap in zip(p_full.clients, p_cap.clients):
        assert len(cap.train) == min(300, len(full.train))
        assert set(cap.train) <= set(full.train)
        assert len(cap.test) == round(0.2 * len(cap.train))
        l1 = np.abs(_proportions(TRAIN_Y[cap.train]) - _proportions(TRAIN_Y[full.train])).sum()
        assert l1 < 0.05


# --------------------------------------------------------------------------- #
# Label permutation and client tensors
# --------------------------------------------------------------------------- #
def fake_tensor_data() -> TensorData:
    """Images whose single pixel stores the GLOBAL label, so permutations can be checked."""
    def x_of(y):
        return torch.from_numpy(y).float().view(-1, 1, 1, 1)

    return TensorData("fake", x_of(TRAIN_Y), torch.from_numpy(TRAIN_Y), x_of(TEST_Y),
                      torch.from_numpy(TEST_Y), C, (1, 1, 1))


@pytest.mark.parametrize("mode", ["global", "split"])
def test_label_permutation_is_permutation_and_applied_consistently(mode):
    data = fake_tensor_data()
    spec = PartitionSpec(scheme="pathological", num_clients=5, classes_per_client=3,
                         label_permutation=True, local_test=mode, val_fraction=0.1)
    p = make_partition(TRAIN_Y, TEST_Y, C, spec)
    perms = [c.label_permutation for c in p.clients]
    for perm in perms:
        assert sorted(perm.tolist()) == list(range(C))
    assert len({tuple(perm) for perm in perms}) > 1, "clients should get different permutations"
    for cid, c in enumerate(p.clients):
        cd = client_data(data, p, cid)
        perm = torch.from_numpy(np.array(c.label_permutation))
        for x, y, n in ((cd.train_x, cd.train_y, len(c.train)), (cd.val_x, cd.val_y, len(c.val)),
                        (cd.test_x, cd.test_y, len(c.test))):
            assert len(y) == n and y.dtype == torch.int64
            global_y = x.view(-1).long()
            assert torch.equal(y, perm[global_y])


def test_client_data_without_permutation_matches_indices():
    data = fake_tensor_data()
    p = make_partition(TRAIN_Y, TEST_Y, C, PartitionSpec(scheme="iid", num_clients=4))
    cd = client_data(data, p, 2)
    assert torch.equal(cd.train_y, data.train_y[torch.from_numpy(np.array(p.clients[2].train))])
    assert torch.equal(cd.test_x.view(-1).long(), cd.test_y)
    assert cd.val_x.shape == (0, 1, 1, 1)


def test_load_client_data_partitions_once_per_process():
    data = fake_tensor_data()
    spec = PartitionSpec(scheme="two-class", num_clients=4)
    assert get_partition(data, spec) is get_partition(data, spec)
    a, b = load_client_data(data, spec, 1), load_client_data(data, spec, 1)
    assert torch.equal(a.train_y, b.train_y)
    with pytest.raises(PartitionError, match="partition_id"):
        load_client_data(data, spec, 4)


def test_summary_is_json_ready():
    p = part(scheme="dirichlet", num_clients=3, label_permutation=True, val_fraction=0.1)
    s = json.loads(json.dumps(p.summary(TRAIN_Y, TEST_Y, C)))
    assert s["spec"]["scheme"] == "dirichlet" and len(s["clients"]) == 3
    c0 = s["clients"][0]
    assert c0["train_size"] == sum(c0["train_class_counts"])
    assert c0["test_size"] == sum(c0["test_class_counts"])
    assert sorted(c0["label_permutation"]) == list(range(C))


# --------------------------------------------------------------------------- #
# flwr-datasets Partitioner contract
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name,args", [
    ("PathologicalSharesPartitioner", (5, 2)),
    ("TwoClassPartitioner", (5, 2)),
    ("FixedSizePartitioner", (5, 100, 2)),
])
def test_custom_partitioners_follow_flwr_contract(name, args):
    from datasets import Dataset
    from flwr_datasets.partitioner import Partitioner

    from fedapp.data import flwr_partitioners

    ds = Dataset.from_dict({"label": TRAIN_Y[:2000], "row": np.arange(2000)})
    partitioner = getattr(flwr_partitioners, name)(*args, seed=0)
    assert isinstance(partitioner, Partitioner)
    partitioner.dataset = ds
    assert partitioner.num_partitions == 5
    rows = [partitioner.load_partition(i)["row"] for i in range(5)]
    labels = [set(partitioner.load_partition(i)["label"]) for i in range(5)]
    assert all(len(lab) == 2 for lab in labels)
    flat = [r for rs in rows for r in rs]
    assert len(flat) == len(set(flat))
    with pytest.raises(ValueError):
        partitioner.load_partition(5)


# --------------------------------------------------------------------------- #
# Same partitions as flwr-datasets' partitioners on a Hugging Face dataset
# --------------------------------------------------------------------------- #
# Labels with a class missing and uneven class sizes, beside the balanced TRAIN_Y.
SKEWED_Y = np.random.default_rng(3).choice(
    C - 1, size=12_000, p=np.arange(C - 1, 0, -1) / np.arange(C - 1, 0, -1).sum()
).astype(np.int64)


def reference_train_indices(train_labels: np.ndarray, spec: PartitionSpec):
    """Each client's train indices, in order, from flwr-datasets' partitioners (``iid``,
    ``dirichlet``) or fedapp's ``Partitioner`` s on a label-only ``datasets.Dataset`` whose rows
    carry their index; None where the scheme gives up.  ``iid`` and ``dirichlet`` see the rows in
    the order of ``default_rng([seed, 0])``; ``dirichlet`` restarts with seeds
    ``SeedSequence([seed, 99, restart])`` when ``DirichletPartitioner`` gives up."""
    import warnings

    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    from fedapp.data import flwr_partitioners as fp

    n = len(train_labels)
    shuffled = spec.scheme in ("iid", "dirichlet")
    order = np.random.default_rng([spec.seed, 0]).permutation(n) if shuffled else np.arange(n)
    ds = Dataset.from_dict({"label": train_labels[order], "row": order})

    def rows(partitioner):
        partitioner.dataset = ds
        return [partitioner.load_partition(i).with_format("arrow")["row"].to_numpy()
                for i in range(spec.num_clients)]

    K, k = spec.num_clients, spec.classes_per_client
    if spec.scheme == "iid":
        return rows(IidPartitioner(K))
    if spec.scheme == "pathological":
        return rows(fp.PathologicalSharesPartitioner(K, k, seed=spec.seed))
    if spec.scheme == "two-class":
        return rows(fp.TwoClassPartitioner(K, k, spec.two_class_with_replacement, seed=spec.seed))
    if spec.scheme == "fixed-size":
        try:
            return rows(fp.FixedSizePartitioner(K, spec.samples_per_client, k, seed=spec.seed))
        except ValueError:
            return None
    for restart in range(10):
        seed = spec.seed if restart == 0 else int(
            np.random.SeedSequence([spec.seed, 99, restart]).generate_state(1)[0])
        partitioner = DirichletPartitioner(
            K, "label", alpha=float(spec.alpha), min_partition_size=spec.min_partition_size,
            self_balancing=True, shuffle=True, seed=seed)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # one warning per re-draw
                return rows(partitioner)
        except ValueError:  # min_partition_size not met after its re-draws
            continue
    return None


def _cases():
    extras = [dict(), dict(max_samples_per_client=25, val_fraction=0.1, label_permutation=True),
              dict(local_test="split", test_fraction=0.2, val_fraction=0.1)]
    cases = []
    for i, (K, seed) in enumerate([(1, 0), (3, 7), (10, 1), (64, 2)]):
        cases.append(dict(scheme="iid", num_clients=K, seed=seed, **extras[i % 3]))
    for i, (K, seed, alpha, m) in enumerate([
        (5, 0, 0.5, 10), (20, 4, 0.1, 0), (100, 1, 2.0, 10), (7, 2, 0.05, 5),
        (20, 0, 0.1, 200),  # DirichletPartitioner gives up: the second seed meets it
        (20, 0, 0.1, 300),  # ... the fifth seed
        (20, 1, 0.1, 300),  # no seed meets it: refused
    ]):
        cases.append(dict(scheme="dirichlet", num_clients=K, seed=seed, alpha=alpha,
                          min_partition_size=m, **extras[i % 3]))
    for i, (K, seed, k) in enumerate([(5, 0, 2), (10, 3, 1), (7, 1, 3), (40, 2, 4)]):
        for scheme in ("pathological", "two-class", "fixed-size"):
            cases.append(dict(scheme=scheme, num_clients=K, seed=seed, classes_per_client=k,
                              samples_per_client=max(k, 3000 // K), **extras[i % 3]))
        cases.append(dict(scheme="two-class", num_clients=K, seed=seed, classes_per_client=k,
                          two_class_with_replacement=True, **extras[(i + 1) % 3]))
    cases.append(dict(scheme="fixed-size", num_clients=10, classes_per_client=2,
                      samples_per_client=1100))  # too many per class on SKEWED_Y: refused
    return cases


FLWR_DATASETS_SCHEMES = ("iid", "dirichlet")  # the schemes flwr-datasets has itself


def _case_id(kw):
    return "-".join(f"{v}" for v in kw.values())


@pytest.mark.parametrize("kw", [kw for kw in _cases() if kw["scheme"] in FLWR_DATASETS_SCHEMES],
                         ids=_case_id)
@pytest.mark.parametrize("labels", [TRAIN_Y, SKEWED_Y], ids=["balanced", "skewed"])
def test_partitions_identical_to_flwr_datasets_partitioners(kw, labels, monkeypatch):
    assert_same_partitions(kw, labels, monkeypatch)


# flwr-datasets has no partitioner for the papers' schemes. These cases check only that
# fedapp's own Partitioners for FederatedDataset (fedapp/data/flwr_partitioners.py) give the
# rows the in-process partitioning gives, the same row functions behind both; that the rows
# follow each paper's rule is checked above (test_pathological_*, test_two_class_*,
# test_fixed_size_*).
@pytest.mark.parametrize("kw", [kw for kw in _cases()
                                if kw["scheme"] not in FLWR_DATASETS_SCHEMES], ids=_case_id)
@pytest.mark.parametrize("labels", [TRAIN_Y, SKEWED_Y], ids=["balanced", "skewed"])
def test_papers_schemes_as_flwr_partitioners_give_the_in_process_partitions(kw, labels,
                                                                            monkeypatch):
    assert_same_partitions(kw, labels, monkeypatch)


def assert_same_partitions(kw, labels, monkeypatch):
    """make_partition's train indices, in order, and the whole partition built on them, equal
    those from reference_train_indices; a spec the reference refuses is refused."""
    from fedapp.data import partitions as partitions_mod

    spec = PartitionSpec(**kw)
    reference = reference_train_indices(labels, spec)
    if reference is None:
        with pytest.raises(PartitionError):
            make_partition(labels, TEST_Y, C, spec)
        return
    got = partitions_mod._partition_train_indices(labels, spec)
    assert len(got) == len(reference)
    for ours, theirs in zip(got, reference):  # the order matters: the cap and hold-outs use it
        assert ours.dtype == np.int64
        np.testing.assert_array_equal(ours, theirs)
    # ... and so the whole partition: cap, hold-outs, local test, label permutation
    ours = make_partition(labels, TEST_Y, C, spec)
    monkeypatch.setattr(partitions_mod, "_partition_train_indices", lambda *_: reference)
    theirs = make_partition(labels, TEST_Y, C, spec)
    for a, b in zip(ours.clients, theirs.clients, strict=True):
        for field in ("train", "val", "test", "label_permutation"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_partitions_identical_to_flwr_datasets_at_a_thousand_clients():
    spec = PartitionSpec(scheme="dirichlet", num_clients=1200, seed=5, alpha=0.5,
                         min_partition_size=2)
    from fedapp.data.partitions import _partition_train_indices

    got, reference = _partition_train_indices(TRAIN_Y, spec), reference_train_indices(TRAIN_Y, spec)
    assert len(got) == len(reference) == 1200
    for ours, theirs in zip(got, reference):
        np.testing.assert_array_equal(ours, theirs)


def test_partitioning_builds_no_hugging_face_dataset():
    # Run in a fresh interpreter: the tests above import `datasets` into this one.
    code = (
        "import sys, numpy as np\n"
        "from fedapp.data.partitions import SCHEMES, PartitionSpec, make_partition\n"
        "y = np.arange(2000) % 10\n"
        "for s in SCHEMES:\n"
        "    make_partition(y, y, 10, PartitionSpec(scheme=s, num_clients=20,"
        " samples_per_client=50, min_partition_size=1))\n"
        "print(sorted(m for m in ('datasets', 'flwr_datasets', 'pyarrow') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


# --------------------------------------------------------------------------- #
# Error messages
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kw,key,allowed", [
    (dict(scheme="shards"), "scheme", "iid, dirichlet, pathological, two-class, fixed-size"),
    (dict(scheme="pathological", classes_per_client=11), "classes_per_client", "num_classes=10"),
    (dict(scheme="two-class", classes_per_client=0), "classes_per_client", "between 1 and"),
    (dict(scheme="dirichlet", min_partition_size=5000, num_clients=10), "min_partition_size",
     "min_partition_size * num_clients"),
    (dict(scheme="dirichlet", alpha=0.0), "alpha", "alpha > 0"),
    (dict(scheme="fixed-size", samples_per_client=5000, num_clients=10), "samples_per_client",
     "samples_per_client * num_clients"),
    (dict(local_test="local"), "local_test", "global, split"),
    (dict(test_fraction=1.5), "test_fraction", "0 <= test_fraction <= 1"),
    (dict(local_test="split", test_fraction=1.0), "val_fraction",
     "test_fraction + val_fraction < 1"),
    (dict(local_test="split", test_fraction=0.5, val_fraction=0.5), "val_fraction",
     "test_fraction + val_fraction < 1"),
    (dict(num_clients=0), "num_clients", "between 1 and"),
    (dict(max_samples_per_client=-1), "max_samples_per_client", ">= 0"),
])
def test_bad_specs_raise_clear_partition_error(kw, key, allowed):
    with pytest.raises(PartitionError) as info:
        part(**kw)
    msg = str(info.value)
    # The message names the setting as the run config spells it.
    setting = {"scheme": "partition", "alpha": "dirichlet-alpha"}.get(key, key.replace("_", "-"))
    assert f"setting {setting} = " in msg and allowed in msg, msg
    assert isinstance(info.value, ValueError)


def test_infeasible_dirichlet_min_size_is_a_partition_error():
    # 20 clients with >= 900 of 20000 samples each at alpha 0.05 is (practically) impossible
    with pytest.raises(PartitionError, match="min_partition_size"):
        part(scheme="dirichlet", num_clients=20, alpha=0.05, min_partition_size=900)


def test_labels_out_of_range_rejected():
    with pytest.raises(PartitionError, match="train_labels"):
        make_partition(TRAIN_Y, TEST_Y, 5, PartitionSpec())
