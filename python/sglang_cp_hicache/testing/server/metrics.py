"""A server's Prometheus ``/metrics`` (``--enable-metrics``), parsed: values by name and
labels, summed or per TP rank."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from typing import Dict, Tuple

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')

Sample = Tuple[str, Tuple[Tuple[str, str], ...], float]


@dataclass(frozen=True)
class Metrics:
    samples: Tuple[Sample, ...]

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        samples = []
        for line in text.splitlines():
            match = _SAMPLE.match(line.strip())
            if match is None or line.startswith("#"):
                continue
            labels = tuple(sorted(_LABEL.findall(match.group("labels") or "")))
            samples.append((match.group("name"), labels, float(match.group("value"))))
        return cls(tuple(samples))

    @classmethod
    def fetch(cls, url: str, timeout_s: float = 10.0) -> "Metrics":
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as response:
            return cls.parse(response.read().decode())

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over every sample whose labels include ``labels``."""
        return sum(value for n, l, value in self.samples if n == name and labels.items() <= dict(l).items())

    def per_rank(self, name: str, rank_label: str = "tp_rank", **labels: str) -> Dict[int, float]:
        """``name`` summed per ``rank_label`` (``tp_rank``; upstream's storage series carry
        ``attn_cp_rank`` with ``tp_rank`` 0 on every CP rank) over the samples whose labels
        include ``labels``."""
        ranks: Dict[int, float] = {}
        for n, sample_labels, value in self.samples:
            found = dict(sample_labels)
            rank = found.get(rank_label)
            if n == name and rank is not None and labels.items() <= found.items():
                ranks[int(rank)] = ranks.get(int(rank), 0.0) + value
        return ranks


__all__ = ["Metrics"]
