import pytest
from kvpool.common.config import (
    ConfigError,
    MasterConfig,
    load,
    parse_duration,
    parse_size,
)


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096),
    ("64 KiB", 64 << 10), (4096, 4096), ("2mib", 2 << 20),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4Gx", "-1GiB", "0", "GiB", "1e9", "4 GiB extra", True])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("text, expected", [
    ("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), ("1.5", 1.5), (3, 3.0)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["ten", "10x", "0s", "", "-5s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError, match="duration"):
        parse_duration(text)


def test_precedence_defaults_yaml_env_flags(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("put_timeout_s: 5s\nlease_ttl_s: 7s\nnode_ttl_s: 9s\n")
    cfg = load(MasterConfig, f, env={"KVPOOL_LEASE_TTL_S": "2s", "KVPOOL_NODE_TTL_S": "3s"},
               node_ttl_s=4.0)
    assert (cfg.put_timeout_s, cfg.lease_ttl_s, cfg.node_ttl_s) == (5.0, 2.0, 4.0)
    assert cfg.quarantine_s == MasterConfig().quarantine_s


def test_bad_config_values(tmp_path):
    with pytest.raises(ConfigError, match="watermark"):
        MasterConfig(high_watermark=0.5, low_watermark=0.6)
    f = tmp_path / "m.yaml"
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load(MasterConfig, f, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load(MasterConfig, tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="default_replicas"):
        load(MasterConfig, None, env={"KVPOOL_DEFAULT_REPLICAS": "two"})
