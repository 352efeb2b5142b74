"""The integrity section measures both framings on real blocks."""

from __future__ import annotations

from tierkv.bench import bench_integrity, integrity_summary


def test_reports_both_framings_and_the_mac_ratio() -> None:
    report = bench_integrity(64 << 10, blocks=2)
    for name in ("checksum_encode_s", "checksum_decode_s", "mac_encode_s", "mac_decode_s"):
        assert report[name] > 0
    assert report["mac_ratio"] > 0
    assert report["blake3_GBps"] > 0 and report["blake2b_GBps"] > 0
    [line] = integrity_summary(report)
    assert "MAC costs" in line and "x checksum-only" in line
