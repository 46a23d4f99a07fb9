"""Settings declared once on the config fields: flags, environment variables and docs/configuration.md."""

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from drafter_service.cli.client_flags import CLIENT_SETTINGS
from drafter_service.cli.main import build_parser
from drafter_service.cli.serve import GROUP_ORDER, config_from_args, serve_settings
from drafter_service.core.config import CardSettings, DrafterConfig, DraftModelSpec
from drafter_service.core.settings import add_settings, setting, settings_of, values_from_args
from drafter_service.service.config import NamespaceSpec, ServiceConfig

ROOT = Path(__file__).resolve().parents[3]
ALL = serve_settings() + CLIENT_SETTINGS


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No DRAFTER_* variable of a setting leaks in from the environment the tests run in."""
    for s in ALL:
        monkeypatch.delenv(s.env, raising=False)


def _script():
    spec = importlib.util.spec_from_file_location("build_settings_doc", ROOT / "scripts" / "build_settings_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_docs_configuration_md_is_what_the_script_generates():
    script = _script()
    page = ROOT / "docs" / "configuration.md"
    committed = page.read_text() if page.exists() else ""
    assert committed == script.render(), f"docs/configuration.md is stale: run {script.COMMAND}"
    for s in ALL:
        assert f"| `{s.flag}` | `{s.env}` |" in committed


def test_every_config_field_is_a_setting_with_a_flag_and_an_environment_variable():
    declared = {s.name for s in serve_settings()}
    service = {f"ServiceConfig.{f.name}" for f in dataclasses.fields(ServiceConfig)}
    assert service - declared == {"ServiceConfig.drafter"}  # the nested core; its own fields are settings
    core = {s.field for s in settings_of(DrafterConfig)}
    assert core == {"capacity", "max_nodes", "leader_capacity", "follower_capacity", "batch_threads"}
    assert {s.field for s in settings_of(DraftModelSpec)} == {"device", "dtype", "threads"}
    assert {s.field for s in settings_of(CardSettings)} == {f.name for f in dataclasses.fields(CardSettings)} - {
        "max_nodes"}
    for s in ALL:
        assert s.flag.startswith("--") and s.help and s.group and s.name and s.kind in (int, float, str), s
        assert s.env == "DRAFTER_" + s.flag[2:].replace("-", "_").upper(), s
    assert len({s.flag for s in ALL}) == len({s.env for s in ALL}) == len(ALL)
    assert {s.group for s in serve_settings()} == set(GROUP_ORDER)
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    assert {o for a in serve._actions for o in a.option_strings} - {"-h", "--help"} == {s.flag for s in
                                                                                       serve_settings()}


def test_the_flag_defaults_are_the_field_defaults():
    assert config_from_args(_serve()) == ServiceConfig()
    assert config_from_args(_serve("--draft-model", "m")).draft_models == (DraftModelSpec("default", "m"),)


def test_an_environment_variable_sets_the_default_of_its_flag(monkeypatch):
    samples = {int: "7", float: "0.25", str: "some-text"}
    for s in ALL:
        monkeypatch.setenv(s.env, samples[s.kind])
    serve, stats = _serve(), build_parser().parse_args(["stats"])
    for s in serve_settings():
        assert getattr(serve, s.dest) == s.kind(samples[s.kind]), s.flag
    for s in CLIENT_SETTINGS:
        assert getattr(stats, s.dest) == s.kind(samples[s.kind]), s.flag
    assert _serve("--max-nodes", "9").max_nodes == 9  # the flag wins over its variable


def test_flags_fill_the_config(monkeypatch):
    monkeypatch.setenv("DRAFTER_METRICS_INTERVAL", "0.5")
    cfg = config_from_args(_serve(
        "--max-nodes", "16", "--workers", "8", "--snapshot-interval", "2.5", "--follow-log", "on",
        "--replica-id", "r1", "--rebuild-in-subprocess", "0", "--namespaces", "alpha=10, beta=20",
        "--sources", "store,frozen", "--draft-model", "m0,beta=m1", "--draft-device", "cuda:1", "--draft-threads",
        "3", "--card-idle", "1", "--card-correction", "0", "--card-layers", "2"))
    assert (cfg.drafter.max_nodes, cfg.workers, cfg.max_streams) == (16, 8, 6)  # int
    assert (cfg.snapshot_interval_s, cfg.metrics_interval_s) == (2.5, 0.5)  # float
    assert (cfg.follow_log, cfg.replica_id) == ("on", "r1")  # str
    assert cfg.rebuild_in_subprocess is False  # 0/1
    assert cfg.namespaces == (NamespaceSpec("default", 262144), NamespaceSpec("alpha", 10), NamespaceSpec("beta", 20))
    assert [(d.use_store, d.use_frozen, d.use_session, d.use_dynamic, d.use_repeat) for d in [cfg.drafter]] == [
        (True, True, False, False, False)]
    card = CardSettings(idle_priority=True, correction=False, layers_ahead=2)
    assert cfg.draft_models == (DraftModelSpec("default", "m0", device="cuda:1", threads=3, card=card),
                                DraftModelSpec("beta", "m1", device="cuda:1", threads=3, card=card))
    with pytest.raises(ValueError, match="unknown sources"):
        config_from_args(_serve("--sources", "store,nope"))
    with pytest.raises(ValueError, match="NAME=VOCAB_SIZE"):
        config_from_args(_serve("--namespaces", "alpha"))


def test_a_bad_environment_value_exits_with_a_message_naming_the_variable(monkeypatch):
    monkeypatch.setenv("DRAFTER_MAX_NODES", "many")
    with pytest.raises(SystemExit, match="DRAFTER_MAX_NODES='many'"):
        build_parser()
    monkeypatch.delenv("DRAFTER_MAX_NODES")
    monkeypatch.setenv("DRAFTER_TLS", "yes")
    with pytest.raises(SystemExit, match="DRAFTER_TLS='yes'"):
        build_parser()
    done = subprocess.run([sys.executable, "-m", "drafter_service.cli.main", "serve", "--help"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                          "DRAFTER_METRICS_INTERVAL": "often"}, timeout=120)
    assert done.returncode == 1 and "DRAFTER_METRICS_INTERVAL='often'" in done.stderr


def test_the_machinery_on_a_small_dataclass():
    @dataclasses.dataclass(frozen=True)
    class Toy:
        plain: int = 1
        size: int = dataclasses.field(default=3, metadata=setting("--toy-size", "a size", "toys"))
        on: bool = dataclasses.field(default=True, metadata=setting("--toy-on", "a switch", "toys"))
        names: tuple[str, ...] = dataclasses.field(default=(), metadata=setting(
            "--toy-names", "names", "toys", parse=lambda text: tuple(text.split(",")) if text else ()))

    declared = settings_of(Toy)
    assert [(s.field, s.flag, s.env, s.default, s.kind) for s in declared] == [
        ("size", "--toy-size", "DRAFTER_TOY_SIZE", 3, int), ("on", "--toy-on", "DRAFTER_TOY_ON", 1, int),
        ("names", "--toy-names", "DRAFTER_TOY_NAMES", "", str)]
    parser = argparse.ArgumentParser()
    add_settings(parser, declared, environ={"DRAFTER_TOY_SIZE": "5"})
    assert Toy(**values_from_args(declared, parser.parse_args([]))) == Toy(size=5)
    args = parser.parse_args(["--toy-on", "0", "--toy-names", "a,b"])
    assert Toy(**values_from_args(declared, args)) == Toy(size=5, on=False, names=("a", "b"))

    @dataclasses.dataclass
    class Bad:
        names: tuple[str, ...] = dataclasses.field(default=(), metadata=setting("--bad-names", "names", "toys"))

    with pytest.raises(TypeError, match="needs an empty default and a parse"):
        settings_of(Bad)
