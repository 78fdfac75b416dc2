"""Fast tests of the client model zoo (client_models/); the file runs in well under a minute."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from client_models import (
    ARCHITECTURES,
    HeteroModel,
    ModelConfigError,
    assign_architectures,
    build_model,
    parse_arch_mix,
)
from client_models.base import probe_output_shape
from client_models.paper_cnns import FEDGH_CNNS, KerasSameAvgPool2x2

torch.set_num_threads(2)

NUM_CLASSES = 10
SHAPES = [(1, 28, 28), (3, 32, 32)]
TORCHVISION = {"tv-resnet18", "tv-shufflenetv2", "tv-googlenet"}
NON_TORCHVISION = [a for a in ARCHITECTURES if a not in TORCHVISION]


# ----------------------------------------------------------------------------------------
# Shapes and the extractor/head split
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature_dim", [None, 64])
@pytest.mark.parametrize("input_shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_forward_and_feature_shapes(arch, input_shape, feature_dim):
    # Full-width ResNets and FedHe CNNs cost up to ~0.5 GFLOP per 32x32 image, the bulk of this
    # file's time on a busy 2-core machine.  Their layer geometry does not depend on width, so
    # every family that scales runs at half width here (default widths are covered by the
    # parameter-count and native-dim tests); torchvision backbones only exist at width 1.
    width = 1.0 if arch in TORCHVISION else 0.5
    model = build_model(arch, input_shape, NUM_CLASSES, feature_dim=feature_dim, width=width)
    model.eval()
    assert isinstance(model, HeteroModel) and model.arch == arch
    if feature_dim is not None:
        assert model.feature_dim == feature_dim
    x = torch.randn(2, *input_shape)
    with torch.no_grad():
        z = model.features(x)
        logits = model(x)
    assert z.shape == (2, model.feature_dim)
    assert logits.shape == (2, NUM_CLASSES)
    # Representations are post-activation in every family (like FedGH's post-ReLU fc2).
    assert (z >= 0).all()
    torch.testing.assert_close(logits, model.head(z))


def test_native_feature_dims():
    """feature_dim=None gives each family's own representation size (1x28x28 input)."""
    expected = {
        "cnn1": 500,  # FedGH fc2
        "fedhe-cnn0": 13 * 13 * 256,  # flatten after conv2 3x3 stride 2 'valid': 28 -> 13
        "fedhe-cnn9": 3 * 3 * 192,  # 28 -> 14 (conv2) -> 7 (pool) -> 3 (conv3)
        "resnet10": 512,
        "tv-resnet18": 512,
        "tv-shufflenetv2": 1024,
        "tv-googlenet": 1024,
        "alexnet-small": 512,
    }
    for arch, d in expected.items():
        assert build_model(arch, (1, 28, 28), NUM_CLASSES).feature_dim == d, arch
    assert build_model("resnet10", (1, 28, 28), NUM_CLASSES, width=0.25).feature_dim == 128


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_head_and_extractor_state_partition_the_state_dict(arch):
    width = 1.0 if arch in TORCHVISION else 0.25  # the split does not depend on width
    model = build_model(arch, (1, 28, 28), NUM_CLASSES, feature_dim=32, width=width)
    head = model.head_state()
    extractor = model.extractor_state()
    assert set(head) == {"head.weight", "head.bias"}
    assert head["head.weight"].shape == (NUM_CLASSES, 32)
    assert head["head.bias"].shape == (NUM_CLASSES,)
    assert set(head) | set(extractor) == set(model.state_dict())
    assert not set(head) & set(extractor)
    assert not any(t.requires_grad for t in [*head.values(), *extractor.values()])


def test_states_are_snapshots_and_load_back():
    model = build_model("cnn5", (1, 28, 28), NUM_CLASSES)
    head = model.head_state()
    with torch.no_grad():
        model.head.weight.add_(1.0)
    assert not torch.equal(head["head.weight"], model.head.weight)  # a copy, not a view
    model.load_state_dict(head, strict=False)
    torch.testing.assert_close(model.head.weight.detach(), head["head.weight"])


def test_init_is_reproducible_from_the_global_seed():
    torch.manual_seed(0)
    a = build_model("fedhe-cnn5", (1, 28, 28), NUM_CLASSES, width=0.25).state_dict()
    torch.manual_seed(0)
    b = build_model("fedhe-cnn5", (1, 28, 28), NUM_CLASSES, width=0.25).state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key])


def test_building_does_not_touch_batchnorm_statistics():
    # The output-size probe runs a zero batch; it must not leak into running statistics.
    model = build_model("fedhe-cnn9", (1, 28, 28), NUM_CLASSES)
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert torch.equal(bn.running_var, torch.ones_like(bn.running_var))
        assert bn.num_batches_tracked.item() == 0
    assert model.training


def test_the_output_probe_runs_where_the_weights_are():
    # A stem already on a GPU (FedGKT's client sizing the server model it evaluates) must be
    # probed there; the meta device stands in for a GPU on a CPU-only machine: a CPU probe
    # into meta weights fails as a GPU's does, and was reported as "too small".
    stem = nn.Sequential(nn.Conv2d(1, 4, 5), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    on_cpu = probe_output_shape(stem, (1, 28, 28), "stem")
    assert tuple(probe_output_shape(stem.to("meta"), (1, 28, 28), "stem")) == tuple(on_cpu) \
        == (4, 12, 12)
    with pytest.raises(ModelConfigError, match="too small"):
        probe_output_shape(stem, (1, 4, 4), "stem")


@pytest.mark.parametrize("arch", ["cnn1", "fedhe-cnn0", "fedhe-cnn7", "resnet10", "alexnet-small"])
def test_non_square_inputs(arch):
    model = build_model(arch, (1, 28, 40), NUM_CLASSES, width=0.25).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 28, 40)).shape == (2, NUM_CLASSES)


# ----------------------------------------------------------------------------------------
# Layer sizes against the papers
# ----------------------------------------------------------------------------------------


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _fedgh_params_by_hand(conv2: int, fc1: int, in_channels=3, flatten_side=5, d=500, c=10) -> int:
    """Parameters of FedGH CNN-k counted from Table 2 (weights + biases of each layer)."""
    conv1 = 16
    return (
        (in_channels * 25 + 1) * conv1  # conv1 5x5
        + (conv1 * 25 + 1) * conv2  # conv2 5x5
        + (conv2 * flatten_side**2 + 1) * fc1  # fc1; 32x32 input -> 5x5 maps after two conv+pool
        + (fc1 + 1) * d  # fc2 = representation
        + (d + 1) * c  # fc3 = header
    )


@pytest.mark.parametrize("arch", list(FEDGH_CNNS))
def test_fedgh_cnn_parameter_counts_match_table2(arch):
    """FedGH Table 2 "model size" = float32 parameters in MiB (3x32x32 input, C = 10).

    CNN-1 by hand: 1,216 + 12,832 + 1,602,000 + 1,000,500 + 5,010 = 2,621,558 parameters
    = 10,486,232 bytes = 10.0006 MiB, the paper's 10.00 MB; CNN-2/3/5 likewise give
    6.924 / 5.038 / 2.556 MiB against 6.92 / 5.04 / 2.55.  CNN-4 is the exception: its printed
    3.81 MB implies ~998.8k parameters, but Table 2's layers (fc1 = 800, same as the official
    code) give 1,060,358 = 4.045 MiB, 6.2% more -- the paper's number is inconsistent with its
    own table, so for CNN-4 the test pins the layer sizes and the known gap instead.
    """
    spec = FEDGH_CNNS[arch]
    model = build_model(arch, (3, 32, 32), NUM_CLASSES)
    n = _num_params(model)
    assert n == _fedgh_params_by_hand(spec.conv2_channels, spec.fc1_units)
    size_mib = n * 4 / 2**20
    relative_gap = size_mib / spec.paper_size_mb - 1
    if arch == "cnn4":
        assert n == 1_060_358
        assert relative_gap == pytest.approx(0.0617, abs=0.001)
    else:
        assert abs(relative_gap) < 0.003  # the printed sizes are rounded to 0.01 MB
    if arch == "cnn1":
        assert n == 2_621_558  # the sum by hand above


def test_fedgh_cnn_flatten_follows_input_size():
    # FedGH's CNNs (Yi et al., ACM MM 2023, Table 2): 28x28 inputs give
    # conv2_channels * 4 * 4 = 512 features into fc1.
    model = build_model("cnn1", (1, 28, 28), NUM_CLASSES)
    fc1 = next(m for m in model.extractor.modules() if isinstance(m, nn.Linear))
    assert fc1.in_features == 32 * 4 * 4
    assert _num_params(model) == _fedgh_params_by_hand(32, 2000, in_channels=1, flatten_side=4)


def test_fedhe_model9_matches_official_layer_sizes():
    """FedHe model 9 on MNIST, counted the Keras way (BN moving mean/var included, no head bias).

    conv1 1,280 + BN 512 + conv2 (2x2) 65,664 + BN 512 + conv3 (3x3, 192) 221,376 + BN 768
    + dense 3*3*192*10 = 17,280 gives 307,392.  The paper reports 324,672 = 307,392 + 17,280,
    i.e. exactly one more 1728x10 matrix, which we cannot attribute to any layer; the filter
    counts 128/128/192 (not Table II's 198) are the only ones consistent with that figure.
    """
    model = build_model("fedhe-cnn9", (1, 28, 28), NUM_CLASSES)
    bn_stats = sum(
        m.running_mean.numel() + m.running_var.numel()
        for m in model.modules()
        if isinstance(m, nn.BatchNorm2d)
    )
    keras_count = _num_params(model) + bn_stats - model.head.bias.numel()
    assert keras_count == 307_392
    assert 324_672 - keras_count == 3 * 3 * 192 * 10


def test_width_scales_filters():
    fedhe = build_model("fedhe-cnn0", (1, 28, 28), NUM_CLASSES, width=0.25)
    convs = [m for m in fedhe.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32, 64]
    fedgh = build_model("cnn1", (1, 28, 28), NUM_CLASSES, width=0.5)
    linears = [m for m in fedgh.extractor.modules() if isinstance(m, nn.Linear)]
    assert [lin.out_features for lin in linears] == [1000, 500]  # fc1 scaled, fc2 = d kept
    tiny = build_model("fedhe-cnn8", (1, 28, 28), NUM_CLASSES, width=0.001)
    assert all(m.out_channels == 1 for m in tiny.modules() if isinstance(m, nn.Conv2d))


def test_keras_same_average_pooling():
    # TF pads the bottom/right edge and averages only real pixels there.
    x = torch.randn(2, 3, 5, 7)
    padded = F.pad(x, (0, 1, 0, 1))
    counts = F.avg_pool2d(F.pad(torch.ones(1, 1, 5, 7), (0, 1, 0, 1)), 2, 1)
    expected = F.avg_pool2d(padded, 2, 1) / counts
    torch.testing.assert_close(KerasSameAvgPool2x2()(x), expected)


# ----------------------------------------------------------------------------------------
# Training works
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", NON_TORCHVISION)
def test_backward_reaches_first_conv(arch):
    model = build_model(arch, (1, 28, 28), NUM_CLASSES, feature_dim=16, width=0.25).train()
    loss = F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    grad = first_conv.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert model.head.weight.grad is not None


# ----------------------------------------------------------------------------------------
# Configuration errors
# ----------------------------------------------------------------------------------------


def test_build_model_rejects_unknown_architecture():
    with pytest.raises(ModelConfigError, match="unknown architecture 'cnn6'.*cnn1.*resnet10"):
        build_model("cnn6", (1, 28, 28), NUM_CLASSES)


@pytest.mark.parametrize(
    ("arch", "shape", "smallest"),
    [("cnn1", (1, 8, 8), 16), ("fedhe-cnn9", (1, 8, 8), 12), ("fedhe-cnn0", (3, 2, 2), 3)],
)
def test_build_model_rejects_too_small_input(arch, shape, smallest):
    with pytest.raises(ModelConfigError, match=f"too small for '{arch}'.*{smallest}x{smallest}"):
        build_model(arch, shape, NUM_CLASSES)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_shape": (28, 28)},
        {"input_shape": (1, 0, 28)},
        {"num_classes": 0},
        {"feature_dim": -3},
        {"width": 0.0},
        {"width": float("nan")},
    ],
)
def test_build_model_rejects_bad_arguments(kwargs):
    args = {"arch": "cnn5", "input_shape": (1, 28, 28), "num_classes": NUM_CLASSES} | kwargs
    with pytest.raises(ModelConfigError, match="not allowed"):
        build_model(**args)


@pytest.mark.parametrize("arch", sorted(TORCHVISION))
def test_torchvision_backbones_reject_width(arch):
    with pytest.raises(ModelConfigError, match="width=0.5 is not allowed"):
        build_model(arch, (1, 28, 28), NUM_CLASSES, width=0.5)


def test_parse_arch_mix():
    assert parse_arch_mix("cnn1,cnn2, cnn3") == ["cnn1", "cnn2", "cnn3"]
    assert parse_arch_mix(" resnet10 ,resnet10") == ["resnet10", "resnet10"]


@pytest.mark.parametrize("text", ["", "   ", "cnn1,,cnn2", "cnn1,cnn7"])
def test_parse_arch_mix_errors_list_valid_names(text):
    with pytest.raises(ModelConfigError) as error:
        parse_arch_mix(text)
    assert all(name in str(error.value) for name in ARCHITECTURES)


# ----------------------------------------------------------------------------------------
# Assigning architectures to clients
# ----------------------------------------------------------------------------------------

MIX = ["cnn1", "cnn2", "cnn3"]


def test_assign_round_robin():
    assert assign_architectures(MIX, 7) == ["cnn1", "cnn2", "cnn3", "cnn1", "cnn2", "cnn3", "cnn1"]
    assert assign_architectures(MIX, 7, mode="round-robin") == assign_architectures(MIX, 7)


def test_assign_blocks():
    assert assign_architectures(MIX, 6, mode="blocks") == ["cnn1"] * 2 + ["cnn2"] * 2 + ["cnn3"] * 2
    # 7 = 3 + 2 + 2: the first groups take the remainder.
    assert assign_architectures(MIX, 7, mode="blocks") == ["cnn1"] * 3 + ["cnn2"] * 2 + ["cnn3"] * 2
    assert assign_architectures(MIX, 2, mode="blocks") == ["cnn1", "cnn2"]


def test_assign_random_is_seeded_and_balanced():
    a = assign_architectures(MIX, 20, mode="random", seed=1)
    assert a == assign_architectures(MIX, 20, mode="random", seed=1)
    assert Counter(a) == Counter(assign_architectures(MIX, 20))  # same counts as round-robin
    draws = {tuple(assign_architectures(MIX, 20, mode="random", seed=s)) for s in range(5)}
    assert len(draws) > 1  # the seed matters


def test_assign_errors():
    with pytest.raises(ModelConfigError, match="unknown assignment mode 'shuffle'.*round-robin"):
        assign_architectures(MIX, 4, mode="shuffle")
    with pytest.raises(ModelConfigError, match="unknown architecture"):
        assign_architectures(["cnn1", "vgg"], 4)
    with pytest.raises(ModelConfigError, match="empty"):
        assign_architectures([], 4)
    with pytest.raises(ModelConfigError, match="num_clients"):
        assign_architectures(MIX, 0)


# HtFLlib's HCNNs8 models as its BaseHeadSplit builds them (base with fc replaced by an
# identity pooling, head Linear(512, 10)), parameters counted with HtFLlib's own code
# (TsingZ0/HtFLlib, system/flcore/trainmodel/models.py `CNN`, commit e959261) on 1x28x28.
HTFLLIB_HCNNS8_PARAMETERS = {
    "htfllib-cnn-c1": 2_365_770,
    "htfllib-cnn-c2": 582_026,
    "htfllib-cnn-c1-512": 2_628_426,
    "htfllib-cnn-c2-512": 844_682,
    "htfllib-cnn-c1-1024": 5_250_378,
    "htfllib-cnn-c2-1024": 1_631_626,
    "htfllib-cnn-c1-1024-512": 5_513_034,
    "htfllib-cnn-c2-1024-512": 1_894_282,
}


def test_htfllib_cnns_have_the_peers_parameter_counts_and_layers():
    from client_models.htfllib_cnns import HTFLLIB_CNNS
    assert list(HTFLLIB_CNNS) == list(HTFLLIB_HCNNS8_PARAMETERS)  # HCNNs8's order
    for arch, count in HTFLLIB_HCNNS8_PARAMETERS.items():
        model = build_model(arch, (1, 28, 28), NUM_CLASSES)
        assert _num_params(model) == count, arch
        assert model.feature_dim == 512 and model.head.in_features == 512
        # Extractor + head split as HtFLlib's: the head is only the last Linear(512, C).
        assert _num_params(model.head) == 512 * NUM_CLASSES + NUM_CLASSES
    # feature-dim sets the last Linear's size, as HtFLlib's feature_dim does.
    assert build_model("htfllib-cnn-c2", (1, 28, 28), NUM_CLASSES, feature_dim=64).head \
        .in_features == 64
