"""Run settings: defaults agree everywhere, bad values are refused with a useful message, and
the command line lists and refuses them without importing what a run needs."""

import dataclasses
import json
import subprocess
import sys

import pytest

from fedapp.config import (CONF_DIR, PROJECT_ROOT, SHARED_KEYS, ConfigError, RunConfig,
                           parse_override, parse_run_config, pyproject_defaults, read_preset)
from fedapp.runtime.client_base import FedClient
from fedapp.runtime.strategy_base import FedStrategy
from strategies import METHODS, load_config, method_keys


def test_pyproject_lists_every_setting_with_the_code_default():
    defaults = pyproject_defaults()
    declared = {**SHARED_KEYS, **method_keys()}
    assert set(defaults) == set(declared)  # nothing missing, nothing stale
    for key, f in declared.items():
        assert defaults[key] == f.default, key


def test_every_preset_is_valid():
    presets = sorted(CONF_DIR.glob("*.toml"))
    assert presets
    for path in presets:
        load_config({**pyproject_defaults(), **read_preset(path)})


def test_bad_method_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config({**pyproject_defaults(), "method": "nope"})
    assert "'nope'" in str(err.value)
    for name in METHODS:
        assert name in str(err.value)


@pytest.mark.parametrize("key,value,words", [
    ("num-server-rounds", 0, ["num-server-rounds", "0", ">= 1"]),
    ("fraction-fit", 0.0, ["fraction-fit", "> 0.0"]),
    ("partition", "random", ["partition", "'dirichlet'", "'two-class'"]),
    ("lr", "fast", ["lr", "a number"]),
    ("eval-global-test", 1, ["eval-global-test", "true or false"]),
    ("output-dir", "relative/path", ["output-dir", "absolute"]),
    ("synthetic-shape", "28,28", ["synthetic-shape", "C,H,W"]),
])
def test_bad_values_name_key_value_and_what_is_allowed(key, value, words):
    with pytest.raises(ConfigError) as err:
        parse_run_config({key: value})
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("text,value", [("0.5", "0.5"), ("1", "1"), ('"0.25"', "0.25")])
def test_a_number_given_for_text_is_that_text(text, value):
    # `--set heterofl.rates=0.5`: TOML reads a number; the setting is a string (a rate, a
    # level list), so the number stands for what was written. A boolean is still refused.
    key, parsed = parse_override(f"heterofl.rates={text}")
    cfg = load_config({"method": "heterofl", key: parsed})
    assert cfg.settings.rates == value
    with pytest.raises(ConfigError, match="heterofl.rates = True is invalid"):
        load_config({"method": "heterofl", "heterofl.rates": True})


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="did you mean num-server-rounds"):
        parse_run_config({"num-server-round": 3})


def test_fedavg_refuses_a_heterogeneous_mix_and_accepts_a_homogeneous_one():
    with pytest.raises(ConfigError, match="same architecture"):
        load_config({"method": "fedavg", "arch-mix": "cnn1,cnn2"})
    assert load_config({"method": "fedavg", "arch-mix": "cnn2"}).method == "fedavg"


def test_shared_head_needs_a_shared_dimension():
    with pytest.raises(ConfigError, match="feature-dim"):
        load_config({"method": "lg-fedavg", "feature-dim": 0, "arch-mix": "cnn1,fedhe-cnn0"})


def test_unknown_architecture_is_refused_before_training():
    with pytest.raises(ConfigError, match="arch-mix"):
        load_config({"arch-mix": "cnn1,vgg99"})


def test_override_parsing():
    assert parse_override('method="fedavg"') == ("method", "fedavg")
    assert parse_override("method=fedavg") == ("method", "fedavg")
    assert parse_override("num-server-rounds=5") == ("num-server-rounds", 5)
    assert parse_override("lr=0.1") == ("lr", 0.1)
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")


def test_sweep_gives_every_combination_and_refuses_an_empty_one():
    from fedapp.cli.run import sweep_variants
    assert sweep_variants([]) == [[]]
    assert sweep_variants(["seed=0,1", "method=fedgh,standalone"]) == [
        [("seed", 0), ("method", "fedgh")], [("seed", 0), ("method", "standalone")],
        [("seed", 1), ("method", "fedgh")], [("seed", 1), ("method", "standalone")]]
    for bad in ("seed", "seed="):
        with pytest.raises(ConfigError, match="--sweep"):
            sweep_variants([bad])


def test_config_is_hashable_for_per_process_caches():
    cfg = RunConfig()
    assert hash(cfg) == hash(dataclasses.replace(cfg))


def test_config_choices_match_what_the_data_layer_offers():
    from fedapp.data.datasets import DATASETS
    from fedapp.data.files import FILE_DATASETS
    from fedapp.data.partitions import FILES_SCHEME, LOCAL_TEST_MODES, SCHEMES
    assert SHARED_KEYS["dataset"].metadata["choices"] == DATASETS + FILE_DATASETS
    assert SHARED_KEYS["partition"].metadata["choices"] == SCHEMES + (FILES_SCHEME,)
    assert set(SHARED_KEYS["local-test"].metadata["choices"]) == set(LOCAL_TEST_MODES)


@pytest.mark.parametrize("overrides,words", [
    ({"partition": "pathological", "classes-per-client": 20}, ["classes-per-client", "20"]),
    ({"synthetic-shape": "1,4,4"}, ["cnn3", "too small"]),
])
def test_settings_that_only_fail_with_the_data_are_refused_before_training(overrides, words):
    from fedapp.data.setup import prepare
    flat = {"dataset": "synthetic", "num-clients": 3, "arch-mix": "cnn3", **overrides}
    with pytest.raises(ConfigError) as err:
        prepare(load_config(flat))
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("method,overrides,model", [
    ("heterofl", {}, "heterofl-conv"), ("fjord", {}, "heterofl-conv"),
    ("fedrolex", {}, "heterofl-conv"), ("depthfl", {"depthfl.model": "cnn4"}, "cnn4"),
])
def test_an_input_too_small_for_a_methods_own_model_is_refused_before_training(
        method, overrides, model):
    # The clients' architectures (resnet10) take a 6x6 input; the global model the method
    # slices does not, which the server would find only when it builds it.
    from fedapp.data.setup import prepare
    flat = {"method": method, "dataset": "synthetic", "synthetic-shape": "1,6,6",
            "num-clients": 5, "arch-mix": "resnet10", **overrides}
    with pytest.raises(ConfigError, match=f"method '{method}' cannot run on synthetic "
                                          rf"\(1, 6, 6\).*too small for '{model}.*the "
                                          "smallest square input that works is 8x8"):
        prepare(load_config(flat))


def test_a_preset_extends_another_and_a_loop_is_refused(tmp_path, monkeypatch):
    from fedapp import config
    monkeypatch.setattr(config, "CONF_DIR", tmp_path)
    (tmp_path / "base.toml").write_text('method = "fedhe"\nseed = 3\n[fedhe]\nalpha = 0.5\n')
    (tmp_path / "child.toml").write_text('extends = "base"\nseed = 4\n')
    assert config.read_preset(tmp_path / "child.toml") == {
        "method": "fedhe", "seed": 4, "fedhe.alpha": 0.5}
    (tmp_path / "base.toml").write_text('extends = "child"\n')
    with pytest.raises(config.ConfigError, match="extends it again"):
        config.read_preset(tmp_path / "child.toml")


def test_every_method_names_its_strategy_and_client_in_its_folders_maths():
    # The registry imports them by name on first use: a misspelt name would fail only then.
    for name, method in METHODS.items():
        assert issubclass(method.strategy, FedStrategy), name
        assert issubclass(method.client, FedClient), name
        maths = f"strategies.{name.replace('-', '_')}.maths"
        assert method.strategy.__module__ == method.client.__module__ == maths, name


# `fedapp methods`, `fedapp settings` and a refused setting run nothing, so they import none of
# what a run needs: they answer in about a second (docs/benchmarks.md). Each command runs in a
# fresh interpreter, which then prints its exit status and every module it imported.
RUN_ONLY = ("torch", "datasets", "flwr", "ray", "matplotlib")
PROBE = ("import json, sys\n"
         "from fedapp.cli.main import main\n"
         "code = main(sys.argv[1:])\n"
         "print(json.dumps([code, sorted(sys.modules)]))")


@pytest.mark.parametrize("argv,code", [
    (["methods"], 0),
    (["settings"], 0),
    (["settings", "smoke", "--set", 'method="fml"'], 0),
    (["run", "--set", "lr=-1"], 2),
    (["run", "--set", 'method="nope"'], 2),
    (["run", "--set", "fedgh.nope=1"], 2),
])
def test_listing_and_refusing_settings_imports_no_torch_and_no_flower(argv, code):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    status, modules = json.loads(proc.stdout.splitlines()[-1])
    assert status == code, proc.stderr
    imported = sorted({m.split(".")[0] for m in modules} & set(RUN_ONLY))
    assert not imported, f"fedapp {' '.join(argv)} imports {imported}"
