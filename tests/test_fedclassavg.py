"""FedClassAvg: its wire traffic, server averaging, losses, ablation switches, augmentations."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict

import strategies.fedclassavg.maths as fca
from fedapp.cli.run import resolve_settings
from fedapp.config import ConfigError, settings_keys
from fedapp.data.augment import ViewAugment, color_jitter, resized_crop_flip
from fedapp.runtime.payload import decode, encode, float32, from_ndarrays, to_ndarrays, wire_size
from fedapp.runtime.results import Recorder
from strategies import METHODS, load_config
from strategies.fedclassavg import FedClassAvgSettings
from tests.conftest import cfg_of, client_manager, eval_res, fit_res, make_strategy

CLASSIFIER = {"head.weight": (10, 512), "head.bias": (10,)}
SMALL = dict(dataset="synthetic", synthetic_train=120, synthetic_test=60, num_clients=3,
             partition="iid", max_samples_per_client=0, arch_mix="cnn5,cnn4,cnn3",
             optimizer="adam", lr=0.0006)


def _classifiers(rng, n):
    return [{k: rng.normal(size=s).astype(np.float32) for k, s in CLASSIFIER.items()}
            for _ in range(n)]


def _client(pid=0, **overrides):
    ctx = Context(run_id=11, node_id=pid, node_config={"partition-id": pid, "num-partitions": 3},
                  state=RecordDict(), run_config={})
    cfg = cfg_of(method="fedclassavg", **{**SMALL, **overrides})
    return METHODS["fedclassavg"].client(ctx, cfg)


def _own_head(client):
    """The client's own head as the server would send it back (on the CPU, copied)."""
    return {k: v.cpu().numpy().copy() for k, v in client.model.head_state().items()}


# -- traffic and server ---------------------------------------------------------------------------

def test_classifier_of_5130_floats_each_way_and_weighted_average(rng, tmp_path):
    recorder = Recorder(tmp_path / "run", method="fedclassavg", dataset="fmnist", num_clients=3,
                        num_rounds=1, config={}, partition={})
    # The shared default feature-dim (500, FedGH's) is replaced by the recipe's 512 (paper).
    counts = [30, 60, 210]
    strategy = make_strategy("fedclassavg", recorder, num_clients=3, arch_mix="cnn3,cnn4,cnn5",
                             sizes=counts)
    assert strategy.cfg.feature_dim == 512
    manager, proxies = client_manager(strategy)
    for _, ins in strategy.configure_fit(1, None, manager):
        assert wire_size(ins.parameters).data == 5130 * 4
        assert {k: v.shape for k, v in decode(ins.parameters).items()} == CLASSIFIER
    uploads = _classifiers(rng, 3)
    strategy.aggregate_fit(1, [(p, fit_res(c, n, i, a)) for i, (p, c, n, a) in enumerate(
        zip(proxies, uploads, counts, ["cnn3", "cnn4", "cnn5"]))], [])
    for name in CLASSIFIER:
        expected = sum(u[name] * n for u, n in zip(uploads, counts)) / sum(counts)
        np.testing.assert_allclose(strategy.global_head[name], expected, rtol=1e-5, atol=1e-6)
    strategy.configure_evaluate(1, None, manager)
    strategy.aggregate_evaluate(1, [(p, eval_res(i, a, 0.5)) for i, (p, a) in enumerate(
        zip(proxies, ["cnn3", "cnn4", "cnn5"]))], [])
    com = recorder.summary()["communication"]
    assert com["floats_per_client_per_round_up"] == com["floats_per_client_per_round_down"] \
        == 5130


def test_a_real_client_uploads_exactly_its_classifier():
    client = _client()
    arrays, n, metrics = client.fit([], {"server-round": 1})
    payload = from_ndarrays(arrays)
    assert {k: v.shape for k, v in payload.items()} == CLASSIFIER
    assert wire_size(encode(float32(payload))).data == 5130 * 4
    assert n == 40 and math.isfinite(metrics["train-loss"])


# -- losses ---------------------------------------------------------------------------------------

def _supcon_by_hand(views, labels, t, base):
    """The SupCon formula written out anchor by anchor."""
    z = np.concatenate([views[:, v] for v in range(views.shape[1])])
    y = np.tile(labels, views.shape[1])
    total = 0.0
    for i in range(len(z)):
        others = [a for a in range(len(z)) if a != i]
        denominator = sum(math.exp(z[i] @ z[a] / t) for a in others)
        positives = [p for p in others if y[p] == y[i]]
        total += np.mean([math.log(math.exp(z[i] @ z[p] / t) / denominator)
                          for p in positives])
    return -(t / base) * total / len(z)


@pytest.mark.parametrize("t,base,normalize", [(0.5, 0.07, False), (100.0, 0.07, False),
                                              (0.1, 0.1, True)])
def test_supcon_matches_the_formula(t, base, normalize):
    gen = torch.Generator().manual_seed(3)
    views = torch.randn(5, 2, 4, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 2, 1])
    got = fca.supcon_loss(views, labels, t, base, normalize)
    ref_views = F.normalize(views, dim=2) if normalize else views
    assert float(got) == pytest.approx(_supcon_by_hand(ref_views.numpy(), labels.numpy(), t,
                                                       base), rel=1e-9)


def test_supcon_rewards_features_that_cluster_by_label():
    labels = torch.tensor([0, 0, 1, 1])
    centres = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    clustered = centres[labels][:, None, :].repeat(1, 2, 1)
    mixed = centres[1 - labels][:, None, :].repeat(1, 2, 1)
    mixed[:, 1] = centres[labels]  # each sample's two views disagree
    args = (0.1, 0.1, True)
    assert fca.supcon_loss(clustered, labels, *args) < fca.supcon_loss(mixed, labels, *args)


def test_proximal_forms():
    w = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([1.0, -1.0])]
    g = [torch.zeros(2, 2), torch.tensor([0.0, 1.0])]
    squares = 1 + 4 + 9 + 16 + 1 + 4
    assert float(fca.proximal_term(w, g, "l2")) == pytest.approx(math.sqrt(squares))
    assert float(fca.proximal_term(w, g, "squared")) == pytest.approx(squares / 2)
    assert float(fca.proximal_term(w, g, "code-mse")) == pytest.approx((30 / 4 + 5 / 2) / 2)


def test_l2_proximal_has_a_finite_gradient_where_w_equals_the_global_classifier():
    w = [torch.ones(3, 2, requires_grad=True), torch.ones(3, requires_grad=True)]
    fca.proximal_term(w, [p.detach().clone() for p in w], "l2").backward()
    for p in w:
        assert torch.isfinite(p.grad).all() and not p.grad.any()


# -- the client's objective and its switches ------------------------------------------------------

def _terms(client, x, y):
    """The loss rebuilt from its parts, with the client's own model (views = raw images)."""
    s = client.cfg.settings
    model = client.model
    with torch.no_grad():
        pre = fca._pre_relu_extractor(model.extractor)(x)
        supcon = fca.supcon_loss(torch.stack([pre, pre], 1), y, s.temperature,
                                 s.base_temperature, s.normalize_features)
        ce = F.cross_entropy(model.head(F.relu(pre)), y)
        prox = fca.proximal_term(list(model.head.parameters()), client.global_classifier,
                                 s.proximal_form)
    return float(supcon), float(ce), float(prox) * s.rho


@pytest.mark.parametrize("contrastive,proximal", [(False, False), (False, True), (True, False),
                                                  (True, True)])
def test_ablation_switches_turn_terms_off(contrastive, proximal):
    client = _client(**{"fedclassavg.contrastive": contrastive,
                        "fedclassavg.proximal": proximal, "fedclassavg.views": "none"})
    head = _own_head(client)
    client.receive(head, 1)
    with torch.no_grad():
        client.model.head.weight.add_(0.5)  # away from the global classifier: prox > 0
    x, y = client.data.train_x[:16], client.data.train_y[:16]
    supcon, ce, prox = _terms(client, x, y)
    assert prox > 0.1 and supcon > 0.1
    expected = ce + contrastive * supcon + proximal * prox
    assert float(client.loss(x, y).detach()) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("views", ["simclr", "mild"])
def test_cross_entropy_sees_the_raw_image_or_the_first_view(views):
    # CNN-5 has no BatchNorm, so the raw image's logits do not depend on the rest of the batch.
    x, y = None, None
    for ce_view in ("raw", "augmented"):
        client = _client(**{"fedclassavg.views": views, "fedclassavg.ce-view": ce_view,
                            "fedclassavg.proximal": False})
        client.receive(_own_head(client), 1)
        x, y = client.data.train_x[:16], client.data.train_y[:16]
        client.loss(x, y)
        with torch.no_grad():
            raw_ce = float(F.cross_entropy(client.model(x), y))
        assert (float(client._terms["ce-loss"]) == pytest.approx(raw_ce, rel=1e-5)) \
            == (ce_view == "raw")


def test_the_views_setting_offers_the_views_the_module_builds():
    # The card (strategies/fedclassavg/__init__.py) names them without torch; maths.py builds them.
    assert tuple(fca.VIEWS) == settings_keys(FedClassAvgSettings)["views"].metadata["choices"]


def test_mild_views_never_flip():
    mild = fca.VIEWS["mild"]
    assert mild.crop_scale == (0.8, 1.0) and mild.flip_p == 0 and mild.jitter_p == 0
    x = torch.zeros(64, 1, 28, 28)
    x[:, :, :, :4] = 1.0  # a bar on the left edge: a flip would move it to the right
    view = mild(x, gen(1))
    assert view[:, :, :, -4:].max() < 0.5  # never flipped to the right edge


def _fit(diagnose):
    """One round of client 0 from the same start; its trained model and fit metrics."""
    client = _client(**{"fedclassavg.diagnose": diagnose})
    head = to_ndarrays(_own_head(client))
    _, _, metrics = client.fit(head, {"server-round": 1})
    return client.model.state_dict(), metrics


def test_terms_add_up_to_the_loss_and_diagnostics_leave_training_unchanged():
    plain, metrics = _fit(False)
    diagnosed, diag_metrics = _fit(True)
    for key in plain:  # the extra backward passes change nothing the optimiser sees
        torch.testing.assert_close(plain[key], diagnosed[key], rtol=0, atol=0)
    terms = {k: v for k, v in metrics.items() if k.startswith("term-")}
    assert set(terms) == {"term-supcon-loss", "term-ce-loss", "term-proximal-loss"}
    assert sum(terms.values()) == pytest.approx(metrics["train-loss"], rel=1e-5)
    grads = {k for k in diag_metrics if "-grad-" in k}
    # SupCon reaches only the extractor, the proximal term only the classifier.
    assert grads == {"term-supcon-grad-extractor", "term-ce-grad-extractor",
                     "term-ce-grad-classifier", "term-proximal-grad-classifier"}
    assert all(diag_metrics[k] >= 0 and math.isfinite(diag_metrics[k]) for k in grads)


def test_ncm_accuracy_is_the_nearest_normalised_class_mean():
    client = _client(**{"fedclassavg.diagnose": True})
    x, y = client.data.test_x, client.data.test_y
    got = client.evaluation_variants(x, y)["ncm"]
    with torch.no_grad():  # the rule written out with numpy
        extractor = fca._pre_relu_extractor(client.model.extractor).eval()
        f_train = F.normalize(extractor(client.data.train_x), dim=1).cpu().numpy()
        f_test = F.normalize(extractor(x), dim=1).cpu().numpy()
    train_y = client.data.train_y.cpu().numpy()
    classes = np.unique(train_y)
    means = np.stack([f_train[train_y == c].mean(0) for c in classes])
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    predicted = classes[np.argmax(f_test @ means.T, axis=1)]
    assert got == pytest.approx(float(np.mean(predicted == y.cpu().numpy())))
    assert _client().evaluation_variants(x, y) == {}  # off by default


def test_code_skips_the_proximal_term_on_each_epochs_first_batch():
    client = _client(**{"fedclassavg.contrastive": False, "fedclassavg.views": "none",
                        "fedclassavg.proximal-skip-first-batch": True, "batch-size": 20})
    client.receive(_own_head(client), 1)
    with torch.no_grad():
        client.model.head.bias.add_(1.0)
    x, y = client.data.train_x[:20], client.data.train_y[:20]
    _, ce, prox = _terms(client, x, y)
    losses = [float(client.loss(x, y)) for _ in range(3)]  # 40 samples: 2 batches an epoch
    assert losses == pytest.approx([ce, ce + prox, ce], rel=1e-5)


def test_supcon_reads_the_features_before_the_classifiers_relu():
    client = _client()
    x = client.data.train_x[:8]
    pre = fca._pre_relu_extractor(client.model.extractor)(x)
    assert (pre < 0).any()  # really before the ReLU
    torch.testing.assert_close(F.relu(pre), client.model.features(x))
    torch.testing.assert_close(client.model.head(F.relu(pre)), client.model(x))


def test_adam_uses_the_reference_betas_from_the_recipe():
    opt = _client().optimizer()
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["betas"] == (0.5, 0.999)


def test_warm_up_trains_once_before_the_first_round(monkeypatch):
    client = _client(**{"fedclassavg.warmup": True})
    calls = []
    monkeypatch.setattr(fca, "train_recipe", lambda *a, **k: calls.append(k["epochs"]))
    client.receive(_own_head(client), 1)
    assert calls == [1]
    client.save_state(1)  # as fit does; the client has trained from now on
    client.receive(_own_head(client), 2)
    assert calls == [1]


@pytest.mark.parametrize("key,value", [("fedclassavg.proximal-form", "l1"),
                                       ("fedclassavg.temperature", 0.0),
                                       ("fedclassavg.rho", -0.1),
                                       ("fedclassavg.supcon-features", "logits")])
def test_bad_settings_are_refused_with_the_key_named(key, value):
    with pytest.raises(ConfigError, match=key):
        cfg_of(method="fedclassavg", **{key: value})


def test_adam_betas_must_be_below_one():
    with pytest.raises(ConfigError, match="adam-beta1"):
        load_config({"method": "fedclassavg", "optimizer": "adam", "adam-beta1": 1.0})


# -- augmentations --------------------------------------------------------------------------------

def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_augmentations_keep_shape_and_follow_the_seed():
    x = torch.randn(6, 3, 32, 32)
    a = ViewAugment()(x, gen(0))
    torch.manual_seed(123)  # the global generator plays no part
    b = ViewAugment()(x, gen(0))
    g = gen(0)
    ViewAugment()(x, g)
    c = ViewAugment()(x, g)
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.allclose(a[0], a[1]) and torch.isfinite(a).all()


def test_crop_with_full_scale_is_the_identity_and_flip_flips():
    x = torch.randn(4, 1, 28, 28)
    full = dict(scale=(1.0, 1.0), ratio=(1.0, 1.0))
    torch.testing.assert_close(resized_crop_flip(x, gen(), **full, flip_p=0.0), x)
    torch.testing.assert_close(resized_crop_flip(x, gen(), **full, flip_p=1.0), x.flip(-1))


def test_small_crops_zoom_in():
    # A crop of 1/4 of the area of a ramp image spans half its range of values.
    ramp = torch.linspace(0, 1, 32).repeat(32, 1)[None, None].repeat(8, 1, 1, 1)
    out = resized_crop_flip(ramp, gen(), scale=(0.25, 0.25), ratio=(1.0, 1.0), flip_p=0.0)
    spans = out.amax(dim=(1, 2, 3)) - out.amin(dim=(1, 2, 3))
    torch.testing.assert_close(spans, torch.full((8,), 0.5), atol=0.05, rtol=0)


def test_colour_jitter_bounds_and_grayscale_only_touches_colour():
    x = torch.randn(5, 3, 8, 8)
    for strength, p in (((0.0, 0.0, 0.0), 1.0), ((0.4, 0.4, 0.4), 0.0)):
        torch.testing.assert_close(color_jitter(x, gen(), strength, p=p, grayscale_p=0.0), x)
    gray = color_jitter(x, gen(), (0.0, 0.0, 0.0), p=0.0, grayscale_p=1.0)
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])
    one_channel = torch.randn(5, 1, 8, 8)
    view = ViewAugment(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0.0)(one_channel,
                                                                               gen(1))
    torch.testing.assert_close(view, one_channel)  # no jitter for grayscale data


# -- the paper's backbones ------------------------------------------------------------------

@pytest.mark.slow
def test_paper_backbones_preset_trains_one_round_on_a_tiny_subset():
    flat, _ = resolve_settings("conf/fedclassavg-paper-backbones.toml", [
        'dataset="synthetic"', "synthetic-train=64", "synthetic-test=16", "num-clients=4",
        'partition="iid"', "batch-size=8"])
    cfg = load_config(flat)
    assert cfg.feature_dim == 512
    for pid in range(4):
        ctx = Context(run_id=12, node_id=pid,
                      node_config={"partition-id": pid, "num-partitions": 4},
                      state=RecordDict(), run_config={})
        client = METHODS["fedclassavg"].client(ctx, cfg)
        arrays, n, metrics = client.fit([], {"server-round": 1})
        assert {k: v.shape for k, v in from_ndarrays(arrays).items()} == CLASSIFIER
        assert math.isfinite(metrics["train-loss"]), client.arch
