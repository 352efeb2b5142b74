"""Reading Mooncake-format traces (tierkv.trace.format)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.trace.format import TraceError, TraceRequest, read_trace, request_keys


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_requests_read_in_order_and_limit(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]}',
        "",
        '{"timestamp": 40, "input_length": 600, "hash_ids": [0, 2]}',
    )
    assert read_trace(path) == [
        TraceRequest(0.0, 1024, 3, (0, 1)),
        TraceRequest(40.0, 600, 0, (0, 2)),
    ]
    assert len(read_trace(path, limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "trace.jsonl:1: not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"timestamp": 0, "input_length": 5}', "missing hash_ids"),
        (
            '{"timestamp": 0, "input_length": 5, "hash_ids": ["a"]}',
            "hash_ids must be a list of integers",
        ),
        ('{"timestamp": -1, "input_length": 5, "hash_ids": []}', "timestamp must be"),
        ('{"timestamp": 0, "input_length": 1.5, "hash_ids": []}', "input_length must be"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        read_trace(write(tmp_path, line))


def test_an_empty_or_missing_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write(tmp_path, ""))
    with pytest.raises(TraceError, match=r"nope\.jsonl"):
        read_trace(tmp_path / "nope.jsonl")


def test_equal_prefixes_give_equal_keys_and_a_key_names_its_prefix() -> None:
    a = request_keys(TraceRequest(0, 0, 0, (7, 8, 9)))
    b = request_keys(TraceRequest(0, 0, 0, (7, 8, 5)))
    c = request_keys(TraceRequest(0, 0, 0, (1, 8, 9)))
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)  # same ids after a different first block: other keys


def test_a_tenant_is_read_when_given_and_none_otherwise(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"timestamp": 0, "input_length": 512, "hash_ids": [0], "tenant": "acme"}',
        '{"timestamp": 1, "input_length": 512, "hash_ids": [0], "tenant": null}',
        '{"timestamp": 2, "input_length": 512, "hash_ids": [0]}',
    )
    assert [r.tenant for r in read_trace(path)] == ["acme", None, None]


@pytest.mark.parametrize("value", ['""', '"  "', "7", '["acme"]', "true", '{"name": "a"}'])
def test_a_tenant_that_is_not_a_non_empty_string_names_the_line_and_value(
    tmp_path: Path, value: str
) -> None:
    lines = ['{"timestamp": 0, "input_length": 0, "hash_ids": []}']
    lines.append(f'{{"timestamp": 1, "input_length": 0, "hash_ids": [], "tenant": {value}}}')
    with pytest.raises(TraceError) as exc:
        read_trace(write(tmp_path, *lines))
    message = str(exc.value)
    assert message.startswith(f"{tmp_path / 'trace.jsonl'}:2: tenant must be a non-empty string")
    assert value.replace(" ", "") in message.replace(" ", "")  # the value as written
    assert "leave it out for the default tenant" in message


def test_the_tenant_does_not_change_the_keys() -> None:
    """Two tenants sending the same ids ask for the same blocks (a shared prefix)."""
    a = request_keys(TraceRequest(0, 0, 0, (7, 8, 9), tenant="A"))
    b = request_keys(TraceRequest(0, 0, 0, (7, 8, 9), tenant="B"))
    assert a == b == request_keys(TraceRequest(0, 0, 0, (7, 8, 9)))
