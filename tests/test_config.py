"""YAML config: valid chains load; every bad input names its path and value."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tierkv.config import load_config, parse_config
from tierkv.contract.errors import ConfigError, UnknownTierType
from tierkv.memory_tier import MemoryTierConfig

GOOD = """
namespace: llama3-8b-bf16-tp1
layout:
  block_bytes: 2MiB
  groups:
    - {kind: full, block_size: 16}
    - {kind: sliding_window, block_size: 16, window: 4096}
primary: {capacity: 8GiB, eviction: arc}
tiers:
  - {type: memory, capacity: 512MiB, write_policy: write_back, job_timeout: 250ms}
"""


def problems(text: str, **kwargs: object) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(text, **kwargs)  # type: ignore[arg-type]
    return err.value.problems


def test_a_good_chain_loads_with_units_resolved() -> None:
    config = parse_config(GOOD)
    assert config.namespace == "llama3-8b-bf16-tp1"
    assert config.layout.block_bytes == 2 * 2**20
    assert config.layout.groups[1].window == 4096
    assert config.primary.capacity == 8 * 2**30 and config.primary.eviction == "arc"
    assert config.primary.pin_memory == "auto"
    assert config.primary_blocks == 4096
    [tier] = config.tiers
    assert isinstance(tier, MemoryTierConfig)
    assert tier.capacity == 512 * 2**20
    assert tier.write_policy == "write_back" and tier.job_timeout == 0.25


def test_defaults() -> None:
    config = parse_config(
        "namespace: n\nlayout: {block_bytes: 1024, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\n"
    )
    assert config.tiers == [] and config.primary.eviction == "lru"
    assert config.layout.groups[0].kind == "full"


def test_bad_size_names_path_and_value() -> None:
    text = GOOD.replace("capacity: 512MiB", "capacity: 12 parsecs")
    assert problems(text) == [
        "tiers[0].capacity: '12 parsecs' is not a size (use e.g. 8GiB, 512MiB, 4096)"
    ]


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        ("-1GiB", "tiers[0].capacity: '-1GiB' is negative; a size must be positive (e.g. 8GiB)"),
        ("-5", "tiers[0].capacity: -5 is negative; a size must be positive (e.g. 8GiB)"),
        ("0", "tiers[0].capacity: 0 holds nothing; it must be positive (e.g. 1GiB)"),
    ],
)
def test_a_capacity_that_holds_nothing_must_be_positive(capacity: str, message: str) -> None:
    """Not "is not a size" for a minus sign, nor pydantic's "Input should be greater
    than 0" for zero."""
    assert problems(GOOD.replace("capacity: 512MiB", f"capacity: {capacity}")) == [message]


def test_a_misspelt_tier_type_gets_did_you_mean() -> None:
    with pytest.raises(UnknownTierType) as err:
        parse_config(GOOD.replace("type: memory", "type: memoryy"))
    assert "did you mean 'memory'?" in err.value.problems[0]


def test_malformed_yaml_gives_line_and_column() -> None:
    [problem] = problems("namespace: x\nlayout: {block_bytes: 1\n  groups: [\n")
    assert problem.startswith("malformed YAML: line ")


def test_top_level_must_be_a_mapping() -> None:
    assert "expected a mapping" in problems("- a\n- b\n")[0]


def test_unknown_tier_type_lists_the_installed_ones() -> None:
    with pytest.raises(UnknownTierType) as err:
        parse_config(GOOD.replace("type: memory", "type: floppy"))
    [problem] = err.value.problems
    assert problem.startswith("tiers[0].type: unknown tier type 'floppy'")
    assert "installed tier types: memory" in problem


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("namespace: llama", "namspace: llama"), "namspace: unknown field"),
        (
            ("eviction: arc", "eviction: arc, evicton: lru"),
            "primary.evicton: unknown field; did you mean 'eviction'?",
        ),
        (
            ("write_policy: write_back", "write_polcy: write_back"),
            "tiers[0].write_polcy: unknown field; did you mean 'write_policy'?",
        ),
        (
            ("block_size: 16}\n", "block_size: 16, colour: red}\n"),
            "layout.groups[0].colour: unknown field",
        ),
    ],
)
def test_unknown_fields_are_rejected_with_a_suggestion(
    edit: tuple[str, str], expected: str
) -> None:
    found = problems(GOOD.replace(*edit, 1))
    assert any(p.startswith(expected) for p in found), found


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ("eviction: arc", "eviction: fifo"),
            "primary.eviction: 'fifo': Input should be 'lru' or 'arc'",
        ),
        (
            ("write_policy: write_back", "write_policy: sometimes"),
            "tiers[0].write_policy: 'sometimes'",
        ),
        (
            ("job_timeout: 250ms", "job_timeout: soon"),
            "tiers[0].job_timeout: 'soon' is not a duration (use e.g. 250ms, 2s, 1m)",
        ),
        (("window: 4096", "window: -3"), "layout.groups[1].window: -3"),
        (
            (
                "kind: sliding_window, block_size: 16, window: 4096",
                "kind: sliding_window, block_size: 16",
            ),
            "layout.groups[1]: ",
        ),
        (("namespace: llama3-8b-bf16-tp1", "namespace: ''"), "namespace: ''"),
        (("capacity: 8GiB", "capacity: 1MiB"), "primary.capacity: 1MiB holds no block of 2MiB"),
    ],
)
def test_bad_values_name_path_and_value(edit: tuple[str, str], expected: str) -> None:
    found = problems(GOOD.replace(*edit, 1))
    assert any(p.startswith(expected) for p in found), found


def test_missing_sections_are_each_reported() -> None:
    found = problems("namespace: x\n")
    assert "layout: is required" in found and "primary: is required" in found


def test_tiers_shape_errors() -> None:
    base = GOOD.split("tiers:")[0]
    assert problems(base + "tiers: memory\n") == [
        "tiers: expected a list of tier sections (`- {type: ...}` items), got 'memory'"
    ]
    assert problems(base + "tiers:\n  - capacity: 1GiB\n") == [
        "tiers[0].type: is required (the tier type, e.g. memory, nvme)"
    ]
    assert problems(base + "tiers:\n  - memory\n")[0].startswith("tiers[0]: expected a mapping")


def test_all_problems_are_reported_at_once() -> None:
    text = GOOD.replace("eviction: arc", "eviction: fifo").replace("512MiB", "lots")
    assert len(problems(text)) == 2


def test_environment_variables_expand() -> None:
    text = GOOD.replace("512MiB", "'${TIER_CAP}'").replace(
        "llama3-8b-bf16-tp1", "m-${TENANT:-public}-$$x"
    )
    config = parse_config(text, env={"TIER_CAP": "1GiB"})
    assert config.tiers[0].capacity == 2**30  # type: ignore[attr-defined]
    assert config.namespace == "m-public-$x"


def test_unset_environment_variable_is_an_error_naming_it() -> None:
    text = GOOD.replace("512MiB", "'${TIER_CAP}'")
    assert problems(text, env={}) == [
        "tiers[0].capacity: environment variable TIER_CAP is not set "
        "(set it, or write ${TIER_CAP:-default})"
    ]


def test_load_config_reads_a_file_and_names_it_in_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    assert load_config(good).namespace == "llama3-8b-bf16-tp1"
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("arc", "fifo"))
    with pytest.raises(
        ConfigError, match=r"invalid tierkv config in .*bad.yaml:\n  primary.eviction"
    ):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_tier_names_are_types_or_indexed_when_repeated() -> None:
    base = GOOD.split("tiers:")[0]
    config = parse_config(base + "tiers:\n  - {type: memory}\n  - {type: memory}\n")
    assert config.tier_names() == ["memory-0", "memory-1"]
    assert parse_config(GOOD).tier_names() == ["memory"]


def test_errors_never_show_secrets(faulty_tier_type: str) -> None:
    from pydantic import model_validator

    from tierkv.registry import register_tier, unregister_tier
    from tierkv.testing import FaultyTier, FaultyTierConfig

    class SecretConfig(FaultyTierConfig):
        url: str = "redis://127.0.0.1"
        password: str | None = None

        @model_validator(mode="before")
        @classmethod
        def _whole_section(cls, data: object) -> object:
            if isinstance(data, dict) and data.get("password") == "twice":
                raise ValueError("the password is given twice")
            return data

    class SecretTier(FaultyTier):
        Config = SecretConfig

        @staticmethod
        def get_tier_type() -> str:
            return "secretive"

    register_tier(SecretTier)
    try:
        base = GOOD.split("tiers:")[0] + "tiers:\n"
        found = problems(
            base + "  - {type: secretive, url: 'redis://:hunter2@h:6379/0', password: twice}\n"
        )
        assert found == ["tiers[0]: the password is given twice"]
        found = problems(base + "  - {type: secretive, password: [hunter2]}\n")
        assert found and all("hunter2" not in p for p in found), found
        found = problems(base + "  - {type: secretive, url: ['redis//:hunter2@h']}\n")
        assert found and all("hunter2" not in p for p in found), found
    finally:
        unregister_tier("secretive")


def test_shown_values_mask_secrets_and_url_passwords() -> None:
    from tierkv.config.messages import shown as _shown

    assert _shown(("tiers", 0, "password"), "hunter2") == "'***'"
    assert _shown(("tiers", 0, "secret_access_key"), "abc") == "'***'"
    assert _shown(("tiers", 0, "url"), "redis://:hunter2@h:1/0") == "'redis://:***@h:1/0'"
    assert _shown(("tiers", 0, "url"), "redis//:hunter2@h") == "'***@h'"
    assert _shown(("primary", "capacity"), "12 parsecs") == "'12 parsecs'"


# -- issue 14: what validate must catch -----------------------------------------------------
HEAD = "namespace: n\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"


def test_a_file_that_is_not_utf8_names_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes((HEAD + "primary: {capacity: 1MiB}\n# caf\xe9\n").encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert err.value.problems == [
        "line 4, column 6: byte 0xe9 is not UTF-8; save the file as UTF-8"
    ]


def test_duplicate_keys_are_rejected_by_path() -> None:
    found = problems(
        "namespace: a\nnamespace: b\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\n"
        "tiers:\n  - {type: memory, capacity: 1MiB, capacity: 2MiB}\n"
    )
    assert found == [
        "namespace: duplicate key (line 2; first at line 1); write each key once",
        "tiers[0].capacity: duplicate key (line 6; first at line 6); write each key once",
    ]


def test_a_bad_group_kind_is_one_problem() -> None:
    found = problems(
        "namespace: n\nlayout: {block_bytes: 4KiB, groups: [{kind: weird, block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\n"
    )
    assert found == [
        "layout.groups[0].kind: 'weird': Input should be 'full', 'sliding_window' or 'state'"
    ]


def test_checkpoints_off_every_group_boundary_are_named_by_their_path() -> None:
    found = problems(
        "namespace: n\nlayout: {block_bytes: 4KiB, checkpoint_every: 40, groups: "
        "[{block_size: 16}, {kind: state, block_size: 32}]}\nprimary: {capacity: 1MiB}\n"
    )
    assert found == [
        "layout.checkpoint_every: 40 is not a multiple of every group's block_size (16, 32): "
        "a hit can only land on a multiple of 32; use e.g. 32"
    ]


def test_pin_memory_errors_speak_yaml_not_pydantic() -> None:
    found = problems(HEAD + "primary: {capacity: 1MiB, pin_memory: maybe}\n")
    assert found == ["primary.pin_memory: 'maybe': should be 'auto' or true or false"]


def test_tiers_can_be_named_and_names_are_unique() -> None:
    config = parse_config(
        HEAD + "primary: {capacity: 1MiB}\n"
        "tiers: [{type: memory, name: hot}, {type: memory}, {type: memory, name: cold}]\n"
    )
    assert config.tier_names() == ["hot", "memory", "cold"]
    assert problems(
        HEAD + "primary: {capacity: 1MiB}\ntiers: [{type: memory, name: a}, "
        "{type: memory, name: a}, {type: memory, name: cpu}, {type: memory, name: 'a b'}]\n"
    ) == [
        "tiers[3].name: 'a b' is not a tier name (letters, digits, _ . -; at most 63, "
        "starting with a letter or digit)",
        "tiers[1].name: 'a' is already the name of tiers[0]; tier names must be unique "
        "(set `name:` on one of them)",
        "tiers[2].name: 'cpu' is the primary's name; choose another",
    ]
    # an explicit name may not take the name an unnamed tier gets
    assert problems(
        HEAD + "primary: {capacity: 1MiB}\ntiers: [{type: memory, name: nvme}, "
        "{type: nvme, path: /tmp/x, capacity: 1MiB}]\n"
    ) == [
        "tiers[1]: 'nvme' is already the name of tiers[0]; tier names must be unique "
        "(set `name:` on one of them)"
    ]


def test_two_tiers_on_one_path_are_rejected(tmp_path: Path) -> None:
    chain = (
        HEAD + "primary: {capacity: 1MiB}\ntiers:\n"
        f"  - {{type: nvme, path: {tmp_path}/kv, capacity: 1MiB}}\n"
        f"  - {{type: nvme, path: '{tmp_path}/kv/', capacity: 1MiB}}\n"
        f"  - {{type: nvme, path: {tmp_path}/kv/inner, capacity: 1MiB}}\n"
    )
    found = problems(chain)
    assert found[0] == f"tiers[1].path: '{tmp_path}/kv' is also the path of tiers[0]"
    assert found[1].startswith(f"tiers[2].path: '{tmp_path}/kv/inner' and tiers[0].path")
    assert found[1].endswith("nest; give each tier a directory of its own")


SECRET = "hunter2"


@pytest.mark.parametrize(
    ("tiers", "expected"),
    [
        (
            f"{{type: redis, url: 'redis://:{SECRET}@h:6379/0'}}",
            "tiers: expected a list of tier sections (`- {type: ...}` items), got a mapping",
        ),
        (
            f"['redis://:{SECRET}@h:6379/0']",
            "tiers[0]: expected a mapping with a `type` (e.g. {type: nvme, ...}), got a string",
        ),
        (
            f"['type: redis, password: {SECRET}']",
            "tiers[0]: expected a mapping with a `type` (e.g. {type: nvme, ...}), got a string",
        ),
    ],
)
def test_tier_sections_of_the_wrong_shape_never_echo_their_value(tiers: str, expected: str) -> None:
    assert problems(HEAD + f"primary: {{capacity: 1MiB}}\ntiers: {tiers}\n") == [expected]


@pytest.mark.parametrize("secret", [SECRET, "se/cr+et"])
def test_an_s3_url_with_credentials_is_never_echoed(secret: str) -> None:
    pytest.importorskip("tierkv_s3")
    found = problems(
        HEAD
        + f"primary: {{capacity: 1MiB}}\ntiers: [{{type: s3, url: 's3://AKIA:{secret}@b/p'}}]\n"
    )
    assert found and all(piece not in p for p in found for piece in (secret, *secret.split("/"))), (
        found
    )
    assert found[0].startswith("tiers[0].url: 's3://AKIA:***@b/p'")


def test_model_dump_masks_secrets() -> None:
    pytest.importorskip("tierkv_redis")
    config = parse_config(
        HEAD + "primary: {capacity: 1MiB}\ntiers:\n"
        f"  - {{type: redis, url: 'redis://user:{SECRET}@h:6379/0'}}\n"
        f"  - {{type: redis, name: r2, url: 'redis://h:6379/1', password: {SECRET}}}\n"
    )
    dumped = config.model_dump()
    assert dumped["tiers"][0]["url"] == "redis://user:***@h:6379/0"
    assert dumped["tiers"][1]["password"] == "***"
    assert dumped["tiers"][1]["name"] == "r2"
    assert SECRET not in config.model_dump_json() and SECRET not in str(dumped)
    assert SECRET not in repr(config)


def test_environment_defaults_may_nest() -> None:
    text = GOOD.replace("llama3-8b-bf16-tp1", "${NS:-${USER_NS:-x}-y}")
    assert parse_config(text, env={}).namespace == "x-y"
    assert parse_config(text, env={"USER_NS": "u"}).namespace == "u-y"
    assert parse_config(text, env={"NS": "n"}).namespace == "n"


def test_a_decimal_or_bit_block_size_is_an_error_with_the_binary_spelling() -> None:
    assert problems(GOOD.replace("block_bytes: 2MiB", "block_bytes: 2MB")) == [
        "layout.block_bytes: '2MB' is 2,000,000 bytes (decimal); block sizes are binary: "
        "did you mean '2MiB'?"
    ]
    assert problems(GOOD.replace("block_bytes: 2MiB", "block_bytes: 2Mb")) == [
        "layout.block_bytes: '2Mb' is a size in bits (a lowercase b is a bit); sizes are "
        "in bytes: did you mean '2MiB'?"
    ]
    # a plain number is bytes, whatever it is
    assert parse_config(GOOD.replace("block_bytes: 2MiB", "block_bytes: 2000000"))


def test_bits_are_an_error_for_every_size(caplog: pytest.LogCaptureFixture) -> None:
    assert problems(GOOD.replace("capacity: 512MiB", "capacity: 4Gb")) == [
        "tiers[0].capacity: '4Gb' is a size in bits (a lowercase b is a bit); sizes are in "
        "bytes: did you mean '4GiB'?"
    ]


def test_a_decimal_size_elsewhere_is_a_logged_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Warnings go to the `tierkv.config` loggers (one record per size, naming the file
    and YAML path); the config still loads, with the decimal size as written."""
    text = GOOD.replace("capacity: 8GiB", "capacity: 8GB").replace("512MiB", "'${CAP}'")
    with caplog.at_level(logging.WARNING, logger="tierkv.config"):
        config = parse_config(text, source="tiers.yaml", env={"CAP": "500MB"})
    [tier] = config.tiers
    assert isinstance(tier, MemoryTierConfig)
    assert config.primary.capacity == 8 * 10**9 and tier.capacity == 500 * 10**6
    assert [(r.name.startswith("tierkv.config"), r.levelno) for r in caplog.records] == [
        (True, logging.WARNING),
        (True, logging.WARNING),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "tiers.yaml: primary.capacity: '8GB' is 8,000,000,000 bytes (decimal); did you "
        "mean '8GiB' (8,589,934,592 bytes)? Write 8000000000 to keep this size",
        "tiers.yaml: tiers[0].capacity: '500MB' is 500,000,000 bytes (decimal); did you "
        "mean '500MiB' (524,288,000 bytes)? Write 500000000 to keep this size",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv.config"):
        parse_config(GOOD)
    assert caplog.records == []


def test_a_size_that_is_wrong_twice_is_reported_once() -> None:
    assert problems(GOOD.replace("block_bytes: 2MiB", "block_bytes: 0MB")) == [
        "layout.block_bytes: '0MB' holds nothing; it must be positive (e.g. 1GiB)"
    ]


def test_machine_checks_are_reported_with_structural_errors(tmp_path: Path) -> None:
    """Each check runs on what parsed: a primary larger than memory is found beside an
    unknown field of another section, a disk tier larger than its filesystem beside a
    bad sibling tier; a capacity that is not a size is checked only once it is one."""
    text = (
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}], extra: 1}\n"
        "primary: {capacity: 99999TiB}\n"
        f"tiers:\n  - {{type: nvme, path: {tmp_path}/kv, capacity: 500TiB}}\n"
        "  - {type: memory, capacity: lots}\n"
    )
    found = problems(text, check_machine=True)
    assert (
        found[0] == "layout.extra: unknown field (allowed: block_bytes, checkpoint_every, groups)"
    )
    assert found[1] == "tiers[1].capacity: 'lots' is not a size (use e.g. 8GiB, 512MiB, 4096)"
    assert found[2].startswith("primary.capacity: 99999TiB is more than this machine's memory")
    assert found[3].startswith(
        f"tiers[0].capacity: 500TiB is more than the filesystem under '{tmp_path}'"
    )
    assert len(found) == 4
    # without check_machine only the structural problems
    assert problems(text) == found[:2]


def test_validate_a_decimal_block_exits_2_with_the_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The error goes to stderr; the warning about the decimal capacity to the log
    (stderr too, through the CLI's logging setup, which pytest replaces here)."""
    from tierkv.cli import main

    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 2MB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 8MiB}\ntiers: [{type: memory, capacity: 4MB}]\n"
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"invalid tierkv config in {path}:" in err
    assert (
        "layout.block_bytes: '2MB' is 2,000,000 bytes (decimal); block sizes are binary: "
        "did you mean '2MiB'?"
    ) in err
    assert err.count("'2MB'") == 1
    [warning] = [r.getMessage() for r in caplog.records if r.name.startswith("tierkv.config")]
    assert warning.startswith(f"{path}: tiers[0].capacity: '4MB' is 4,000,000 bytes (decimal)")
