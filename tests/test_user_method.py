"""A method of a user's own package, by import path (docs/usage.md, "Your own method"): a method
folder written into a temporary folder — its card and its maths, nothing in this repository —
is validated like ours, listed by ``fedapp methods`` when ``method-packages`` names its
package, and runs on the smoke preset with ``method = "<package>.<folder>"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedapp.config import ConfigError
from strategies import get_method, known_methods, load_config, settings_report
from tests.conftest import InProcessFederation

BIN = Path(sys.executable).parent
PACKAGE = "fedappusermethods"  # a name no installed package has (no "_": cfg_of dashes them)

# The card: settings, recipe and registration, no torch (as every card of strategies/).
CARD = '''"""Share: clients upload their head's bias times share.scale; the server averages it."""

from dataclasses import dataclass

from fedapp.config import opt
from strategies import Method


@dataclass(frozen=True)
class ShareSettings:
    scale: float = opt(1.0, "what the uploaded bias is multiplied by", low=0.0)


METHOD = Method("a user's method: head biases averaged", strategy_class="Share",
                client_class="ShareClient", settings=ShareSettings,
                recipe={"batch-size": 16})
'''

# The maths: a FedClient and a FedStrategy on the runtime's bases.
MATHS = '''"""Share's client and server."""

import numpy as np
import torch

from fedapp.runtime.client_base import FedClient
from fedapp.runtime.payload import ArraySpec
from fedapp.runtime.strategy_base import FedStrategy


class ShareClient(FedClient):
    def upload(self):
        bias = self.model.head.bias.detach().cpu().numpy()
        return {"bias": (bias * self.cfg.settings.scale).astype(np.float32)}


class Share(FedStrategy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mean_bias = None

    def upload_spec(self, client):
        return {"bias": ArraySpec((self.num_classes,), "float")}

    def aggregate(self, server_round, uploads):
        self.mean_bias = np.mean([u.payload["bias"] for u in uploads], axis=0)
'''


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A package of the user's own, with the method folder ``share``, importable here and by the
    processes Flower starts (PYTHONPATH, absolute)."""
    method = tmp_path / PACKAGE / "share"
    method.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text('"""A user\'s methods."""\n')
    (method / "__init__.py").write_text(CARD)
    (method / "maths.py").write_text(MATHS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")])))
    yield f"{PACKAGE}.share"
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


SYNTHETIC = {"dataset": "synthetic", "synthetic-train": 120, "synthetic-test": 60,
             "num-clients": 3, "partition": "iid", "max-samples-per-client": 0,
             "arch-mix": "cnn5"}


def test_a_method_by_import_path_is_validated_like_ours(user_package):
    cfg = load_config({**SYNTHETIC, "method": user_package, f"{user_package}.scale": 0.5})
    assert cfg.settings.scale == 0.5
    assert cfg.batch_size == 16  # its recipe, as a built-in method's
    with pytest.raises(ConfigError, match=rf"{user_package}\.scale = -1.*>= 0"):
        load_config({**SYNTHETIC, "method": user_package, f"{user_package}.scale": -1})
    with pytest.raises(ConfigError, match=rf"unknown setting.*{user_package}\.scael"):
        load_config({**SYNTHETIC, "method": user_package, f"{user_package}.scael": 1.0})
    # `fedapp settings` refuses it too.
    with pytest.raises(ConfigError, match=rf"{user_package}\.scale = -1"):
        settings_report({**SYNTHETIC, "method": user_package, f"{user_package}.scale": -1})


def test_a_method_by_import_path_trains_and_aggregates(user_package):
    fed = InProcessFederation(user_package, **{k.replace("-", "_"): v
                                               for k, v in SYNTHETIC.items()},
                              **{f"{user_package}.scale": 2.0})
    fed.fit_round(1)
    assert fed.strategy._counts == {"clients_fit": 3, "failures": 0, "rejected": 0}
    biases = [fed.client(pid).model.head.bias.detach().numpy() for pid in range(3)]
    np.testing.assert_allclose(fed.strategy.mean_bias, 2.0 * np.mean(biases, axis=0),
                               rtol=1e-6)


def test_settings_of_a_method_by_import_path_travel_packed(user_package):
    # Flower's run config takes only the app's own keys: `fedapp run` packs the others.
    from strategies import unpack_method_settings
    packed = unpack_method_settings({"method": user_package,
                                     "method-settings": json.dumps({f"{user_package}.scale": 3})})
    assert packed[f"{user_package}.scale"] == 3 and packed["method-settings"] == ""
    assert load_config({**SYNTHETIC, **packed}).settings.scale == 3
    with pytest.raises(ConfigError, match="method-settings = .* expected a JSON object"):
        unpack_method_settings({"method-settings": "[1]"})


def test_write_run_config_packs_what_the_app_does_not_know(user_package, tmp_path):
    import tomllib
    from fedapp.cli.run import write_run_config
    path = write_run_config({"seed": 3, "method": user_package, f"{user_package}.scale": 0.5},
                            tmp_path / "run.toml")
    written = tomllib.loads(path.read_text())
    assert written["seed"] == 3 and written["method"] == user_package
    assert json.loads(written["method-settings"]) == {f"{user_package}.scale": 0.5}


def test_unknown_methods_and_packages_are_refused_clearly(user_package):
    with pytest.raises(ConfigError, match="cannot import 'nosuchpkg.mymethod'.*PYTHONPATH"):
        get_method("nosuchpkg.mymethod")
    with pytest.raises(ConfigError, match=rf"'{user_package}.maths' is not a method folder"):
        get_method(f"{user_package}.maths")  # importable, but no METHOD card
    with pytest.raises(ConfigError, match="expected one of 'compfl'.*'mypkg.mymethod'"):
        get_method("nope")
    with pytest.raises(ConfigError, match="method-packages = 'nosuchpkg' is invalid"):
        known_methods({"method-packages": "nosuchpkg"})
    assert f"{user_package}" in known_methods({"method-packages": PACKAGE})


def test_fedapp_methods_lists_a_package_named_in_a_setting(user_package):
    plain = subprocess.run([str(BIN / "fedapp"), "methods"], capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 0 and user_package not in plain.stdout
    listed = subprocess.run([str(BIN / "fedapp"), "methods", "--set",
                             f'method-packages="{PACKAGE}"'], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert f"{user_package} " in listed.stdout and "head biases averaged" in listed.stdout


@pytest.mark.slow
def test_fedapp_run_runs_a_method_by_import_path_on_the_smoke_preset(user_package, tmp_path):
    proc = subprocess.run([str(BIN / "fedapp"), "run", "smoke", "--set",
                           f'method="{user_package}"', "--set", f"{user_package}.scale=0.5",
                           "--set", 'run-name="share"', "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "out" / "share"
    settings = json.loads((run / "config.json").read_text())["settings"]
    assert settings["method"] == user_package and settings[f"{user_package}.scale"] == 0.5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["method"] == user_package and summary["rounds"] == 2
    assert summary["communication"]["per_client_per_round_up"] > 0  # the biases went up
