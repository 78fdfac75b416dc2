"""The cross-checks' own plumbing (reproduce/crosscheck_files.py, crosscheck_fedmd.py,
crosscheck_heterofl.py): what they hand to a peer must be what our runs use."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
import crosscheck_fedmd  # noqa: E402
import crosscheck_heterofl  # noqa: E402
from crosscheck_files import export_federation, federation_settings, source_config  # noqa: E402

from client_models import build_model  # noqa: E402
from fedapp.data import setup  # noqa: E402
from fedapp.data.partitions import load_client_data  # noqa: E402
from tests.conftest import cfg_of  # noqa: E402

SOURCE = {"method": "fedmd", "dataset": "synthetic", "num-clients": 3, "seed": 4,
          "synthetic-train": 300, "synthetic-test": 90, "partition": "dirichlet",
          "dirichlet-alpha": 0.5, "public-source": "train-holdout", "public-fraction": 0.1,
          "fedmd.alignment-size": 10}


def test_a_run_on_the_exported_folder_sees_the_source_runs_tensors(tmp_path):
    source = source_config(None, SOURCE)
    config = export_federation(source, tmp_path, SOURCE)
    ours = source_config(None, {"method": "fedmd", "num-clients": 3, "fedmd.alignment-size": 10,
                                **federation_settings(tmp_path, public=True)})
    assert config["num_clients"] == 3 and config["public_size"] == len(setup.public_set(ours))
    for k in range(3):
        a = load_client_data(setup.dataset(source), setup.partition_spec(source), k)
        b = load_client_data(setup.dataset(ours), setup.partition_spec(ours), k)
        for name in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (k, name)
        assert config["sizes"][k] == {"train": len(a.train_y), "test": len(a.test_y)}
    assert torch.equal(setup.public_set(source).x, setup.public_set(ours).x)
    assert torch.equal(setup.public_set(source).y, setup.public_set(ours).y)


def test_fedmds_peer_builds_our_ten_cnns_at_the_same_widths():
    for arch, peer in zip(crosscheck_fedmd.ARCHS, crosscheck_fedmd.peer_models()):
        model = build_model(arch, (1, 28, 28), 10, width=crosscheck_fedmd.WIDTH)
        convs = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
        dropouts = {m.p for m in model.modules() if isinstance(m, nn.Dropout)}
        assert peer["model_type"] == f"{len(convs)}_layer_CNN"
        assert [peer["params"][f"n{i + 1}"] for i in range(len(convs))] == convs
        assert dropouts == {peer["params"]["dropout_rate"]}


def test_heterofls_initial_global_model_fits_the_baselines_conv_in_order():
    """The baseline's Conv at hidden_layers [16, 32, 64, 128]: per block a conv's weight and
    bias and a static BN's weight and bias (no buffers), then the Linear; its patch loads our
    arrays in this order."""
    cfg = cfg_of(method="heterofl", dataset="synthetic", num_clients=5, model_width=0.25)
    arrays = crosscheck_heterofl.initial_global(cfg)
    shapes, previous = [], 1
    for width in crosscheck_heterofl.HIDDEN:
        shapes += [(width, previous, 3, 3), (width,), (width,), (width,)]
        previous = width
    shapes += [(10, previous), (10,)]
    assert [a.shape for a in arrays] == shapes
    again = crosscheck_heterofl.initial_global(cfg)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, again))
    other = crosscheck_heterofl.initial_global(cfg_of(method="heterofl", dataset="synthetic",
                                                      num_clients=5, model_width=0.25, seed=1))
    assert not np.array_equal(arrays[0], other[0])
