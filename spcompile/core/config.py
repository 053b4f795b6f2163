"""``Config``: one compilation decision (pipeline, template, parameters, target, format)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """A compilation decision: pass pipeline (with options), template, its parameters, target.

    ``precision``: the lowest arithmetic precision the configuration computes in (see
    :mod:`spcompile.core.numerics`); templates fill it in (``Template.make_config``)."""

    template: str
    params: Mapping[str, Any] = field(default_factory=dict)
    pipeline: tuple = ()
    target: str = "cpu"
    format: str = "csr"
    precision: str = "fp32"

    def to_dict(self) -> dict:
        return {"template": self.template, "params": dict(self.params),
                "pipeline": [dict(p) for p in self.pipeline], "target": self.target, "format": self.format,
                "precision": self.precision}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Config":
        return cls(template=d["template"], params=dict(d.get("params", {})),
                   pipeline=tuple(dict(p) for p in d.get("pipeline", ())), target=d.get("target", "cpu"),
                   format=d.get("format", "csr"),
                   precision=str(d.get("precision") or dict(d.get("params", {})).get("precision", "fp32")))

    def __str__(self) -> str:
        pipe = " -> ".join(p["name"] + (str(p["options"]) if p.get("options") else "") for p in self.pipeline)
        prec = "" if self.precision == "fp32" else f" precision={self.precision}"
        return (f"target={self.target} pipeline=[{pipe}] format={self.format} "
                f"template={self.template} params={dict(self.params)}{prec}")
