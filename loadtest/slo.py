"""Service-level objectives: checks locust's `<prefix>_stats.csv` against a TOML file of objectives.

    python -m loadtest.slo var/loadtest/locust_stats.csv --slo loadtest/slo.toml    # exit 1 if one is missed

The file (loadtest/slo.toml is the shipped one):

    min_requests = 5                    # fewer requests than this: the entry's objectives were not measured
    [total]
    max_failure_ratio = 0.01            # over every request of the run (locust's "Aggregated" row)
    [entries."POST /v1/score"]          # "<locust type> <name>", as in locust's report
    p50_ms = 150                        # any of locust's percentiles: p50 p66 p75 p80 p90 p95 p98 p99 p99.9 p99.99 p100
    p99_ms = 600
    max_failure_ratio = 0.01            # optional; also min_requests

An entry the run did not measure (absent, or under min_requests requests) misses its objectives, unless
`--allow-missing` (a run of only some user classes). Locust's percentiles are rounded to two significant
digits, so objectives are checked to that resolution.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TOTAL", "Result", "check", "load_slo", "main", "read_stats"]

TOTAL = "total"  # the name of locust's "Aggregated" row in results
_PERCENTILE = re.compile(r"^p(\d+(?:\.\d+)?)_ms$")
_ENTRY_KEYS = {"max_failure_ratio", "min_requests"}


@dataclass(frozen=True)
class Result:
    entry: str  # "<type> <name>", or TOTAL
    objective: str  # "p99_ms", "max_failure_ratio", "min_requests"
    limit: float
    measured: float | None  # None: the entry was not measured
    ok: bool

    def line(self) -> str:
        measured = "not measured" if self.measured is None else f"{self.measured:g}"
        return f"{'ok  ' if self.ok else 'MISS'}  {self.entry}: {self.objective} {measured} (objective {self.limit:g})"


def load_slo(path: str | Path) -> dict[str, Any]:
    """The objectives of a TOML file, checked for unknown keys (a typo must not silently drop an objective)."""
    data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    unknown = set(data) - {"min_requests", "total", "entries"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    if set(data.get("total", {})) - {"max_failure_ratio"}:
        raise ValueError(f"{path}: [total] takes only max_failure_ratio")
    for entry, objectives in data.get("entries", {}).items():
        for key in objectives:
            if key not in _ENTRY_KEYS and not _PERCENTILE.match(key):
                raise ValueError(f"{path}: [entries.{entry!r}] unknown objective {key!r}")
    return data


def read_stats(path: str | Path) -> dict[str, dict[str, str]]:
    """Rows of locust's stats CSV by "<type> <name>"; the "Aggregated" row under TOTAL."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    stats: dict[str, dict[str, str]] = {}
    for row in rows:
        key = TOTAL if row["Name"] == "Aggregated" and not row["Type"] else f"{row['Type']} {row['Name']}"
        stats[key] = row
    return stats


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "", "N/A") else None
    except ValueError:
        return None


def _failure_ratio(row: Mapping[str, str]) -> float | None:
    requests, failures = _number(row.get("Request Count")), _number(row.get("Failure Count"))
    if not requests or failures is None:
        return None
    return failures / requests


def check(slo: Mapping[str, Any], stats: Mapping[str, Mapping[str, str]], allow_missing: bool = False) -> list[Result]:
    """Every objective of `slo` against `stats` (read_stats); entries absent from a run are skipped only with
    `allow_missing`."""
    results: list[Result] = []
    default_min = float(slo.get("min_requests", 1))
    total = slo.get("total", {})
    if "max_failure_ratio" in total:
        limit = float(total["max_failure_ratio"])
        ratio = _failure_ratio(stats[TOTAL]) if TOTAL in stats else None
        results.append(Result(TOTAL, "max_failure_ratio", limit, ratio, ratio is not None and ratio <= limit))
    for entry, objectives in slo.get("entries", {}).items():
        row = stats.get(entry)
        if row is None and allow_missing:
            continue
        min_requests = float(objectives.get("min_requests", default_min))
        count = _number(row.get("Request Count")) if row else None
        if count is None or count < min_requests:
            results.append(Result(entry, "min_requests", min_requests, count, False))
            continue
        assert row is not None
        for key, limit in objectives.items():
            if key == "min_requests":
                continue
            if key == "max_failure_ratio":
                ratio = _failure_ratio(row)
                results.append(Result(entry, key, float(limit), ratio, ratio is not None and ratio <= limit))
                continue
            match = _PERCENTILE.match(key)
            assert match is not None  # load_slo checked the keys
            value = _number(row.get(f"{match.group(1)}%"))
            results.append(Result(entry, key, float(limit), value, value is not None and value <= limit))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.slo", description=__doc__.split("\n")[0])
    parser.add_argument("stats", help="locust's <prefix>_stats.csv")
    parser.add_argument("--slo", default=str(Path(__file__).resolve().parent / "slo.toml"), help="objectives (TOML)")
    parser.add_argument("--allow-missing", action="store_true",
                        help="skip the entries the run did not measure (a run of only some user classes)")
    args = parser.parse_args(argv)
    try:
        results = check(load_slo(args.slo), read_stats(args.stats), allow_missing=args.allow_missing)
    except (OSError, ValueError, KeyError, tomllib.TOMLDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for result in results:
        print(result.line())
    missed = [r for r in results if not r.ok]
    print(f"service-level objectives: {len(results) - len(missed)} of {len(results)} met"
          + (f", {len(missed)} MISSED" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
